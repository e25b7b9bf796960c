"""Packed vs padded SFT, side by side in one run: training tokens per second on the same examples.

Every path sees exactly the same micro-batches (the bins of a seeded best-fit packing of the examples
into sequences of at most seq_len tokens) and takes one AdamW step per micro-batch from the same
initial weights:
  packed/segmented  the bin's examples in one sequence, attention example by example (no padding,
                    no masked pairs; memopd.attention `segmented`)
  packed/sdpa       the same sequence under a dense L x L block-diagonal mask (computes masked pairs)
  padded            the bin's examples as rows of a right-padded batch (each example its own row)
The paths take turns bin by bin (rotating who goes first), so that a load change on shared cores hits
all alike. Tokens per second count real (non-padding) tokens; the first `warmup` bins are not timed.
"""
from __future__ import annotations

import copy
import random
import time

import torch

from memopd.sft.data import bin_pack, example_len, turn_examples
from memopd.sft.loss import target_loss
from memopd.synthetic import RULES, random_episode

# Synthetic turn examples shaped like the embedded default's calls: a 64-token task prefix, memory
# carried by the five rewrite rules, a fresh observation, a short response.
SHAPES = {"calls": 4, "prefix_tokens": 64, "observation_tokens": (16, 192), "response_tokens": (8, 48)}
PATHS = (("packed", "segmented"), ("packed", "sdpa"), ("padded", None))


def synthetic_examples(pool: list[int], n: int, seed: int, shapes: dict = SHAPES):
    """n distinct turn examples from synthetic episodes over the token pool `pool`."""
    rng = random.Random(seed)
    episodes = []
    while sum(len(e.invocations) for e in episodes) < n:
        i = len(episodes)
        e = random_episode(rng, pool, RULES[i % len(RULES)], shapes["calls"], shapes["prefix_tokens"],
                           tuple(shapes["observation_tokens"]), tuple(shapes["response_tokens"]), task_id=f"bench{i}")
        e.reward = 1.0
        episodes.append(e)
    return turn_examples(episodes, min_reward=0.0)[0][:n]


def bench_sft(model, examples, seq_len: int, lr: float, seed: int, warmup: int = 2, max_bins: int | None = None,
              paths=PATHS, progress: bool = True) -> list[dict]:
    """One row per path: real tokens/s, computed tokens (with padding), seconds, and the first bin's
    loss (equal on every path up to rounding: the same objective on the same weights)."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    bins = [[order[j] for j in b] for b in bin_pack([example_len(examples[i]) for i in order], seq_len)]
    bins = bins[:max_bins] if max_bins else bins
    runs = []
    for mode, backend in paths:
        m = copy.deepcopy(model).train()
        runs.append({"model": m, "opt": torch.optim.AdamW(m.parameters(), lr=lr), "row": {
            "path": f"{mode}/{backend}" if backend else mode, "mode": mode, "backend": backend or "",
            "batches": 0, "examples": 0, "real_tokens": 0, "computed_tokens": 0, "seconds": 0.0, "first_loss": None}})
    from tqdm.auto import tqdm

    for k, b in enumerate(tqdm(bins, desc="bench sft", disable=not progress)):
        batch = [examples[i] for i in b]
        real = sum(example_len(x) for x in batch)
        for j in range(len(runs)):
            r = runs[(j + k) % len(runs)]
            row = r["row"]
            t0 = time.perf_counter()
            r["opt"].zero_grad(set_to_none=True)
            s, n = target_loss(r["model"], batch, row["mode"], seq_len, row["backend"] or "sdpa")
            (s / n).backward()
            r["opt"].step()
            dt = time.perf_counter() - t0
            if row["first_loss"] is None:
                row["first_loss"] = s.item() / n
            if k >= warmup:
                row["batches"] += 1
                row["examples"] += len(batch)
                row["real_tokens"] += real
                row["computed_tokens"] += real if row["mode"] == "packed" else len(batch) * max(map(example_len, batch))
                row["seconds"] += dt
    rows = []
    for r in runs:
        row = r["row"]
        row["tokens_per_s"] = row["real_tokens"] / row["seconds"] if row["seconds"] else float("nan")
        row["padding_fraction"] = 1 - row["real_tokens"] / row["computed_tokens"] if row["computed_tokens"] else 0.0
        rows.append({"seq_len": seq_len, "device": str(next(r["model"].parameters()).device),
                     "threads": torch.get_num_threads(), **row})
    padded = next((r["tokens_per_s"] for r in rows if r["mode"] == "padded"), float("nan"))
    for row in rows:
        row["speedup_over_padded"] = row["tokens_per_s"] / padded
    return rows
