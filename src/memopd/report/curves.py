"""Training curves: how each method's runs moved during training, from their metrics.jsonl files.

One panel per quantity (task reward, invalid-action rate of the rollouts, OPD reverse KL on the teacher
tokens, PPO clip fraction) against the training step; per method the mean over seeds as a line and the
min-max over seeds as a band. `ppo` never scores the teacher, so it has no OPD curve (said in the legend).
And each run's trend (`trend_rows`): did its reward rise, and is it flat at the end, with intervals.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from memopd.config import TrainRuns
from memopd.methods import ORDER as METHOD_ORDER
from memopd.outputs import pyplot, save_figure

# (metrics.jsonl key, panel title); the keys train/loop.py and train/update.py write every step
PANELS = (
    ("reward/task", "task reward ({reward} - invalid penalty)"),  # {reward}: agent.reward, the score trained on
    ("rollout/invalid_rate", "invalid-action rate (rollouts)"),
    ("opd/loss", "OPD reverse KL (teacher tokens)"),
    ("ppo/clipfrac", "PPO clip fraction"),
)


def read_steps(path) -> list[dict]:
    """The logged steps of one metrics.jsonl file, or of its gzip (metrics.jsonl.gz, as archived), in file order."""
    import gzip

    raw = Path(path).read_bytes()
    text = (gzip.decompress(raw) if str(path).endswith(".gz") else raw).decode()
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def load_runs(paths) -> dict[str, dict[int, list[dict]]]:
    """{method: {seed: [one dict per step, in step order]}} from metrics.jsonl files, or their gzip
    (metrics.jsonl.gz, as archived); each line names its method and seed."""
    runs: dict[str, dict[int, list[dict]]] = defaultdict(dict)
    for path in paths:
        lines = read_steps(path)
        if not lines:
            raise ValueError(f"{path}: no training steps")
        runs[lines[0]["method"]][int(lines[0]["seed"])] = sorted(lines, key=lambda m: m["step"])
    return dict(runs)


def ordered(runs) -> list[str]:
    """The methods of `runs`: ppo, memopd_persistent, memopd first (the paper's order), then any other."""
    return [m for m in METHOD_ORDER if m in runs] + sorted(set(runs) - set(METHOD_ORDER))


def curve(seeds: dict[int, list[dict]], key: str) -> dict[str, list[float]] | None:
    """Per step (over the steps every seed has): mean, min and max of `key` over the seeds; None when
    no seed logged it."""
    import numpy as np

    per_seed = [[m.get(key) for m in steps] for steps in seeds.values()]
    n = min(len(v) for v in per_seed)
    if n == 0 or all(x is None for v in per_seed for x in v[:n]):
        return None
    a = np.array([[np.nan if x is None else float(x) for x in v[:n]] for v in per_seed])
    steps = [seeds[next(iter(seeds))][i]["step"] for i in range(n)]
    return {"step": steps, "mean": np.nanmean(a, 0).tolist(), "min": np.nanmin(a, 0).tolist(),
            "max": np.nanmax(a, 0).tolist(), "seeds": len(per_seed)}


def panel_titles(reward: str = "") -> list[str]:
    """PANELS' titles, the task reward named by the score the runs were trained on (agent.reward: em or f1)."""
    return [label.format(reward=reward.upper() or "score") for _, label in PANELS]


def curves_figure(runs: dict[str, dict[int, list[dict]]], path: str | Path, title: str = "", reward: str = "") -> dict:
    """The 2x2 figure of PANELS (PNG at `path`); returns {key: {method: curve}} of what it drew."""
    from matplotlib.ticker import MaxNLocator

    plt = pyplot()

    methods = ordered(runs)
    colors = {m: f"C{i}" for i, m in enumerate(methods)}
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True)
    drawn: dict = {}
    for ax, (key, _), label in zip(axes.flat, PANELS, panel_titles(reward)):
        drawn[key] = {}
        for m in methods:
            c = curve(runs[m], key)
            if c is None:
                ax.plot([], [], color=colors[m], ls=":", label=f"{m} (not logged)")
                continue
            drawn[key][m] = c
            ax.plot(c["step"], c["mean"], color=colors[m], marker="o", ms=3, label=f"{m} (n={c['seeds']})")
            ax.fill_between(c["step"], c["min"], c["max"], color=colors[m], alpha=0.2, lw=0)
        ax.set_title(label, fontsize=10)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[-1]:
        ax.set_xlabel("training step")
    # wrapped: a title naming every method and seed is wider than the figure
    save_figure(fig, path, title or "Training curves: mean over seeds, band = min-max over seeds", suptitle=True)
    return drawn


# The trend check of each run compares blocks of len(steps) // TREND_BLOCKS steps: the first (from the SFT
# policy on), the last, and the one before the last (50 steps each of a 300-step run).
TREND_BLOCKS = 6
TREND_KEYS = (("invalid", "rollout/invalid_rate"), ("opd_kl", "opd/loss"))  # block means shown beside the reward


def block_mean(values: list) -> float:
    """Mean of the logged values of a block (None: not logged, e.g. `ppo`'s OPD KL); NaN when none was."""
    kept = [float(v) for v in values if v is not None]
    return sum(kept) / len(kept) if kept else float("nan")


def trend(values: list[float], blocks: int = TREND_BLOCKS, seed: int = 0) -> dict:
    """Did a per-step series rise, and is it flat at its end?

    rise = mean(last block) - mean(first block); end = mean(last block) - mean(the block before it); each with
    a 95% bootstrap interval that resamples each block's steps on its own (memopd.stats.unpaired_bootstrap).
    Verdict: "rises" when the rise's interval lies above 0 ("falls": below; else "no rise"), then "flat at the
    end" when the end's interval holds 0 (else "still rising" / "still falling"). Fewer than 3 steps: no verdict."""
    from memopd.stats import unpaired_bootstrap

    n = len(values)
    if n < 3:
        nan = float("nan")
        return {"block_steps": 0, "first": nan, "last": nan, "rise": nan, "rise_ci_low": nan, "rise_ci_high": nan,
                "end": nan, "end_ci_low": nan, "end_ci_high": nan, "verdict": f"too few steps ({n})"}
    b = max(1, n // blocks)
    first, before, last = values[:b], values[-2 * b:-b], values[-b:]
    rise, r_lo, r_hi = unpaired_bootstrap(first, last, seed=seed)
    end, e_lo, e_hi = unpaired_bootstrap(before, last, seed=seed + 1)
    moved = "rises" if r_lo > 0 else "falls" if r_hi < 0 else "no rise"
    flat = "flat at the end" if e_lo <= 0 <= e_hi else "still rising" if e_lo > 0 else "still falling"
    if r_lo != r_lo:  # one step per block: no interval
        moved, flat = "no interval (1 step per block)", ""
    return {"block_steps": b, "first": block_mean(first), "last": block_mean(last), "rise": rise,
            "rise_ci_low": r_lo, "rise_ci_high": r_hi, "end": end, "end_ci_low": e_lo, "end_ci_high": e_hi,
            "verdict": f"{moved}, {flat}" if flat else moved}


def trend_rows(runs: dict[str, dict[int, list[dict]]], key: str = "reward/task") -> list[dict]:
    """One row per run (method, seed), in the paper's method order: the trend of `key` (trend), and the first
    and last blocks' means of TREND_KEYS (invalid-action rate, OPD reverse KL) for the diagnosis."""
    rows = []
    for m in ordered(runs):
        for seed, steps in sorted(runs[m].items()):
            t = trend([s[key] for s in steps])
            row = {"method": m, "seed": seed, "steps": len(steps), **t}
            b = t["block_steps"]
            for name, k in TREND_KEYS:
                row[f"{name}_first"] = block_mean([s.get(k) for s in steps[:b]]) if b else float("nan")
                row[f"{name}_last"] = block_mean([s.get(k) for s in steps[-b:]]) if b else float("nan")
            rows.append(row)
    return rows


def trend_caption(train: TrainRuns | None, reward: str, seeds: str) -> str:
    """The trend table's caption: the runs (models, steps, tasks of the `train` section, when given), `seeds` (words:
    'seeds [0, 1]') and the rule."""
    runs = (f"student {train.student}, teacher {train.teacher}, {train.steps} steps x {train.batch_tasks} tasks "
            f"of {train.benchmark}, {seeds}" if train else seeds)
    return (f"Training curves, the trend of each run ({runs}): task reward ({reward.upper() or 'score'} - invalid "
            f"penalty, per step the mean over its episodes) over the first, the last and the second-last of "
            f"{TREND_BLOCKS} blocks of steps; rise = last - first, end = last - second-last, 95% bootstrap CI "
            f"resampling each block's steps; verdict: rises / falls when the rise's CI excludes 0, flat at the "
            f"end when the end's CI holds 0; invalid-action rate and OPD reverse KL (teacher tokens) of the "
            f"first and last blocks")


def trend_notes(rows: list[dict]) -> list[str]:
    """Per method: how many runs rise and how many are flat at the end."""
    out = []
    for m in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == m]
        rise = sum(r["verdict"].startswith("rises") for r in mine)
        flat = sum("flat at the end" in r["verdict"] for r in mine)
        out.append(f"{m}: {rise} of {len(mine)} runs rise, {flat} of {len(mine)} are flat at the end")
    return out
