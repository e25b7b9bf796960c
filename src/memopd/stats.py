"""Bootstrap intervals: of a mean, of a paired difference (with the relative change of two means), of a
difference of two independent means, and of a median ratio. Each is a percentile bootstrap with a fixed seed,
so a rerun on the same values gives the same interval.

Interval ends of `bootstrap_ci`, `paired_bootstrap` and `unpaired_bootstrap` (`percentile_indices`): of B
sorted resample statistics, the interval at level L is [s[lo], s[hi]], lo = floor((1 - L) / 2 * B), hi =
min(B - 1, floor((1 + L) / 2 * B)); when (1 -+ L) / 2 * B are whole numbers (B = 2000, L = 0.95 or 0.9) these
are numpy.quantile's method "higher". `ratio_interval` resamples with numpy and interpolates linearly
(numpy.quantile's default).
"""
from __future__ import annotations

import math
import random
import statistics

NAN = float("nan")


def percentile_indices(n: int, level: float) -> tuple[int, int]:
    """Positions of the interval's ends at `level` among `n` sorted resample statistics."""
    return int((1 - level) / 2 * n), min(n - 1, int((1 + level) / 2 * n))


def bootstrap_ci(values: list[float], n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (resampled with replacement, `n_boot` times).
    One value: the point; none: NaN."""
    if len(values) < 2:
        return (values[0], values[0]) if values else (NAN, NAN)
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(n_boot))
    lo, hi = percentile_indices(n_boot, level)
    return means[lo], means[hi]


def relative_change_pct(base_mean: float, other_mean: float) -> float:
    """Change of the mean relative to the baseline, in % (NaN when the baseline mean is 0)."""
    return 100.0 * (other_mean - base_mean) / abs(base_mean) if base_mean else NAN


def paired_bootstrap(base: list[float], other: list[float], n_boot: int = 2000, seed: int = 0,
                     level: float = 0.95) -> dict:
    """Paired comparison of `other` with `base` (base[i], other[i]: the same seed, or the same task).

    Returns the mean per-pair difference (other - base) and the relative change of the means in %, each
    with a percentile bootstrap interval that resamples pairs (the pairs stay together). Both intervals come
    from the same resamples, so one contains 0 exactly when the other does. Fewer than 2 pairs: no interval
    (NaN). The relative interval is NaN when a resample's baseline mean is 0."""
    if len(base) != len(other) or not base:
        raise ValueError(f"paired_bootstrap needs equally many values on both sides, got {len(base)} and {len(other)}")
    n = len(base)
    out = {"diff": statistics.fmean(o - b for b, o in zip(base, other)),
           "rel_pct": relative_change_pct(statistics.fmean(base), statistics.fmean(other)),
           "diff_ci": (NAN, NAN), "rel_ci": (NAN, NAN)}
    if n < 2:
        return out
    rng = random.Random(seed)
    diffs, rels = [], []
    for _ in range(n_boot):
        idx = rng.choices(range(n), k=n)
        b, o = statistics.fmean(base[i] for i in idx), statistics.fmean(other[i] for i in idx)
        diffs.append(o - b)
        rels.append(relative_change_pct(b, o))
    lo, hi = percentile_indices(n_boot, level)
    diffs.sort()
    out["diff_ci"] = (diffs[lo], diffs[hi])
    if not any(math.isnan(r) for r in rels):
        rels.sort()
        out["rel_ci"] = (rels[lo], rels[hi])
    return out


def unpaired_bootstrap(base: list[float], other: list[float], n_boot: int = 2000, seed: int = 0,
                       level: float = 0.95) -> tuple[float, float, float]:
    """(difference, low, high): mean(other) - mean(base) of two independent samples (e.g. a training run's
    first and last steps), with a percentile bootstrap interval that resamples each sample on its own.
    Fewer than 2 values on a side: no interval (NaN); an empty side: all NaN."""
    if not base or not other:
        return NAN, NAN, NAN
    diff = statistics.fmean(other) - statistics.fmean(base)
    if len(base) < 2 or len(other) < 2:
        return diff, NAN, NAN
    rng = random.Random(seed)
    diffs = sorted(statistics.fmean(rng.choices(other, k=len(other))) - statistics.fmean(rng.choices(base, k=len(base)))
                   for _ in range(n_boot))
    lo, hi = percentile_indices(n_boot, level)
    return diff, diffs[lo], diffs[hi]


def ratio_interval(base: list[float], path: list[float], level: float = 0.95, resamples: int = 2000,
                   seed: int = 0) -> tuple[float, float, float]:
    """(median, low, high) of the per-repeat speedups base[r] / path[r]: the median with a percentile bootstrap
    interval at `level` (seeded, so a rerun on the same times gives the same interval). One repeat: no
    interval (NaN)."""
    import numpy as np

    ratios = np.asarray(base) / np.asarray(path)
    if len(ratios) < 2:
        return float(ratios[0]), NAN, NAN
    boot = np.median(np.random.default_rng(seed).choice(ratios, (resamples, len(ratios))), axis=1)
    lo, hi = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return float(np.median(ratios)), float(lo), float(hi)
