"""Intervals and tests: over seeds (few: 3-10), over tasks (many), and of benchmark ratios.

Over seeds (Tables 1-2, the matched control, each method against its SFT student), from scipy.stats:
- `paired_test`: per-seed differences (the same seed on both sides): Student-t interval of the mean
  difference, and the exact two-sided sign-flip p (all 2^n sign patterns of the differences).
- `welch_test`: two independent sets of seeds: Welch's interval of the difference of means, and the two-sided
  permutation p over the splits of the pooled values (every split up to EXACT_POOL values, else RANDOM_SPLITS
  random ones, seeded).
- `one_sample_test`: one value per seed against 0 (t interval of the mean, sign-flip p); `t_interval`: the
  interval of a mean.
Every two-sided p is the share of permutations whose |statistic| reaches the observed one. `holm` adjusts a
table's secondary p values for how many it makes; `noise_verdict` turns an interval and a p into the words the
tables use. A percentile bootstrap over 3-10 seeds alone is far too narrow (at n = 5 a nominal 95% interval covers
~85%), so no verdict over seeds rests on one.

Over tasks (50-200 of them): `paired_bca` (scipy.stats.bootstrap, BCa) of a mean per-task difference, and
`two_level_bootstrap` for several seeds' scores on the same tasks (seeds, then tasks, resampled: a percentile
interval of the spread of both, shown beside the test over seeds that gives the verdict).

Over steps and repeats: `unpaired_bootstrap` (percentile; two blocks of a training run's steps) and
`ratio_interval` (median speedup of benchmark repeats). Interval ends of the percentile bootstrap
(`percentile_indices`): of B sorted resample statistics, the interval at level L is [s[lo], s[hi]],
lo = floor((1 - L) / 2 * B), hi = min(B - 1, floor((1 + L) / 2 * B)).
"""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, replace

NAN = float("nan")
ALPHA = 0.05        # "outside the noise": the interval excludes 0 and p <= ALPHA
SUGGESTIVE = 0.10   # "suggestive": p <= SUGGESTIVE otherwise
EXACT_POOL = 24          # two-sample permutations: every split up to 12 + 12 seeds (2.7 million splits)
RANDOM_SPLITS = 200_000  # beyond that, this many random splits
VERDICT_RULE = (f"outside the noise when the 95% interval excludes 0 and the exact p <= {ALPHA}, suggestive when "
                f"p <= {SUGGESTIVE} otherwise, else inside the noise")


@dataclass(frozen=True)
class SeedTest:
    """A comparison over seeds: the estimate (a mean difference, or a mean), its interval, the exact two-sided
    p, the smallest p the test can reach with these seeds, how many values, and which test it was."""
    diff: float
    ci_low: float
    ci_high: float
    p: float
    p_min: float
    n: int
    test: str


def _mean_abs(x, axis=-1):
    import numpy as np

    return np.abs(np.mean(x, axis=axis))


def t_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """Student-t interval of the mean (n - 1 degrees of freedom); fewer than 2 values: NaN; no spread: the point."""
    from scipy import stats

    if len(values) < 2:
        return NAN, NAN
    mean, sem = statistics.fmean(values), stats.sem(values)
    if sem == 0:
        return mean, mean
    lo, hi = stats.t.interval(level, len(values) - 1, loc=mean, scale=sem)
    return float(lo), float(hi)


def sign_flip_p(values: list[float]) -> float:
    """Exact two-sided p of mean(values) = 0: the share of the 2^n sign patterns whose |mean| reaches the
    observed |mean| (scipy.stats.permutation_test, every pattern enumerated)."""
    import numpy as np
    from scipy import stats

    res = stats.permutation_test((np.asarray(values, float),), _mean_abs, permutation_type="samples",
                                 alternative="greater", n_resamples=math.inf, vectorized=True)
    return float(res.pvalue)


def one_sample_test(values: list[float], level: float = 0.95) -> SeedTest:
    """One value per seed against 0: the mean, its t interval, the exact sign-flip p. The smallest p these values
    can reach: 2^(1 + z) / 2^n with z of them 0 (a zero's sign changes nothing). A NaN value: no test."""
    n = len(values)
    if n < 2 or not all(math.isfinite(v) for v in values):
        why = "one value" if n < 2 else "a value is not a number"
        return SeedTest(statistics.fmean(values) if values else NAN, NAN, NAN, NAN, NAN, n, why)
    lo, hi = t_interval(values, level)
    zeros = sum(v == 0 for v in values)
    return SeedTest(statistics.fmean(values), lo, hi, sign_flip_p(values), min(1.0, 2.0 ** (1 + zeros - n)), n,
                    f"t interval, exact sign-flip p over {2 ** n} sign patterns")


def paired_test(base: list[float], other: list[float], level: float = 0.95) -> SeedTest:
    """other - base, pair by pair (the same seed on both sides): one_sample_test of the differences."""
    if len(base) != len(other):
        raise ValueError(f"paired_test needs equally many values on both sides, got {len(base)} and {len(other)}")
    t = one_sample_test([o - b for b, o in zip(base, other)], level)
    return t if math.isnan(t.p) else replace(t, test="paired " + t.test)


def split_sums(values: list[float], k: int):
    """The sum of every k-element subset of `values` (2^n subsets built by doubling, those of size k kept):
    the two-sample permutation distribution without a Python loop over splits (n <= EXACT_POOL)."""
    import numpy as np

    sums, sizes = np.zeros(1), np.zeros(1, dtype=np.int8)
    for v in values:
        sums, sizes = np.concatenate([sums, sums + v]), np.concatenate([sizes, sizes + 1])
    return sums[sizes == k]


def permutation_p(base: list[float], other: list[float], seed: int = 0) -> tuple[float, float, int, bool]:
    """(p, smallest p, splits, exact): two-sided permutation p of mean(other) - mean(base), the share of the splits
    of the pooled values into groups of these sizes whose |difference of means| reaches the observed one, and the
    smallest p these values can reach (the share reaching the largest |difference|: ties raise it). Every split
    while the pool has <= EXACT_POOL values (12 + 12 seeds), else RANDOM_SPLITS random ones from `seed`
    (scipy.stats.permutation_test; smallest p 1 / (RANDOM_SPLITS + 1))."""
    import numpy as np
    from scipy import stats

    n1, n2 = len(base), len(other)
    pool, total, splits = [*other, *base], math.fsum(base) + math.fsum(other), math.comb(n1 + n2, n2)
    observed = abs(statistics.fmean(other) - statistics.fmean(base))
    if n1 + n2 <= EXACT_POOL:
        s = split_sums(pool, n2)
        diffs = np.abs(s / n2 - (total - s) / n1)
        # a difference equal to the observed one up to rounding counts as reaching it (as scipy's tolerance)
        return (float(np.mean(diffs >= observed * (1 - 1e-12))), float(np.mean(diffs >= diffs.max() * (1 - 1e-12))),
                splits, True)
    res = stats.permutation_test((np.asarray(other, float), np.asarray(base, float)),
                                 lambda x, y, axis: np.abs(np.mean(x, axis=axis) - np.mean(y, axis=axis)),
                                 permutation_type="independent", alternative="greater", vectorized=True,
                                 n_resamples=RANDOM_SPLITS, rng=np.random.default_rng(seed))
    return float(res.pvalue), 1.0 / (RANDOM_SPLITS + 1), splits, False


def welch_test(base: list[float], other: list[float], level: float = 0.95, seed: int = 0) -> SeedTest:
    """mean(other) - mean(base) of two independent samples: Welch's interval (scipy.stats.ttest_ind) and the
    permutation p (permutation_p). The smallest p of an exact test: 2 / splits with equal sizes (a split and its
    mirror give the same |difference|), else 1 / splits, raised by ties (permutation_p). A NaN value: no test."""
    from scipy import stats

    n1, n2 = len(base), len(other)
    diff = statistics.fmean(other) - statistics.fmean(base) if n1 and n2 else NAN
    if n1 < 2 or n2 < 2:
        return SeedTest(diff, NAN, NAN, NAN, NAN, n1 + n2, "fewer than 2 values on a side")
    if not all(math.isfinite(v) for v in (*base, *other)):
        return SeedTest(diff, NAN, NAN, NAN, NAN, n1 + n2, "a value is not a number")
    if statistics.pvariance(base) == 0 and statistics.pvariance(other) == 0:
        lo = hi = diff
    else:
        ci = stats.ttest_ind(other, base, equal_var=False).confidence_interval(level)
        lo, hi = float(ci.low), float(ci.high)
    p, p_min, splits, exact = permutation_p(base, other, seed)
    how = f"every one of {splits} splits" if exact else f"{RANDOM_SPLITS} random splits of {splits}"
    return SeedTest(diff, lo, hi, p, p_min, n1 + n2, f"Welch interval, permutation p over {how}")


def compare_seeds(base: dict[int, float], other: dict[int, float], level: float = 0.95) -> SeedTest:
    """{seed: value} each: paired over seeds when both sides have the same seeds, else Welch (independent)."""
    if set(base) == set(other):
        seeds = sorted(base)
        return paired_test([base[s] for s in seeds], [other[s] for s in seeds], level)
    return welch_test(list(base.values()), list(other.values()), level)


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p values (NaN entries are left out of the count and stay NaN): sorted
    ascending, the k-th (from 0) of m becomes max over j <= k of min(1, (m - j) p_(j))."""
    order = sorted((p, i) for i, p in enumerate(pvalues) if not math.isnan(p))
    out, running, m = [NAN] * len(pvalues), 0.0, len(order)
    for j, (p, i) in enumerate(order):
        running = max(running, min(1.0, (m - j) * p))
        out[i] = running
    return out


def noise_verdict(ci_low: float, ci_high: float, p: float) -> str:
    """'outside the noise' (the interval excludes 0 and p <= ALPHA), 'suggestive' (p <= SUGGESTIVE otherwise),
    'inside the noise', or 'no test' (a NaN p or interval end: one seed, or a value that is not a number)."""
    if any(math.isnan(v) for v in (ci_low, ci_high, p)):
        return "no test"
    if not ci_low <= 0 <= ci_high and p <= ALPHA:
        return "outside the noise"
    return "suggestive" if p <= SUGGESTIVE else "inside the noise"


def paired_bca(base: list[float], other: list[float], level: float = 0.95, n_boot: int = 2000,
               seed: int = 0) -> tuple[float, float, float]:
    """(mean of other - base, low, high): a BCa bootstrap interval resampling pairs (scipy.stats.bootstrap);
    for many pairs (tasks). Identical differences: the point; fewer than 2 pairs: NaN interval."""
    import numpy as np
    from scipy import stats

    if len(base) != len(other) or not base:
        raise ValueError(f"paired_bca needs equally many values on both sides, got {len(base)} and {len(other)}")
    d = np.asarray(other, float) - np.asarray(base, float)
    mean = float(d.mean())
    if len(d) < 2:
        return mean, NAN, NAN
    if np.all(d == d[0]):
        return mean, mean, mean
    ci = stats.bootstrap((d,), np.mean, n_resamples=n_boot, confidence_level=level, method="BCa",
                         rng=np.random.default_rng(seed)).confidence_interval
    return mean, float(ci.low), float(ci.high)


def two_level_bootstrap(base: list[float], other: list[list[float]], level: float = 0.95, n_boot: int = 2000,
                        seed: int = 0) -> tuple[float, float, float]:
    """(mean difference, low, high) of `other` (one list per seed, each over the same tasks as `base`) minus
    `base`: a percentile interval whose resamples draw seeds with replacement, then tasks with replacement
    (one draw of tasks for every drawn seed and for `base`, since all were scored on the same tasks), so the
    interval holds both the seed-to-seed and the task-to-task spread."""
    import numpy as np

    b, o = np.asarray(base, float), np.asarray(other, float)
    if o.ndim != 2 or o.shape[1] != len(b):
        raise ValueError(f"two_level_bootstrap: {o.shape} scores for {len(b)} tasks")
    d = o - b  # seeds x tasks
    rng = np.random.default_rng(seed)
    s_idx = rng.integers(0, d.shape[0], (n_boot, d.shape[0]))
    t_idx = rng.integers(0, d.shape[1], (n_boot, d.shape[1]))
    stats_ = np.array([d[s][:, t].mean() for s, t in zip(s_idx, t_idx)])
    lo, hi = np.quantile(stats_, [(1 - level) / 2, (1 + level) / 2])
    return float(d.mean()), float(lo), float(hi)


def percentile_indices(n: int, level: float) -> tuple[int, int]:
    """Positions of the interval's ends at `level` among `n` sorted resample statistics."""
    return int((1 - level) / 2 * n), min(n - 1, int((1 + level) / 2 * n))


def relative_change_pct(base_mean: float, other_mean: float) -> float:
    """Change of the mean relative to the baseline, in % (NaN when the baseline mean is 0)."""
    return 100.0 * (other_mean - base_mean) / abs(base_mean) if base_mean else NAN


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
