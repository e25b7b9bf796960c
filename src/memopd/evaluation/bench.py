"""`memopd bench eval`: HFBackend's prefill paths (backends.PREFILLS) side by side on real evaluation episodes.

The work of one run is the real agent loop (rollout.rollout: batches of episodes, retrieval, memory rewrites) on
the first tasks of a benchmark parquet, greedy; without a benchmark or an index, one generate call on synthetic
prompts of the agent's shape (a common system-prompt-like prefix, then 0.5-1x `tokens` tokens of their own).
Every path runs once per repeat, in an order that rotates from repeat to repeat, after one small untimed call
per path (imports, first allocations). Per path: the median seconds and the speedup of the first path (the
baseline) over it, the median over repeats of the per-repeat ratio with a 95% bootstrap interval
(memopd.stats.ratio_interval). Greedy outputs must be the baseline's token for token ("identical"); the
log-probs may differ by float rounding (grouped prefills pad less), and the row states the largest difference.
"""
from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from memopd.generation.backends import HFBackend, Sampling
from memopd.stats import ratio_interval


@dataclass
class Outcome:
    """What a run produced: per episode (or prompt) its calls' output ids and log-probs."""

    ids: list[list[list[int]]]
    logprobs: list[list[list[float]]]


@dataclass
class PathRow:
    path: str
    work: str
    repeats: int
    threads: int
    median_s: float
    min_s: float
    max_s: float
    speedup: float  # baseline seconds / this path's, median over repeats
    speedup_lo: float
    speedup_hi: float
    identical: bool  # greedy output ids equal to the baseline's
    max_abs_dlogp: float  # against the baseline's log-probs (0 for the baseline)


def episodes_work(tasks, tokenizer, retriever, agent, seed: int = 0):
    """The real evaluation loop on `tasks`: backend -> Outcome."""
    from memopd.agent.rollout import rollout

    def work(backend) -> Outcome:
        eps = rollout(tasks, backend, tokenizer, retriever, agent, seed=seed, progress=False)
        return Outcome([[i.output_ids for i in e.invocations] for e in eps],
                       [[i.logprobs for i in e.invocations] for e in eps])

    return work


def synthetic_prompts(vocab: int, batch: int, tokens: int, shared: int, seed: int = 0) -> list[list[int]]:
    """`batch` prompts: one common `shared`-token prefix, then 0.5-1x `tokens` tokens each (ids >= 100)."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(100, vocab, (shared,), generator=g).tolist()
    lens = torch.randint(tokens // 2, tokens + 1, (batch,), generator=g)
    return [head + torch.randint(100, vocab, (int(n),), generator=g).tolist() for n in lens]


def prompts_work(prompts: list[list[int]]):
    """One generate call on `prompts`: backend -> Outcome (one 'episode' of one call per prompt)."""
    def work(backend) -> Outcome:
        gens = backend.generate(prompts, list(range(len(prompts))))
        return Outcome([[g.output_ids] for g in gens], [[g.logprobs] for g in gens])

    return work


def _max_dlogp(a: Outcome, b: Outcome) -> float:
    return max((abs(x - y) for ea, eb in zip(a.logprobs, b.logprobs) for ca, cb in zip(ea, eb)
                for x, y in zip(ca, cb)), default=0.0)


def run(model, tokenizer, work, sampling: Sampling, paths=("padded", "shared"), repeats: int = 3,
        label: str = "", log=functools.partial(print, flush=True)) -> list[PathRow]:
    """Time `work` under each prefill path; the first path is the baseline."""
    backends = {p: HFBackend(model, tokenizer, sampling, prefill=p) for p in paths}
    for be in backends.values():  # untimed: the first call of a path pays its imports and first allocations
        be.generate([[100] * 8, [101] * 5], [0, 1])
    times: dict[str, list[float]] = {p: [] for p in paths}
    outs: dict[str, Outcome] = {}
    for r in range(repeats):
        order = list(paths[r % len(paths):]) + list(paths[: r % len(paths)])
        for p in order:
            t0 = time.perf_counter()
            outs[p] = work(backends[p])
            times[p].append(time.perf_counter() - t0)
        log(f"bench eval {label}: repeat {r + 1}/{repeats}: " + ", ".join(f"{p} {times[p][-1]:.1f} s" for p in paths))
    base = paths[0]
    rows = []
    for p in paths:
        s = sorted(times[p])
        mid, lo, hi = ratio_interval(times[base], times[p])
        rows.append(PathRow(p, label, repeats, torch.get_num_threads(), s[len(s) // 2], s[0], s[-1], mid, lo, hi,
                            outs[p].ids == outs[base].ids, _max_dlogp(outs[p], outs[base])))
    for row in rows:
        log(f"bench eval {label}: {row.path}: {row.median_s:.1f} s [{row.min_s:.1f}, {row.max_s:.1f}], speedup "
            f"{row.speedup:.2f}x [{row.speedup_lo:.2f}, {row.speedup_hi:.2f}] over {base}; identical greedy "
            f"outputs: {row.identical}, max |d log p| {row.max_abs_dlogp:.1e}")
    return rows


def rows_as_dicts(rows: list[PathRow]) -> list[dict]:
    return [asdict(r) for r in rows]


def has_episodes(benchmark: str | Path, index: str | Path) -> bool:
    """True when both the benchmark parquet and the retrieval index exist (real episodes)."""
    return Path(benchmark).is_file() and Path(index).is_dir()
