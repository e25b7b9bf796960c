"""Tables 1-2 and the matched control: evaluation scores aggregated over seeds.

Per (method, horizon, metric): mean and sample std over seeds, a 95% bootstrap interval of the mean
(resampling seeds), the change of the mean relative to PPO in %, and a paired comparison with PPO
(per seed: method - ppo; mean difference and its bootstrap interval). With 5 seeds the intervals are
wide: a difference inside the seed spread is no difference, and the tables say so by their intervals.
"""
from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

METRICS = {
    "multiobjective": ["em", "f1", "peak_context_tokens", "inference_time_s"],
    "wikirag": ["em", "f1", "dependency", "inference_time_s", "peak_context_tokens"],
    "matched_control": ["em", "f1"],
}
COLUMNS = ["method", "horizon", "metric", "mean", "std", "ci_low", "ci_high", "rel_to_ppo_pct", "seeds",
           "paired_diff_vs_ppo", "paired_ci_low", "paired_ci_high"]


def bootstrap_ci(values: list[float], n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean."""
    if len(values) < 2:
        return (values[0], values[0]) if values else (float("nan"), float("nan"))
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(n_boot))
    lo = means[int((1 - level) / 2 * n_boot)]
    hi = means[min(n_boot - 1, int((1 + level) / 2 * n_boot))]
    return lo, hi


def load_scores(eval_dir: str | Path, methods: list[str], seeds: list[int], benchmarks: list[str]) -> dict:
    """{(method, benchmark): {seed: eval json}} from results/eval/{method}_seed{seed}/{benchmark}.json."""
    out = {}
    for m in methods:
        for b in benchmarks:
            out[(m, b)] = {}
            for s in seeds:
                path = Path(eval_dir) / f"{m}_seed{s}" / f"{b}.json"
                if not path.exists():
                    raise FileNotFoundError(f"missing evaluation {path} (method {m}, seed {s}, benchmark {b})")
                out[(m, b)][s] = json.loads(path.read_text())
    return out


def table_rows(scores: dict, methods: list[str], horizons: dict[str, str], metrics: list[str]) -> list[dict]:
    """horizons: {benchmark file name: horizon label}, e.g. {"q2_test": "Q2"}."""
    rows = []
    for bench, horizon in horizons.items():
        for metric in metrics:
            ppo = scores.get(("ppo", bench), {})
            ppo_mean = statistics.fmean(r[metric] for r in ppo.values()) if ppo else float("nan")
            for m in methods:
                per_seed = scores[(m, bench)]
                vals = [per_seed[s][metric] for s in sorted(per_seed)]
                mean = statistics.fmean(vals)
                lo, hi = bootstrap_ci(vals)
                diffs = [per_seed[s][metric] - ppo[s][metric] for s in sorted(per_seed) if s in ppo]
                dlo, dhi = bootstrap_ci(diffs) if diffs else (float("nan"), float("nan"))
                rows.append({
                    "method": m, "horizon": horizon, "metric": metric, "mean": mean,
                    "std": statistics.stdev(vals) if len(vals) > 1 else 0.0, "ci_low": lo, "ci_high": hi,
                    "rel_to_ppo_pct": 100.0 * (mean - ppo_mean) / abs(ppo_mean) if ppo and ppo_mean else float("nan"),
                    "seeds": len(vals),
                    "paired_diff_vs_ppo": statistics.fmean(diffs) if diffs else float("nan"),
                    "paired_ci_low": dlo, "paired_ci_high": dhi,
                })
    return rows


def horizon_figure(rows: list[dict], path: str | Path, metric: str = "f1") -> None:
    """F1 vs horizon per method, with the 95% bootstrap intervals over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [r for r in rows if r["metric"] == metric]
    horizons = list(dict.fromkeys(r["horizon"] for r in sel))
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for i, m in enumerate(dict.fromkeys(r["method"] for r in sel)):
        pts = [next(r for r in sel if r["method"] == m and r["horizon"] == h) for h in horizons]
        x = [j + (i - 1) * 0.06 for j in range(len(horizons))]
        y = [p["mean"] for p in pts]
        err = [[p["mean"] - p["ci_low"] for p in pts], [p["ci_high"] - p["mean"] for p in pts]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=m)
    ax.set_xticks(range(len(horizons)), horizons)
    ax.set_xlabel("horizon (questions per task)")
    ax.set_ylabel(f"{metric.upper()} (mean over seeds, 95% bootstrap CI)")
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)
