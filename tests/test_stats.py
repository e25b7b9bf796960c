"""memopd.stats' intervals against an independent computation: the same resamples regenerated here from the
same seed, their quantiles taken by numpy (method "higher": the sorted statistic at floor(q * B) when q * B is
a whole number; linear interpolation for the ratio), and the interval ends pinned by hand. The levels are
ones whose (1 -+ L) / 2 * B come out whole in floating point (0.95, 0.75, 0.5; 1 - 0.9 is 0.0999...)."""
import random
import statistics

import numpy as np
import pytest

from memopd.stats import bootstrap_ci, paired_bootstrap, percentile_indices, ratio_interval, unpaired_bootstrap

VALUES = [0.31, 0.12, 0.55, 0.48, 0.27, 0.9, 0.05, 0.62, 0.4, 0.33, 0.71, 0.18]
OTHER = [v + d for v, d in zip(VALUES, [0.1, -0.05, 0.2, 0.0, 0.07, -0.1, 0.15, 0.02, 0.3, -0.02, 0.05, 0.12])]


def _ends(stats: list[float], level: float) -> tuple[float, float]:
    lo, hi = np.quantile(np.asarray(stats), [(1 - level) / 2, (1 + level) / 2], method="higher")
    return float(lo), float(hi)


def test_interval_ends_by_hand():
    assert percentile_indices(2000, 0.95) == (50, 1950)
    assert percentile_indices(2000, 0.5) == (500, 1500)
    assert percentile_indices(20, 0.5) == (5, 15)
    assert percentile_indices(10, 0.999) == (0, 9)  # the upper end stays a resample


@pytest.mark.parametrize("level,n_boot,seed", [(0.95, 2000, 0), (0.75, 2000, 3), (0.5, 500, 7)])
def test_bootstrap_ci_is_the_quantile_of_the_resampled_means(level, n_boot, seed):
    rng = random.Random(seed)
    means = [statistics.fmean(rng.choices(VALUES, k=len(VALUES))) for _ in range(n_boot)]
    assert bootstrap_ci(VALUES, n_boot=n_boot, seed=seed, level=level) == _ends(means, level)


def test_bootstrap_ci_of_one_or_no_value():
    assert bootstrap_ci([2.0]) == (2.0, 2.0)
    assert all(v != v for v in bootstrap_ci([]))


@pytest.mark.parametrize("level,n_boot,seed", [(0.95, 2000, 0), (0.75, 2000, 5)])
def test_paired_bootstrap_is_the_quantile_of_the_resampled_pairs(level, n_boot, seed):
    rng = random.Random(seed)
    diffs, rels = [], []
    for _ in range(n_boot):
        idx = rng.choices(range(len(VALUES)), k=len(VALUES))
        b, o = statistics.fmean(VALUES[i] for i in idx), statistics.fmean(OTHER[i] for i in idx)
        diffs.append(o - b)
        rels.append(100.0 * (o - b) / abs(b))
    pb = paired_bootstrap(VALUES, OTHER, n_boot=n_boot, seed=seed, level=level)
    assert pb["diff_ci"] == _ends(diffs, level)
    assert pb["rel_ci"] == pytest.approx(_ends(rels, level), rel=1e-12)
    assert pb["diff"] == pytest.approx(statistics.fmean(OTHER) - statistics.fmean(VALUES))
    lo, hi = pb["diff_ci"]
    assert min(diffs) < lo < pb["diff"] < hi < max(diffs)  # neither end is an extreme resample


@pytest.mark.parametrize("level,n_boot,seed", [(0.95, 2000, 0), (0.75, 2000, 9)])
def test_unpaired_bootstrap_resamples_each_side_on_its_own(level, n_boot, seed):
    base, other = VALUES, OTHER[:7]  # unequal sizes: nothing is paired
    rng = random.Random(seed)
    diffs = []
    for _ in range(n_boot):
        o = statistics.fmean(rng.choices(other, k=len(other)))  # other first, then base, as the code draws them
        diffs.append(o - statistics.fmean(rng.choices(base, k=len(base))))
    diff, lo, hi = unpaired_bootstrap(base, other, n_boot=n_boot, seed=seed, level=level)
    assert diff == pytest.approx(np.mean(other) - np.mean(base))
    assert (lo, hi) == _ends(diffs, level)
    assert min(diffs) < lo < diff < hi < max(diffs)


def test_unpaired_bootstrap_by_hand():
    diff, lo, hi = unpaired_bootstrap([1.0, 1.0, 1.0], [3.0, 3.0])  # no spread: every resample is the point
    assert (diff, lo, hi) == (2.0, 2.0, 2.0)
    d, lo, hi = unpaired_bootstrap([0.0, 0.1, 0.2, 0.1], [1.0, 1.1, 0.9, 1.0])  # far apart: the interval excludes 0
    assert 0 < lo <= d <= hi
    assert unpaired_bootstrap([1.0], [2.0, 4.0])[0] == 2.0 and all(v != v for v in unpaired_bootstrap([1.0], [2.0, 4.0])[1:])
    assert all(v != v for v in unpaired_bootstrap([], [1.0, 2.0]))


def test_ratio_interval_is_the_quantile_of_the_resampled_medians():
    base = [2.0, 2.2, 1.9, 2.5, 2.1, 2.4, 1.8]
    path = [1.0, 1.3, 1.0, 1.1, 1.2, 1.0, 1.05]
    ratios = np.asarray(base) / np.asarray(path)
    for level, resamples, seed in ((0.95, 2000, 0), (0.75, 300, 4)):
        boot = np.median(np.random.default_rng(seed).choice(ratios, (resamples, len(ratios))), axis=1)
        lo, hi = np.percentile(boot, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
        m, got_lo, got_hi = ratio_interval(base, path, level=level, resamples=resamples, seed=seed)
        assert m == float(np.median(ratios))
        assert (got_lo, got_hi) == pytest.approx((lo, hi), rel=1e-12)
    assert ratio_interval([3.0], [1.5])[0] == 2.0 and all(v != v for v in ratio_interval([3.0], [1.5])[1:])
