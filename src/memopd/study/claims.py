"""The paper's claims as comparisons over seeds, with the primaries declared in the config (`claims.primary`,
fixed before the run) adjusted together (Holm) and every other claim secondary, unadjusted:

  1a      MemOPD over PPO: F1 on the short horizon (the trained one)
  1b      the advantage grows with the horizon: per seed, MemOPD's share of the pair's F1, m / (m + p) (0.5 when
          both are 0), on the long horizon minus on the short one; the relative advantage the paper reports
          ((m - p) / p grows exactly when the share does), on a bounded scale. Needs both methods on the same seeds
  1b_abs  the same growth in absolute F1: (m - p) on the long horizon minus on the short one
  2a      the persistent-history teacher over PPO (memopd_persistent - ppo), short horizon
  2b      state alignment on top of it (memopd - memopd_persistent), short horizon
  3       the teacher's knowledge beyond a KL anchor (memopd - memopd_self), short horizon

Every test: memopd.stats.compare_seeds (the same seeds: paired t interval and exact sign-flip p; else Welch's
interval and the exact permutation p), or one_sample_test of per-seed growths.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from memopd.stats import NAN, SeedTest, compare_seeds, holm, noise_verdict, one_sample_test


@dataclass(frozen=True)
class Claim:
    key: str
    words: str
    base: str
    other: str
    kind: str = "diff"  # diff (other - base on the short horizon) | share_growth | abs_growth (long minus short)


CLAIMS = (
    Claim("1a", "MemOPD over PPO", "ppo", "memopd"),
    Claim("1b", "the advantage grows with the horizon (MemOPD's share of the pair's F1)", "ppo", "memopd",
          "share_growth"),
    Claim("1b_abs", "the advantage grows with the horizon (absolute F1 difference)", "ppo", "memopd", "abs_growth"),
    Claim("2a", "persistent-history teacher over PPO", "ppo", "memopd_persistent"),
    Claim("2b", "state alignment on top of it", "memopd_persistent", "memopd"),
    Claim("3", "the teacher's knowledge beyond a KL anchor", "memopd_self", "memopd"),
)
# the paper's figures beside a claim (relative change of the mean, %): Tables 1-2 and its matched control
PAPER_PCT = {"1a": 14.3, "1b": 283.2 - 14.3, "2a": 5.6, "2b": 7.0}
COLUMNS = ["claim", "words", "role", "horizons", "base_mean", "other_mean", "estimate", "ci_low", "ci_high", "p",
           "p_min", "p_holm", "seeds", "test", "paper_pct", "noise"]


def share(m: float, p: float) -> float:
    """MemOPD's share of the pair's F1: 0.5 when both are 0."""
    return 0.5 if m + p == 0 else m / (m + p)


def claim_test(claim: Claim, f1: dict, short: str, long: str) -> tuple[SeedTest, float, float]:
    """(test, base mean, other mean); f1: {(method, benchmark): {seed: F1}}."""
    b, o = f1[(claim.base, short)], f1[(claim.other, short)]
    means = (sum(b.values()) / len(b), sum(o.values()) / len(o))
    if claim.kind == "diff":
        return compare_seeds(b, o), *means
    if set(b) != set(o):
        raise ValueError(f"claim {claim.key}: {claim.other} and {claim.base} need the same seeds")
    bl, ol = f1[(claim.base, long)], f1[(claim.other, long)]
    grow = (lambda s: share(ol[s], bl[s]) - share(o[s], b[s])) if claim.kind == "share_growth" else \
        (lambda s: (ol[s] - bl[s]) - (o[s] - b[s]))
    t = one_sample_test([grow(s) for s in sorted(b)])
    return SeedTest(t.diff, t.ci_low, t.ci_high, t.p, t.p_min, t.n, "per-seed growth: " + t.test), *means


def claim_rows(f1: dict, primary: list[str], short: str, long: str) -> list[dict]:
    """One row per claim whose methods were run, the primaries Holm-adjusted together."""
    methods = {m for m, _ in f1}
    if unknown := set(primary) - {c.key for c in CLAIMS}:
        raise ValueError(f"claims.primary: unknown claims {sorted(unknown)}; known: {[c.key for c in CLAIMS]}")
    rows = []
    for c in CLAIMS:
        if not {c.base, c.other} <= methods:
            if c.key in primary:
                raise ValueError(f"claims.primary names {c.key}, but {c.base} or {c.other} is not trained")
            continue
        t, bm, om = claim_test(c, f1, short, long)
        rows.append({"claim": c.key, "words": c.words, "role": "primary" if c.key in primary else "secondary",
                     "horizons": short if c.kind == "diff" else f"{long} - {short}", "base_mean": bm,
                     "other_mean": om, "estimate": t.diff, "ci_low": t.ci_low, "ci_high": t.ci_high, "p": t.p,
                     "p_min": t.p_min, "seeds": t.n, "test": t.test, "paper_pct": PAPER_PCT.get(c.key, NAN)})
    adjusted = holm([r["p"] for r in rows if r["role"] == "primary"])
    it = iter(adjusted)
    for r in rows:
        r["p_holm"] = next(it) if r["role"] == "primary" else NAN
        p = r["p_holm"] if r["role"] == "primary" else r["p"]
        r["noise"] = noise_verdict(r["ci_low"], r["ci_high"], p)
    return rows


def claim_notes(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        p = f"p {r['p']:.4f}" + (f", Holm {r['p_holm']:.4f}" if r["role"] == "primary" else "")
        paper = "" if math.isnan(r["paper_pct"]) else f"; the paper: {r['paper_pct']:+.1f}%"
        out.append(f"Finding: {r['claim']} ({r['role']}) {r['words']}: {r['estimate']:+.3f} [{r['ci_low']:+.3f}, "
                   f"{r['ci_high']:+.3f}], {p}, {r['noise']}{paper}.")
    return out
