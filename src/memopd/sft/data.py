"""Turn-level SFT examples and their order: filtering, de-duplication, bin packing, held-out split.

A turn-level example is one call of a kept trajectory: the exact input ids the model saw and the
exact ids it produced (never re-tokenised). It is stored as a one-call `Episode`, so the packing
compiler lays several examples into one sequence with restarting positions and no attention across
examples, and the same records parquet format holds them.
"""
from __future__ import annotations

import math
import random
from bisect import bisect_left, insort
from dataclasses import dataclass

from memopd.config import VIEWS
from memopd.packing import PackingLimitError
from memopd.records import Episode, Invocation, flatten_history


LAYOUTS = VIEWS  # the states an example can put a call's response in (sft.<role>.layouts): those a model acts in


def persistent_state(ep: Episode, t: int) -> list[int]:
    """Call t's input as the persistent-history flattening shows it (packing layout "persistent"): the prefix
    once, then every earlier call's input (after the prefix) and response, then call t's input, with running
    positions. A one-call example with this input predicts call t's response exactly as the packed transcript
    does (tests/test_sft.py)."""
    calls = ep.invocations
    return flatten_history(ep.prefix_len, [list(i.input_ids) for i in calls[:t + 1]],
                           [list(i.output_ids) for i in calls[:t]])[0]


def turn_examples(episodes: list[Episode], min_reward: float,
                  layouts: tuple[str, ...] = ("exact",)) -> tuple[list[Episode], dict]:
    """Kept trajectories (reward >= min_reward) -> de-duplicated one-call examples, and stats.

    An episode without a reward is an error (a threshold cannot judge it). Duplicates are identical
    (input ids, target ids) pairs; the first occurrence is kept, so the result is deterministic.
    Each example's metrics name its source and state: {"source_task", "source_episode", "call", "layout"}.
    `layouts`: "exact" gives each call in the state it was made in; "persistent" adds it in the persistent-history
    flattening (`persistent_state`; the first call's is its exact state, a duplicate).
    """
    if unknown := set(layouts) - set(LAYOUTS):
        raise ValueError(f"unknown SFT example layouts {sorted(unknown)}; choose from {list(LAYOUTS)}")
    examples, seen = [], set()
    kept = candidates = 0
    for e, ep in enumerate(episodes):
        if ep.reward is None:
            raise ValueError(f"episode {e} ({ep.task_id!r}) has no reward: cannot filter it")
        if ep.reward < min_reward:
            continue
        kept += 1
        ep.validate()
        for layout in [x for x in LAYOUTS if x in layouts]:  # in LAYOUTS' order, whatever the config's
            for t, inv in enumerate(ep.invocations):
                candidates += 1
                ids = list(inv.input_ids) if layout == "exact" else persistent_state(ep, t)
                key = (tuple(ids), tuple(inv.output_ids))
                if key in seen:
                    continue
                seen.add(key)
                examples.append(Episode(
                    task_id=f"{ep.task_id}#{t}" + ("" if layout == "exact" else f"@{layout}"), prefix_len=ep.prefix_len,
                    # provenance spans point into other calls, which an example does not hold: in a
                    # single call a retained span is plain context, which is what SFT conditions on
                    invocations=[Invocation(ids, list(inv.output_ids), stop_reason=inv.stop_reason)],
                    reward=ep.reward,
                    metrics={"source_task": ep.task_id, "source_episode": e, "call": t, "layout": layout},
                ))
    stats = {
        "min_reward": min_reward,
        "trajectories_generated": len(episodes),
        "trajectories_kept": kept,
        "turn_candidates": candidates,
        "duplicates_dropped": candidates - len(examples),
        "turn_examples": len(examples),
        "turn_examples_by_layout": {k: sum(x.metrics["layout"] == k for x in examples) for k in layouts},
        "target_tokens": sum(len(x.invocations[0].output_ids) for x in examples),
        "context_tokens": sum(len(x.invocations[0].input_ids) for x in examples),
        "max_example_tokens": max((example_len(x) for x in examples), default=0),
    }
    return examples, stats


def example_len(example: Episode) -> int:
    """Tokens an example takes in a packed sequence (input + target)."""
    inv = example.invocations[0]
    return len(inv.input_ids) + len(inv.output_ids)


def target_len(example: Episode) -> int:
    return len(example.invocations[0].output_ids)


def bin_pack(lengths: list[int], max_len: int, names: list[str] | None = None) -> list[list[int]]:
    """Best-fit bin packing in the given order: each item goes to the open bin with the least room
    that still fits it, else to a new bin. Returns bins as lists of item indices (in insertion order).
    Never exceeds max_len; an item longer than max_len raises PackingLimitError naming it."""
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (room left, bin id)
    for i, n in enumerate(lengths):
        if n > max_len:
            raise PackingLimitError(n, max_len, [names[i] if names else f"example {i}"])
        k = bisect_left(free, (n, -1))
        if k < len(free):
            room, b = free.pop(k)
        else:
            room, b = max_len, len(bins)
            bins.append([])
        bins[b].append(i)
        if room - n > 0:
            insort(free, (room - n, b))
    return bins


@dataclass
class StepPlan:
    """The deterministic data order of a training run.

    Epoch e shuffles the examples with Random((seed, e)) and bin-packs them in that order; the
    epochs' bins form one stream, and optimizer step s takes bins [s*k, (s+1)*k) with
    k = bins_per_step (= grad_accum x world size), so every step is full. A budget in epochs is
    rounded up to whole steps (the last step may take bins of the next epoch's order). The plan is
    a pure function of (lengths, max_len, k, seed, budget): resuming at step s needs only s.
    """

    lengths: list[int]
    max_len: int
    bins_per_step: int
    seed: int
    steps: int | None = None
    epochs: float | None = None

    def __post_init__(self):
        if (self.steps is None) == (self.epochs is None):
            raise ValueError("give exactly one training budget: steps or epochs")
        if not self.lengths:
            raise ValueError("no training examples")
        self._stream: list[list[int]] = []
        self._epoch_bins: list[int] = []
        if self.epochs is not None:
            whole = math.floor(self.epochs)
            for _ in range(whole):
                self._add_epoch()
            n_bins = sum(self._epoch_bins)
            if self.epochs > whole:
                self._add_epoch()
                n_bins += math.ceil((self.epochs - whole) * self._epoch_bins[-1])
            self.total_steps = max(1, math.ceil(n_bins / self.bins_per_step))
        else:
            self.total_steps = self.steps
        self._fill((self.total_steps) * self.bins_per_step)

    def _add_epoch(self):
        order = list(range(len(self.lengths)))
        random.Random(f"{self.seed}/{len(self._epoch_bins)}").shuffle(order)
        bins = bin_pack([self.lengths[i] for i in order], self.max_len)
        self._stream += [[order[j] for j in b] for b in bins]
        self._epoch_bins.append(len(bins))

    def _fill(self, n_bins: int):
        while len(self._stream) < n_bins:
            self._add_epoch()

    def step(self, s: int) -> list[list[int]]:
        """The bins (lists of example indices) of optimizer step s."""
        if not 0 <= s < self.total_steps:
            raise IndexError(f"step {s} outside 0..{self.total_steps - 1}")
        k = self.bins_per_step
        return self._stream[s * k : (s + 1) * k]

    @property
    def epochs_seen(self) -> float:
        """Epochs covered by total_steps (fractional)."""
        left, done = self.total_steps * self.bins_per_step, 0.0
        for n in self._epoch_bins:
            take = min(left, n)
            done += take / n
            left -= take
        return done


def of_layouts(examples: list[Episode], layouts) -> list[Episode]:
    """The examples whose state is in one of `layouts`; an example without one (the pre-training stage's LM text
    and copies, which have no agent state) counts as "exact"."""
    return [x for x in examples if x.metrics.get("layout", "exact") in layouts]


def split_heldout(examples: list[Episode], fraction: float, seed: int) -> tuple[list[Episode], list[Episode]]:
    """(train, held-out): a seeded `fraction` of the source trajectories is held out with all of its
    turns, so that no turn of a held-out trajectory is trained on. fraction 0 holds out nothing."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"eval fraction {fraction} not in [0, 1)")
    sources = sorted({x.metrics.get("source_task", x.task_id) for x in examples})
    random.Random(f"heldout/{seed}").shuffle(sources)
    held = set(sources[: round(fraction * len(sources))])
    train = [x for x in examples if x.metrics.get("source_task", x.task_id) not in held]
    heldout = [x for x in examples if x.metrics.get("source_task", x.task_id) in held]
    return train, heldout


def lm_examples(token_lists: list[list[int]], max_len: int, names: list[str] | None = None) -> list[Episode]:
    """Language-model pre-training data in the SFT example format: each text (already tokenised) is one
    example whose first token is the context and the rest the target, so the SFT trainer's target-only
    loss is the plain next-token loss over the text. A text longer than `max_len` tokens is cut into
    chunks of at most `max_len` that overlap by one token (a chunk's context token is the previous
    chunk's last target), so every token but the text's first is a target exactly once and none is
    dropped. A text of fewer than two tokens has nothing to predict and gives no example."""
    if max_len < 2:
        raise ValueError(f"max_len {max_len} leaves no target token")
    out = []
    for i, ids in enumerate(token_lists):
        name = names[i] if names else str(i)
        for c, start in enumerate(range(0, len(ids) - 1, max_len - 1)):
            chunk = list(ids[start : start + max_len])
            out.append(Episode(task_id=f"{name}@{c}", prefix_len=1,
                               invocations=[Invocation(chunk[:1], chunk[1:])],
                               metrics={"source_task": name, "chunk": c}))
    return out


# sft.pretrain's text examples and copy curriculum when the config leaves them out: LM text on, no copies
PRETRAIN_DEFAULTS = {"lm_text": True, "copy": {"per_text": 0, "span": (8, 48), "context": 1}}


def copy_examples(token_lists: list[list[int]], per_text: int, span: tuple[int, int], sep: list[int], eos: int,
                  seed: int, context: int = PRETRAIN_DEFAULTS["copy"]["context"]) -> list[Episode]:
    """The copy curriculum: `per_text` examples per text, each a random span of span[0]..span[1] tokens of
    it followed by `sep` as context and the same span (+ eos) as target, so that the only way to lower
    the loss is to copy from the context (what the protocol asks at every turn: the question into the
    query, the memory into the next memory, an answer out of a passage). With `context` > 1 the context
    is that many texts (the span's own at a random place among others drawn at random, each followed by
    `sep`): the copy then spans the distances of an agent's prompt, where a model trained on one short
    text at a time does not copy. Seeded; a text shorter than the drawn span is skipped."""
    lo, hi = span
    if per_text and not 1 <= lo <= hi:
        raise ValueError(f"bad copy span {span}")
    if context < 1:
        raise ValueError(f"copy context of {context} texts")
    rng = random.Random(f"copy/{seed}")
    out = []
    for r in range(per_text):
        for i, ids in enumerate(token_lists):
            n = rng.randint(lo, hi)
            if len(ids) < n:
                continue
            s = rng.randint(0, len(ids) - n)
            piece = list(ids[s : s + n])
            ctx = piece + list(sep)
            if context > 1:
                texts = [token_lists[rng.randrange(len(token_lists))] for _ in range(context - 1)]
                texts.insert(rng.randint(0, len(texts)), ids)
                ctx = [t for text in texts for t in list(text) + list(sep)]
            out.append(Episode(task_id=f"copy{r}/{i}", prefix_len=0,
                               invocations=[Invocation(ctx, piece + [eos])],
                               metrics={"source_task": f"copy{r}/{i}"}))
    return out


def repeat_examples(vocab: list[int], n: int, length: tuple[int, int], sep: list[int], eos: int,
                    seed: int) -> list[Episode]:
    """`n` sequences of length[0]..length[1] tokens drawn uniformly from `vocab`, each as context (+ `sep`)
    and again as target (+ eos). Unlike a copy of corpus text, which weights that memorised the corpus can
    produce, a random sequence can be repeated only by attending to its earlier occurrence: these examples
    grow and keep the induction copy the agent needs to put a question's unseen name into its query (a
    tiny model's SFT otherwise unlearns it; docs/study.md). Seeded."""
    lo, hi = length
    if n and (not vocab or not 1 <= lo <= hi):
        raise ValueError(f"repeat examples need a vocabulary and 1 <= min <= max length "
                         f"(got {len(vocab)} tokens, {length})")
    rng = random.Random(f"repeat/{seed}")
    out = []
    for i in range(n):
        s = [rng.choice(vocab) for _ in range(rng.randint(lo, hi))]
        out.append(Episode(task_id=f"repeat/{i}", prefix_len=0, invocations=[Invocation(s + list(sep), s + [eos])],
                           metrics={"source_task": f"repeat/{i}"}))
    return out
