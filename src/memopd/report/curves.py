"""Training curves: how each method's runs moved during training, from their metrics.jsonl files.

One panel per quantity (task reward, invalid-action rate of the rollouts, OPD reverse KL on the teacher
tokens, PPO clip fraction) against the training step; per method the mean over seeds as a line and the
min-max over seeds as a band. `ppo` never scores the teacher, so it has no OPD curve (said in the legend).
"""
from __future__ import annotations

import json
import textwrap
from collections import defaultdict
from pathlib import Path

# (metrics.jsonl key, panel title); the keys train/loop.py and train/ppo.py write every step
PANELS = (
    ("reward/task", "task reward ({reward} - invalid penalty)"),  # {reward}: agent.reward, the score trained on
    ("rollout/invalid_rate", "invalid-action rate (rollouts)"),
    ("opd/loss", "OPD reverse KL (teacher tokens)"),
    ("ppo/clipfrac", "PPO clip fraction"),
)
METHOD_ORDER = ("ppo", "memopd_persistent", "memopd")


def load_runs(paths) -> dict[str, dict[int, list[dict]]]:
    """{method: {seed: [one dict per step, in step order]}} from metrics.jsonl files (each line names
    its method and seed)."""
    runs: dict[str, dict[int, list[dict]]] = defaultdict(dict)
    for path in paths:
        lines = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

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
    # wrapped: a title naming every method and seed is wider than the figure and was cut at both edges
    fig.suptitle(textwrap.fill(title or "Training curves: mean over seeds, band = min-max over seeds", 120),
                 fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn
