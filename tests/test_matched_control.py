"""The matched control table (memopd report matched-control) on hand-made evaluations."""
import csv
import itertools
import json
import math
import statistics

import pytest

from memopd.cli import main
from memopd.config import TrainRuns
from memopd.report.results import matched_control_notes, matched_control_rows, matched_control_table

SEEDS = [0, 3, 7, 8, 9, 20]  # six: the smallest sign-flip p is 2 / 64, so a difference can be outside the noise
# Per seed, q2_test: memopd_persistent beats ppo on every seed (F1); memopd vs memopd_persistent changes
# sign across seeds (F1 diffs +0.10, -0.10, +0.02, 0, -0.01, -0.01): inside the noise.
F1 = {"ppo": [0.20, 0.30, 0.25, 0.22, 0.28, 0.24], "memopd_persistent": [0.22, 0.33, 0.26, 0.25, 0.30, 0.27],
      "memopd": [0.32, 0.23, 0.28, 0.25, 0.29, 0.26]}
EM = {"ppo": [0.10, 0.20, 0.15, 0.12, 0.18, 0.14], "memopd_persistent": [0.12, 0.20, 0.18, 0.13, 0.19, 0.15],
      "memopd": [0.14, 0.25, 0.20, 0.16, 0.21, 0.17]}
T975_DF5 = 2.571  # Student t quantile t(0.975, 5), from a printed table
TRAIN = {"student": "student_sft", "teacher": "teacher_sft", "benchmark": "q2_train", "steps": 4, "batch_tasks": 8,
         "seeds": [0, 1, 2, 3, 4], "matched_control": {"seeds": SEEDS, "benchmark": "q2_test"},
         "methods": ["ppo", "memopd_persistent", "memopd"], "horizons": {"q2_test": "Q2"}}


def _write_evals(root, seeds=SEEDS):
    for m in F1:
        for i, s in enumerate(seeds):
            d = root / f"{m}_seed{s}"
            d.mkdir(parents=True, exist_ok=True)
            (d / "q2_test.json").write_text(json.dumps({"episodes": 20, "em": EM[m][i], "f1": F1[m][i]}))
            # another benchmark of the same runs, and a seed outside the control: never read
            (d / "q8_test.json").write_text(json.dumps({"episodes": 4, "em": 9.0, "f1": 9.0}))
        d = root / f"{m}_seed1"
        d.mkdir(parents=True, exist_ok=True)
        (d / "q2_test.json").write_text(json.dumps({"episodes": 20, "em": 9.0, "f1": 9.0}))


def _read(path):
    with open(path) as f:
        return {(r["row"], r["metric"]): r for r in csv.DictReader(f)}


def _sign_flip(d):
    obs = abs(sum(d))
    return sum(abs(sum(x * v for x, v in zip(signs, d))) >= obs - 1e-12
               for signs in itertools.product((-1, 1), repeat=len(d))) / 2 ** len(d)


@pytest.fixture
def table(tmp_path):
    _write_evals(tmp_path / "eval")
    out = tmp_path / "tables/matched_control.csv"
    main(["report", "matched-control", "--cfg", json.dumps(TRAIN), "--eval-dir", str(tmp_path / "eval"),
          "--out", str(out)])
    return out


def test_method_rows_are_the_control_seeds_on_its_benchmark(table):
    rows = _read(table)
    for metric, data in (("f1", F1), ("em", EM)):
        for m, vals in data.items():
            r = rows[(m, metric)]
            assert float(r["mean"]) == pytest.approx(statistics.fmean(vals))  # seed 1 and q8_test (9.0) unread
            assert float(r["std"]) == pytest.approx(statistics.stdev(vals))
            assert int(r["seeds"]) == 6 and float(r["ci_low"]) <= float(r["mean"]) <= float(r["ci_high"])
            assert r["change_pct"] == "" and r["noise"] == ""


@pytest.mark.parametrize("other, base, paper", [("memopd_persistent", "ppo", {"f1": 5.6, "em": 4.4}),
                                                ("memopd", "memopd_persistent", {"f1": 7.0, "em": 10.0})])
def test_increments_match_a_plain_computation(table, other, base, paper):
    rows = _read(table)
    for metric, data in (("f1", F1), ("em", EM)):
        r = rows[(f"{other} vs {base}", metric)]
        d = [o - b for b, o in zip(data[base], data[other])]
        mb, mo = statistics.fmean(data[base]), statistics.fmean(data[other])
        assert float(r["change_pct"]) == pytest.approx(100 * (mo - mb) / mb)
        assert float(r["diff"]) == pytest.approx(statistics.fmean(d))
        half = T975_DF5 * statistics.stdev(d) / math.sqrt(len(d))
        assert float(r["diff_ci_low"]) == pytest.approx(statistics.fmean(d) - half, abs=1e-3 * half)
        assert float(r["diff_ci_high"]) == pytest.approx(statistics.fmean(d) + half, abs=1e-3 * half)
        zeros = sum(abs(x) < 1e-12 for x in d)  # a zero difference's sign changes nothing
        assert float(r["p"]) == pytest.approx(_sign_flip(d)) and float(r["p_min"]) == pytest.approx(2 ** (1 + zeros) / 64)
        assert float(r["paper_change_pct"]) == paper[metric] and int(r["table_tests"]) == 4
        assert r["role"] == ("primary" if metric == "f1" else "secondary")


def test_em_is_holm_adjusted_and_the_verdicts_follow_the_rule(table):
    rows = _read(table)
    em = [rows[(f"{o} vs {b}", "em")] for o, b in (("memopd_persistent", "ppo"), ("memopd", "memopd_persistent"))]
    p = sorted(float(r["p"]) for r in em)
    adjusted = sorted(float(r["p_holm"]) for r in em)
    assert adjusted == pytest.approx([min(1, 2 * p[0]), max(min(1, 2 * p[0]), p[1])])  # Holm over the two EM rows
    f1 = rows[("memopd_persistent vs ppo", "f1")]
    assert float(f1["p_holm"]) == float(f1["p"]) == pytest.approx(2 / 64)  # primary: not adjusted
    assert f1["noise"] == "outside the noise"  # better on every seed
    assert rows[("memopd vs memopd_persistent", "f1")]["noise"] == "inside the noise"  # mixed signs
    # the same EM difference (p 2/64 alone) is only suggestive once adjusted for the two EM comparisons
    assert float(rows[("memopd vs memopd_persistent", "em")]["p"]) == pytest.approx(2 / 64)
    assert rows[("memopd vs memopd_persistent", "em")]["noise"] == "suggestive"


def test_caption_names_the_runs_and_findings_quote_the_paper(table):
    md = table.with_suffix(".md").read_text()
    caption = md.splitlines()[0]
    for needle in ("ppo, memopd_persistent, memopd", "seeds [0, 3, 7, 8, 9, 20]", "q2_test", "results/train/{method}/seed{seed}/",
                   "ppo_seed0", "memopd_persistent_seed3", "memopd_seed7", "results/eval/{model}/q2_test.json",
                   "20 tasks", "+5.6% F1 / +4.4% EM", "+7.0% F1 / +10.0% EM"):
        assert needle in caption, needle
    assert "seed1" not in caption
    findings = [line for line in md.splitlines() if line.startswith("Finding")]
    assert len(findings) == 4
    mixed = next(f for f in findings if "alignment on top" in f and "F1" in f)
    assert "paper +7.0%" in mixed and "inside the noise: these seeds do not tell it" in mixed
    assert "exact p " in mixed and "(smallest possible 0.0625)" in mixed and "4 comparisons in the table" in mixed
    assert "primary (2 in the table), not adjusted" in mixed
    em = next(f for f in findings if "alignment on top" in f and "EM" in f)
    assert "Holm-adjusted p 0.0625 (secondary, over 2)" in em and "suggestive only" in em
    assert "paired t interval and sign-flip p when both have the same seeds" in caption and "EM Holm-adjusted" in caption


def test_one_seed_gives_no_interval_and_says_so(tmp_path):
    _write_evals(tmp_path / "eval", seeds=[7])
    cfg = {**TRAIN, "matched_control": {"seeds": [7]}}  # benchmark: the default q2_test
    rows = {(r["row"], r["metric"]): r for r in matched_control_table(TrainRuns.from_section(cfg), tmp_path / "eval", tmp_path / "t.csv")}
    r = rows[("memopd vs memopd_persistent", "f1")]
    assert r["noise"] == "no test" and r["diff"] == pytest.approx(0.32 - 0.22)  # the first values
    md = (tmp_path / "t.md").read_text()
    assert "no claim" in md and "; 1 seed); " in md and "1 seeds" not in md


def test_a_missing_run_names_its_evaluation(tmp_path):
    _write_evals(tmp_path / "eval")
    cfg = {**TRAIN, "matched_control": {"seeds": [0, 5], "benchmark": "q2_test"}}
    with pytest.raises(FileNotFoundError, match="ppo_seed5/q2_test.json"):
        matched_control_table(TrainRuns.from_section(cfg), tmp_path / "eval", tmp_path / "t.csv")


def test_findings_say_whether_a_clear_difference_goes_the_papers_way():
    """Hand-made direction: memopd_persistent beats ppo on every seed (the paper's sign, +5.6% F1); memopd loses
    to memopd_persistent on every seed (against the paper's +7.0%). Both are outside the noise."""
    f1 = {"ppo": [0.20, 0.30, 0.25, 0.22, 0.28, 0.24], "memopd_persistent": [0.24, 0.33, 0.30, 0.26, 0.31, 0.27],
          "memopd": [0.20, 0.31, 0.26, 0.23, 0.29, 0.25]}
    scores = {(m, "q2_test"): {s: {"f1": v, "em": v} for s, v in zip(SEEDS, vals)} for m, vals in f1.items()}
    notes = {line.split(",")[0]: line for line in matched_control_notes(matched_control_rows(scores, "q2_test"))
             if ", F1)" in line}
    assert "outside the noise, the same direction as the paper" in notes["Finding (persistent teacher"]
    assert "outside the noise, the opposite direction as the paper" in notes["Finding (alignment on top"]


def test_each_method_on_its_own_seeds_with_the_regularisation_control(tmp_path):
    """No control seeds of its own: ppo and memopd on ten seeds, the two controls on five (train.per_method). The
    increments across different seeds are Welch's interval and the exact permutation p over all C(15, 5) splits,
    against plain computations; `memopd vs memopd_self` (the KL anchor) has no paper figure and says so."""
    from itertools import combinations

    from scipy import stats

    rng = __import__("random").Random(3)
    own = {"ppo": list(range(10)), "memopd": list(range(10)), "memopd_persistent": list(range(5)),
           "memopd_self": list(range(5))}
    shift = {"ppo": 0.20, "memopd": 0.26, "memopd_persistent": 0.21, "memopd_self": 0.22}
    f1 = {m: [shift[m] + rng.gauss(0, 0.03) for _ in ss] for m, ss in own.items()}
    for m, ss in own.items():
        for s, v in zip(ss, f1[m]):
            d = tmp_path / "eval" / f"{m}_seed{s}"
            d.mkdir(parents=True)
            (d / "q2_test.json").write_text(json.dumps({"episodes": 20, "em": v / 2, "f1": v}))
    cfg = {**TRAIN, "methods": list(own), "seeds": own["ppo"], "matched_control": {"seeds": None},
           "per_method": {"memopd_persistent": {"seeds": own["memopd_persistent"]},
                          "memopd_self": {"seeds": own["memopd_self"]}}}
    rows = {(r["row"], r["metric"]): r for r in matched_control_table(TrainRuns.from_section(cfg), tmp_path / "eval", tmp_path / "t.csv")}
    assert {m: rows[(m, "f1")]["seeds"] for m in own} == {m: len(ss) for m, ss in own.items()}
    for other, base in (("memopd_persistent", "ppo"), ("memopd", "memopd_persistent"), ("memopd", "memopd_self")):
        r = rows[(f"{other} vs {base}", "f1")]
        a, b = f1[other], f1[base]
        va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
        df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))  # Welch-Satterthwaite
        half = stats.t.ppf(0.975, df) * math.sqrt(va + vb)
        diff = statistics.fmean(a) - statistics.fmean(b)
        assert (r["diff"], r["diff_ci_low"], r["diff_ci_high"]) == pytest.approx((diff, diff - half, diff + half))
        pool, k = a + b, len(a)
        splits = [statistics.fmean(x) - statistics.fmean([pool[i] for i in range(15) if i not in idx])
                  for idx in combinations(range(15), k) for x in [[pool[i] for i in idx]]]
        assert r["p"] == pytest.approx(sum(abs(d) >= abs(diff) - 1e-12 for d in splits) / len(splits))
        assert r["seeds"] == f"{len(a)}/{len(b)}" and r["test"].startswith("Welch")
    md = (tmp_path / "t.md").read_text()
    anchor = next(line for line in md.splitlines() if line.startswith("Finding (the teacher beyond a KL anchor"))
    assert "no paper figure" in anchor and "10/5 seeds" in anchor
    caption = md.splitlines()[0]
    assert "seeds ppo [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], memopd_persistent [0, 1, 2, 3, 4], memopd [0, 1" in caption
    assert "memopd_self_seed4" in caption and "memopd_self_seed5" not in caption
    assert "`memopd vs memopd_self` = the teacher beyond a KL anchor" in caption
