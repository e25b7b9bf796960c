"""memopd.stats against independent computations.

Seed-level tests: t quantiles from printed tables, Welch's formula written out, every sign pattern and every
split enumerated by plain loops, Holm's procedure run step by step; and their coverage on simulated data
(normal and log-normal, n = 3, 5, 10, 1,000 data sets each). Bootstraps over steps and repeats: the same
resamples regenerated here from the same seed, their quantiles taken by numpy (method "higher": the sorted
statistic at floor(q * B) when q * B is a whole number; linear interpolation for the ratio), and the interval
ends pinned by hand. The levels are ones whose (1 -+ L) / 2 * B come out whole in floating point (0.95, 0.75,
0.5; 1 - 0.9 is 0.0999...)."""
import itertools
import math
import random
import statistics

import numpy as np
import pytest

from memopd import stats as S
from memopd.stats import percentile_indices, ratio_interval, unpaired_bootstrap

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


# Student t quantiles t(0.975, df) from a printed table (NIST/SEMATECH e-Handbook 1.3.6.7.2)
T975 = {2: 4.303, 3: 3.182, 4: 2.776, 9: 2.262}


def _sd(x):
    m = sum(x) / len(x)
    return math.sqrt(sum((v - m) ** 2 for v in x) / (len(x) - 1))


@pytest.mark.parametrize("values", [[0.1, 0.3, 0.2], [0.13, 0.17, 0.16, 0.2, 0.18], [0.03, -0.01, 0.05, 0.02, 0.04],
                                    [0.1 * i for i in range(10)]])
def test_t_interval_is_mean_plus_minus_the_table_quantile(values):
    n = len(values)
    half = T975[n - 1] * _sd(values) / math.sqrt(n)
    lo, hi = S.t_interval(values)
    mean = sum(values) / n
    assert lo == pytest.approx(mean - half, abs=5e-4 * half) and hi == pytest.approx(mean + half, abs=5e-4 * half)


def test_t_interval_of_one_value_or_no_spread():
    assert all(v != v for v in S.t_interval([0.2]))
    assert S.t_interval([0.25, 0.25, 0.25]) == (0.25, 0.25)


def _sign_flip_loop(d):
    obs = abs(sum(d) / len(d))
    hits = sum(abs(sum(s * v for s, v in zip(signs, d)) / len(d)) >= obs - 1e-12
               for signs in itertools.product((-1, 1), repeat=len(d)))
    return hits / 2 ** len(d)


@pytest.mark.parametrize("d", [[0.03, 0.05, 0.01, 0.06, 0.04], [0.03, -0.05, 0.01, 0.06, 0.04],
                               [0.2, -0.1, 0.05], [0.01, 0.02, -0.03, 0.05, 0.0, -0.02, 0.04, 0.03, 0.01, 0.02],
                               [0.1, 0.1, -0.1, 0.1]])
def test_sign_flip_p_counts_every_sign_pattern_two_sided(d):
    assert S.sign_flip_p(d) == pytest.approx(_sign_flip_loop(d), abs=1e-12)


def test_paired_test_by_hand():
    base, other = [0.10, 0.20, 0.15, 0.30, 0.25], [0.13, 0.25, 0.16, 0.36, 0.29]
    d = [o - b for b, o in zip(base, other)]
    t = S.paired_test(base, other)
    half = T975[4] * _sd(d) / math.sqrt(5)
    assert t.diff == pytest.approx(sum(d) / 5)
    assert (t.ci_low, t.ci_high) == pytest.approx((t.diff - half, t.diff + half), abs=5e-4 * half)
    assert t.p == pytest.approx(2 / 32) and t.p_min == pytest.approx(1 / 16) and t.n == 5  # all 5 positive
    mixed = S.paired_test(base, [b + x for b, x in zip(base, [0.05, -0.02, 0.03, 0.04, -0.01])])
    assert mixed.p == pytest.approx(_sign_flip_loop([0.05, -0.02, 0.03, 0.04, -0.01]))
    assert mixed.p_min == pytest.approx(1 / 16)
    one = S.paired_test([0.1], [0.2])
    assert one.diff == pytest.approx(0.1) and all(v != v for v in (one.ci_low, one.ci_high, one.p, one.p_min))
    with pytest.raises(ValueError, match="equally many"):
        S.paired_test([0.1, 0.2], [0.1])


def _welch_by_hand(base, other):
    n1, n2 = len(base), len(other)
    v1, v2 = _sd(base) ** 2 / n1, _sd(other) ** 2 / n2
    df = (v1 + v2) ** 2 / (v1 ** 2 / (n1 - 1) + v2 ** 2 / (n2 - 1))
    from scipy.stats import t as tdist

    diff = sum(other) / n2 - sum(base) / n1
    half = tdist.ppf(0.975, df) * math.sqrt(v1 + v2)
    return diff, diff - half, diff + half


def _split_loop(base, other):
    pool, n2 = base + other, len(other)
    obs = abs(sum(other) / n2 - sum(base) / len(base))
    diffs = []
    for idx in itertools.combinations(range(len(pool)), n2):
        o = [pool[i] for i in idx]
        b = [pool[i] for i in range(len(pool)) if i not in idx]
        diffs.append(abs(sum(o) / len(o) - sum(b) / len(b)))
    top = max(diffs)
    return sum(d >= obs - 1e-12 for d in diffs) / len(diffs), sum(d >= top - 1e-12 for d in diffs) / len(diffs)


@pytest.mark.parametrize("base,other", [([0.1, 0.2, 0.15, 0.3, 0.25], [0.3, 0.35, 0.32, 0.4, 0.38]),
                                        ([0.1, 0.2, 0.15], [0.12, 0.3, 0.05, 0.22, 0.18, 0.2]),
                                        ([0.5, 0.4, 0.45, 0.5], [0.5, 0.45, 0.4, 0.5])])
def test_welch_test_against_the_formula_and_every_split(base, other):
    t = S.welch_test(base, other)
    diff, lo, hi = _welch_by_hand(base, other)
    assert (t.diff, t.ci_low, t.ci_high) == pytest.approx((diff, lo, hi), rel=1e-9, abs=1e-12)
    p, p_min = _split_loop(base, other)
    assert t.p == pytest.approx(p, abs=1e-12) and t.p_min == pytest.approx(p_min, abs=1e-12)


def test_welch_test_far_apart_reaches_the_smallest_p_and_random_splits_agree(monkeypatch):
    base, other = [0.1, 0.2, 0.15, 0.3, 0.25], [0.5, 0.55, 0.52, 0.6, 0.58]
    assert S.welch_test(base, other).p == pytest.approx(2 / 252)
    b, o = [0.1, 0.2, 0.15, 0.3, 0.25, 0.22, 0.18], [0.3, 0.15, 0.32, 0.27, 0.24, 0.21]
    exact = S.welch_test(b, o)
    monkeypatch.setattr(S, "EXACT_POOL", 4)  # force the random splits
    approx = S.welch_test(b, o)
    assert approx.p == pytest.approx(exact.p, abs=0.005) and "random splits" in approx.test
    assert approx.p_min == pytest.approx(1 / (S.RANDOM_SPLITS + 1))


def test_the_smallest_p_counts_zeros_and_ties_and_nan_is_no_test():
    # a zero difference keeps its |value| whatever its sign: 2 of 16 patterns -> 4 of 16 reach the extreme
    d = [0.0, 0.1, 0.2, 0.3]
    t = S.one_sample_test(d)
    assert t.p_min == pytest.approx(0.25) and t.p == pytest.approx(_sign_flip_loop(d)) == pytest.approx(0.25)
    assert S.one_sample_test([0.0, 0.0, 0.0]).p_min == 1.0
    # ties: the largest |difference of means| over every split, by a plain loop, and the share reaching it
    base, other = [1.0, 1.0, 2.0], [2.0, 3.0, 3.0]
    pool = base + other
    diffs = []
    for idx in itertools.combinations(range(6), 3):
        o = [pool[i] for i in idx]
        b = [pool[i] for i in range(6) if i not in idx]
        diffs.append(abs(sum(o) / 3 - sum(b) / 3))
    top = max(diffs)
    w = S.welch_test(base, other)
    assert w.p_min == pytest.approx(sum(x >= top - 1e-12 for x in diffs) / 20) == pytest.approx(0.2)
    assert w.p == pytest.approx(0.2)  # the observed split is the extreme one
    for t in (S.one_sample_test([0.1, float("nan"), 0.2]), S.welch_test([0.1, 0.2], [float("nan"), 0.3])):
        assert t.p != t.p and "not a number" in t.test
        assert S.noise_verdict(t.ci_low, t.ci_high, t.p) == "no test"
    assert S.noise_verdict(float("nan"), float("nan"), 0.01) == "no test"


def test_compare_seeds_pairs_only_the_same_seeds():
    base, other = {0: 0.1, 1: 0.2, 2: 0.15}, {0: 0.12, 1: 0.25, 2: 0.14}
    assert S.compare_seeds(base, other).test.startswith("paired")
    assert S.compare_seeds(base, {3: 0.12, 4: 0.25, 5: 0.14}).test.startswith("Welch")


def _holm_rejects(p, alpha):
    """Holm's procedure run step by step: reject the smallest p while p_(k) <= alpha / (m - k)."""
    order = sorted(range(len(p)), key=lambda i: p[i])
    rejected = set()
    for k, i in enumerate(order):
        if p[i] > alpha / (len(p) - k):
            break
        rejected.add(i)
    return rejected


@pytest.mark.parametrize("p", [[0.01, 0.04, 0.03, 0.2], [0.002, 0.011, 0.012, 0.04, 0.5, 0.06],
                               [0.05, 0.01], [0.3, 0.001, 0.02, 0.0125, 0.013]])
def test_holm_adjusted_p_rejects_what_the_step_down_procedure_rejects(p):
    adj = S.holm(p)
    for alpha in np.linspace(0.001, 0.3, 300):
        assert {i for i, a in enumerate(adj) if a <= alpha} == _holm_rejects(p, alpha)
    assert all(a >= q for a, q in zip(adj, p))


def test_holm_by_hand_and_with_missing_values():
    assert S.holm([0.01, 0.04, 0.03, 0.2]) == pytest.approx([0.04, 0.09, 0.09, 0.2])
    got = S.holm([0.01, float("nan"), 0.03])
    assert got[0] == pytest.approx(0.02) and got[1] != got[1] and got[2] == pytest.approx(0.03)
    assert S.holm([0.4, 0.6]) == pytest.approx([0.8, 0.8]) and S.holm([0.9, 0.8]) == [1.0, 1.0]


def test_noise_verdict_words():
    assert S.noise_verdict(0.01, 0.05, 0.03) == "outside the noise"
    assert S.noise_verdict(0.01, 0.05, 0.0625) == "suggestive"
    assert S.noise_verdict(-0.01, 0.05, 0.04) == "suggestive"  # the interval holds 0
    assert S.noise_verdict(0.01, 0.05, 0.05) == "outside the noise" and S.noise_verdict(-0.05, -0.01, 0.1) == "suggestive"
    assert S.noise_verdict(0.01, 0.05, 0.11) == "inside the noise"
    assert S.noise_verdict(float("nan"), float("nan"), float("nan")) == "no test"


def test_paired_bca_over_tasks():
    rng = np.random.default_rng(3)
    base = rng.random(200)
    other = base + rng.normal(0.05, 0.1, 200)
    d = other - base
    mean, lo, hi = S.paired_bca(list(base), list(other))
    half = 1.96 * d.std(ddof=1) / math.sqrt(200)
    assert mean == pytest.approx(d.mean())
    assert lo == pytest.approx(mean - half, abs=0.15 * half) and hi == pytest.approx(mean + half, abs=0.15 * half)
    assert S.paired_bca([0.1, 0.2, 0.3], [0.2, 0.3, 0.4]) == pytest.approx((0.1, 0.1, 0.1))  # no spread
    assert S.paired_bca(list(base), list(other)) == (mean, lo, hi)  # seeded


def test_two_level_bootstrap_redrawn_by_hand():
    rng = np.random.default_rng(5)
    base = rng.random(30)
    other = [list(base + rng.normal(0.1 * s, 0.05, 30)) for s in range(4)]
    mean, lo, hi = S.two_level_bootstrap(list(base), other, n_boot=500, seed=9)
    draws = np.random.default_rng(9)
    s_idx, t_idx = draws.integers(0, 4, (500, 4)), draws.integers(0, 30, (500, 30))
    means = []
    for ss, tt in zip(s_idx, t_idx):
        vals = [other[s][t] - base[t] for s in ss for t in tt]
        means.append(sum(vals) / len(vals))
    assert mean == pytest.approx(float(np.mean(np.asarray(other) - base)))
    assert (lo, hi) == pytest.approx(tuple(np.quantile(means, [0.025, 0.975])), rel=1e-12)
    assert lo < mean - 0.05 and hi > mean + 0.05  # the seeds' spread (0.1 apart) widens it beyond the tasks'


# Coverage on simulated data: the log-normal's sigma 0.25 has skewness 0.78 (sigma 0.5 gives 1.75, where the t
# interval covers 91-92% at these n: docs/method.md "Statistics").
DISTRIBUTIONS = {"normal": lambda rng, size: rng.normal(0.15, 0.03, size),
                 "lognormal": lambda rng, size: rng.lognormal(0.0, 0.25, size)}
TRUE_MEAN = {"normal": 0.15, "lognormal": math.exp(0.25 ** 2 / 2)}


@pytest.mark.parametrize("dist", sorted(DISTRIBUTIONS))
@pytest.mark.parametrize("n", [3, 5, 10])
def test_seed_level_interval_covers_and_the_null_is_rarely_outside(dist, n):
    """1,000 simulated data sets: the t interval covers the true mean in >= 93%; with no true difference, the
    paired and the two-sample tests call "outside the noise" in <= 6%."""
    rng = np.random.default_rng(1000 + n)
    draw = DISTRIBUTIONS[dist]
    covered = paired_out = welch_out = 0
    for _ in range(1000):
        x = draw(rng, n)
        lo, hi = S.t_interval(list(x))
        covered += lo <= TRUE_MEAN[dist] <= hi
        a, b = list(draw(rng, n)), list(draw(rng, n))
        t = S.paired_test(a, b)
        paired_out += S.noise_verdict(t.ci_low, t.ci_high, t.p) == "outside the noise"
        w = S.welch_test(a, b)
        welch_out += S.noise_verdict(w.ci_low, w.ci_high, w.p) == "outside the noise"
    assert covered >= 930, f"{dist}, n={n}: the t interval covered {covered} of 1000"
    assert paired_out <= 60 and welch_out <= 60, (paired_out, welch_out)
