"""Packing compiler: exact per-call states of one or more episodes in one physical sequence.

For an episode with shared prefix q and calls z_t = [q, x_t] -> a_t the packed sequence is
    y = [q, x_0, a_0, x_1, a_1, ..., x_{T-1}, a_{T-1}]
with
  * q stored once at positions 0..|q|-1 and visible to every call;
  * call t's tokens at exactly the positions they had in the independent call (x_t starts at |q|);
  * visibility: a token of call t sees q and the earlier tokens of call t only;
  * m_act[j] = 1 iff y_j is a token of a sampled response a_t (context copies of retained
    responses are context: their role comes from the record's provenance, never from matching ids);
  * gamma[j] = index of the token whose logit predicts y_j (the previous token *of the same call*).
Several episodes (or SFT examples) can share one sequence: `segment` separates them completely.

The same layout with running positions and/or plain causal visibility gives the persistent-history
flattening and the corruptions used by the audits (`layout=`).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch

from memopd.records import Episode

PREFIX, CONTEXT, ACTION = 0, 1, 2  # token roles

# layout name -> (positions restart per call, cross-call attention blocked)
LAYOUTS = {
    "exact": (True, True),
    "persistent": (False, False),  # one transcript: running positions, plain causal visibility
    "corrupt_visibility": (True, False),
    "corrupt_positions": (False, True),
}


class PackingLimitError(ValueError):
    """The packed sequence would exceed the limit; packing never drops a conditioning token."""

    def __init__(self, needed: int, limit: int, task_ids: list[str]):
        self.needed, self.limit, self.task_ids = needed, limit, task_ids
        super().__init__(
            f"packed sequence needs {needed} tokens > limit {limit} (episodes {task_ids}); "
            "refusing to truncate: raise the limit or pack fewer episodes per sequence"
        )


@dataclass
class Packed:
    """One packed sequence. All tensors have shape (L,)."""

    input_ids: torch.Tensor  # long
    position_ids: torch.Tensor  # long
    segment: torch.Tensor  # long: which episode of the pack
    call: torch.Tensor  # long: call index inside the episode, -1 for the shared prefix
    role: torch.Tensor  # long: PREFIX / CONTEXT / ACTION
    act_mask: torch.Tensor  # bool: sampled action occurrences
    teacher_mask: torch.Tensor  # bool: subset of act_mask scored by the teacher
    gamma: torch.Tensor  # long: index predicting y_j for action tokens, -1 elsewhere
    layout: str
    block_calls: bool  # False: plain causal visibility inside a segment (flattening / corruption)
    task_ids: list[str]

    def __len__(self) -> int:
        return self.input_ids.numel()

    @property
    def action_index(self) -> torch.Tensor:
        """(N,) indices of sampled action tokens, in order (call by call, token by token)."""
        return self.act_mask.nonzero().squeeze(-1)

    @property
    def pred_index(self) -> torch.Tensor:
        """(N,) index of the logit predicting each sampled action token."""
        return self.gamma[self.action_index]

    @property
    def targets(self) -> torch.Tensor:
        """(N,) sampled action token ids."""
        return self.input_ids[self.action_index]

    def visible(self, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """Whether query i may attend to key j (broadcasts; works on index tensors and in mask_mods)."""
        ok = (self.segment[i] == self.segment[j]) & (j <= i)
        if self.block_calls:
            ok = ok & ((self.call[j] == -1) | (self.call[j] == self.call[i]))
        return ok


def select_teacher_calls(n_calls: int, spec, rng: random.Random | None = None) -> set[int]:
    """Teacher-mask selection: "all", "none", "first", "last", a float fraction of calls (sampled
    with `rng`), or an explicit iterable of call indices."""
    if spec == "all":
        return set(range(n_calls))
    if spec == "none":
        return set()
    if spec == "first":
        return {0}
    if spec == "last":
        return {n_calls - 1}
    if isinstance(spec, float):
        if not 0.0 <= spec <= 1.0:
            raise ValueError(f"teacher fraction {spec} not in [0, 1]")
        rng = rng or random.Random(0)
        return {t for t in range(n_calls) if rng.random() < spec}
    calls = set(int(t) for t in spec)
    if any(not 0 <= t < n_calls for t in calls):
        raise ValueError(f"teacher calls {sorted(calls)} outside 0..{n_calls - 1}")
    return calls


def pack(
    episodes: Episode | list[Episode],
    max_len: int | None = None,
    layout: str = "exact",
    teacher="all",
    seed: int = 0,
) -> Packed:
    """Compile episodes into one packed sequence (see module docstring)."""
    if isinstance(episodes, Episode):
        episodes = [episodes]
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose from {sorted(LAYOUTS)}")
    restart, block = LAYOUTS[layout]
    needed = sum(
        ep.prefix_len + sum(len(inv.input_ids) - ep.prefix_len + len(inv.output_ids) for inv in ep.invocations)
        for ep in episodes
    )
    if max_len is not None and needed > max_len:
        raise PackingLimitError(needed, max_len, [ep.task_id for ep in episodes])

    rng = random.Random(seed)
    ids, pos, seg, call, role, gamma, teach = [], [], [], [], [], [], []
    for s, ep in enumerate(episodes):
        ep.validate()
        q = ep.prefix_ids
        start = len(ids)
        ids += q
        pos += range(len(q))
        seg += [s] * len(q)
        call += [-1] * len(q)
        role += [PREFIX] * len(q)
        gamma += [-1] * len(q)
        teach += [False] * len(q)
        teacher_calls = select_teacher_calls(len(ep.invocations), teacher, rng)
        for t, inv in enumerate(ep.invocations):
            x = inv.input_ids[ep.prefix_len :]
            a = inv.output_ids
            # prediction index of a_t[0]: last token of x_t, or of q when x_t is empty
            prev = len(ids) + len(x) - 1 if x else start + len(q) - 1
            first_pos = ep.prefix_len if restart else len(ids) - start
            ids += x + a
            pos += range(first_pos, first_pos + len(x) + len(a))
            seg += [s] * (len(x) + len(a))
            call += [t] * (len(x) + len(a))
            role += [CONTEXT] * len(x) + [ACTION] * len(a)
            gamma += [-1] * len(x) + [prev] + list(range(len(ids) - len(a), len(ids) - 1))
            teach += [False] * len(x) + [t in teacher_calls] * len(a)
    assert len(ids) == needed
    role_t = torch.tensor(role, dtype=torch.long)
    act = role_t == ACTION
    return Packed(
        input_ids=torch.tensor(ids, dtype=torch.long),
        position_ids=torch.tensor(pos, dtype=torch.long),
        segment=torch.tensor(seg, dtype=torch.long),
        call=torch.tensor(call, dtype=torch.long),
        role=role_t,
        act_mask=act,
        teacher_mask=torch.tensor(teach, dtype=torch.bool) & act,
        gamma=torch.tensor(gamma, dtype=torch.long),
        layout=layout,
        block_calls=block,
        task_ids=[ep.task_id for ep in episodes],
    )


def flatten_persistent(episodes, max_len: int | None = None, teacher="all", seed: int = 0) -> Packed:
    """The persistent-history baseline: one transcript, running positions, plain causal visibility."""
    return pack(episodes, max_len=max_len, layout="persistent", teacher=teacher, seed=seed)


def corrupt(packed: Packed, visibility: bool, positions: bool) -> Packed:
    """Deliberately break an exact pack (audits): plain causal visibility and/or running positions."""
    out = replace(packed, block_calls=packed.block_calls and not visibility)
    if positions:
        running = torch.empty_like(packed.position_ids)
        for s in packed.segment.unique():
            idx = (packed.segment == s).nonzero().squeeze(-1)
            running[idx] = torch.arange(idx.numel())
        out = replace(out, position_ids=running)
    names = {(True, False): "corrupt_visibility", (False, True): "corrupt_positions", (True, True): "persistent"}
    return replace(out, layout=names.get((visibility, positions), packed.layout))
