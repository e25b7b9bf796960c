"""The controlled study's decision rules (memopd.study) on small fixtures of evaluation files."""
import csv
import json

import pytest

from memopd.study.chain import Benchmarks, chain_models, check

B = Benchmarks()
TASKS = 20


def _write(eval_dir, model, bench, em, f1, answered=1.0):
    d = eval_dir / model
    d.mkdir(parents=True, exist_ok=True)
    em, f1 = (em if isinstance(em, list) else [em] * TASKS), (f1 if isinstance(f1, list) else [f1] * TASKS)
    with open(d / f"{bench}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["task_id", "em", "f1"])
        w.writeheader()
        w.writerows({"task_id": f"t{i}", "em": e, "f1": s} for i, (e, s) in enumerate(zip(em, f1)))
    (d / f"{bench}.json").write_text(json.dumps({"episodes": TASKS, "answered_rate": answered,
                                                 "em": sum(em) / TASKS, "f1": sum(f1) / TASKS}))


def _model(eval_dir, name, reward, short, long, answered=0.8):
    _write(eval_dir, name, B.reward, reward, reward)
    _write(eval_dir, name, B.short, 0.0, short)
    _write(eval_dir, name, B.long, 0.0, long, answered)


@pytest.fixture
def chain(tmp_path):
    _write(tmp_path, "teacher_sft", B.short, 0.0, 0.5)
    _write(tmp_path, "teacher_sft", B.long, 0.0, 0.4)
    _model(tmp_path, "s1", 0.0, 0.0, 0.0)  # no reward, does not act
    _model(tmp_path, "s2", [1.0] + [0.0] * (TASKS - 1), 0.3, 0.2)  # mean reward 0.05 on one task: interval from 0
    _model(tmp_path, "s3", 0.1, 0.3, 0.0)  # earns and reads, but does not act at the long horizon
    _model(tmp_path, "s4", 0.1, 0.3, 0.2)  # passes every condition
    _model(tmp_path, "s5", 0.2, 0.45, 0.35)  # passes (a)-(c), too close to the teacher
    return tmp_path


def test_the_earliest_snapshot_passing_every_condition_is_chosen(chain):
    choice = check(chain, ["s1", "s2", "s3", "s4", "s5"], "teacher_sft")
    assert (choice.model, choice.branch) == ("s4", "go")
    by = {c.model: c for c in choice.candidates}
    assert [k for k, x in by["s1"].conditions.items() if not x.passed] == ["a", "b"]
    assert not by["s2"].conditions["a"].passed and by["s2"].conditions["b"].passed  # 0.05 >= 0.03, interval at 0
    assert [k for k, x in by["s3"].conditions.items() if not x.passed] == ["b"]
    assert by["s4"].passes and "+0.200 [+0.200, +0.200]" in by["s4"].conditions["d_long"].figures
    assert [k for k, x in by["s5"].conditions.items() if not x.passed] == ["d_short", "d_long"]  # +0.05 each


def test_fallback_then_no_go(chain):
    choice = check(chain, ["s1", "s3", "s5"], "teacher_sft")
    assert (choice.model, choice.branch) == ("s3", "fallback")  # (a) and (d) at the short horizon
    _model(chain, "s6", 0.1, 0.3, 0.2, answered=0.4)  # answers too few long episodes: fallback too
    assert check(chain, ["s6"], "teacher_sft").branch == "fallback"
    assert (check(chain, ["s1", "s5"], "teacher_sft").model, check(chain, ["s1", "s5"], "teacher_sft").branch) == \
        (None, "no-go")


def test_chain_order_student_snapshots_student_then_the_teachers_continuation():
    sft = {"student": {"steps": 10, "snapshots": [3, 6]}, "teacher": {"steps": 8, "init": "student_sft",
                                                                      "snapshots": [4]}}
    assert chain_models(sft) == ["student_sft_s3", "student_sft_s6", "student_sft", "teacher_sft_s4"]
    sft["teacher"]["init"] = None  # a teacher trained on its own is not on the student's chain
    assert chain_models(sft) == ["student_sft_s3", "student_sft_s6", "student_sft"]


def test_cli_writes_every_condition_and_the_choice(chain, tmp_path, capsys):
    from memopd.cli import main

    for name, src in (("student_sft", "s3"), ("teacher_sft_s2", "s4")):
        for bench in (B.reward, B.short, B.long):
            for ext in (".json", ".csv"):
                (chain / name).mkdir(exist_ok=True)
                (chain / name / f"{bench}{ext}").write_text((chain / src / f"{bench}{ext}").read_text())
    sft = {"student": {"steps": 4}, "teacher": {"steps": 4, "init": "student_sft", "snapshots": [2]}}
    main(["study", "chain", "--cfg", json.dumps(sft), "--eval-dir", str(chain), "--out", str(tmp_path / "c.json")])
    out = json.loads((tmp_path / "c.json").read_text())
    assert (out["chosen"], out["branch"]) == ("teacher_sft_s2", "go")
    assert [c["model"] for c in out["candidates"]] == ["student_sft", "teacher_sft_s2"]
    assert "chosen: teacher_sft_s2 (go" in capsys.readouterr().out
    assert (tmp_path / "c.txt").read_text().splitlines()[-1].startswith("chosen: teacher_sft_s2")


def _sign_flip_by_enumeration(values):
    import itertools

    obs = abs(sum(values) / len(values))
    pats = list(itertools.product((1, -1), repeat=len(values)))
    return sum(abs(sum(s * v for s, v in zip(p, values)) / len(values)) >= obs - 1e-12 for p in pats) / len(pats)


def test_claims_primaries_are_holm_adjusted_together_and_the_growth_is_per_seed():
    import random

    from memopd.study.claims import claim_rows

    rng = random.Random(3)
    seeds10, seeds5 = range(10), range(5)
    f1 = {}
    for m, seeds, lvl in (("ppo", seeds10, 0.08), ("memopd", seeds10, 0.13), ("memopd_self", seeds5, 0.07)):
        f1[(m, "q2_test")] = {s: lvl + rng.uniform(-0.03, 0.03) for s in seeds}
        f1[(m, "q8_test")] = {s: lvl / 3 + rng.uniform(-0.02, 0.02) for s in seeds}
    f1[("ppo", "q8_test")][4] = 0.0
    f1[("memopd", "q8_test")][4] = 0.0  # both 0: a share of 0.5
    rows = {r["claim"]: r for r in claim_rows(f1, ["1a", "1b", "3"], "q2_test", "q8_test")}
    assert set(rows) == {"1a", "1b", "1b_abs", "3"}  # no memopd_persistent run: no 2a, 2b
    m2, p2, m8, p8 = (f1[(m, b)] for b in ("q2_test", "q8_test") for m in ("memopd", "ppo"))
    share = lambda a, b: 0.5 if a + b == 0 else a / (a + b)  # noqa: E731
    growth = [share(m8[s], p8[s]) - share(m2[s], p2[s]) for s in seeds10]
    assert rows["1b"]["estimate"] == pytest.approx(sum(growth) / 10)
    assert rows["1b"]["p"] == pytest.approx(_sign_flip_by_enumeration(growth))
    absg = [(m8[s] - p8[s]) - (m2[s] - p2[s]) for s in seeds10]
    assert rows["1b_abs"]["estimate"] == pytest.approx(sum(absg) / 10) and rows["1b_abs"]["role"] == "secondary"
    diffs = [m2[s] - p2[s] for s in seeds10]
    assert rows["1a"]["p"] == pytest.approx(_sign_flip_by_enumeration(diffs))
    # Holm by hand over the three primaries; the secondary keeps its own p
    ps = sorted((rows[k]["p"], k) for k in ("1a", "1b", "3"))
    expect, running = {}, 0.0
    for j, (p, k) in enumerate(ps):
        running = max(running, min(1.0, (3 - j) * p))
        expect[k] = running
    assert all(rows[k]["p_holm"] == pytest.approx(expect[k]) for k in expect)
    assert rows["3"]["seeds"] == 15 and "Welch" in rows["3"]["test"]
    with pytest.raises(ValueError, match="2b"):
        claim_rows(f1, ["1a", "2b"], "q2_test", "q8_test")
    with pytest.raises(ValueError, match="unknown claims"):
        claim_rows(f1, ["1c"], "q2_test", "q8_test")
