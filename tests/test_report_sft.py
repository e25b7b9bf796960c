"""`memopd report sft`: the SFT summary's paired comparison of every model with the SFT student, task by task."""
import csv
import json
import random

import pytest

from memopd.cli import main


def _model(tmp_path, name, f1):
    """An evaluation (JSON + per-task CSV), held-out loss and model info of one model, F1 per task given."""
    d = tmp_path / "eval" / name
    d.mkdir(parents=True)
    em = {t: float(v == 1.0) for t, v in f1.items()}
    (d / "q2_test.json").write_text(json.dumps({"episodes": len(f1), "f1": sum(f1.values()) / len(f1),
                                                "em": sum(em.values()) / len(em), "invalid_action_rate": 0.0,
                                                "calls_per_episode": 3.0, "answered_rate": 1.0}))
    with open(d / "q2_test.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["task_id", "f1", "em"])
        w.writeheader()
        w.writerows({"task_id": t, "f1": v, "em": em[t]} for t, v in f1.items())
    (tmp_path / f"heldout_{name}.json").write_text(json.dumps({"params": 10, "heldout_target_loss": 0.1}))
    (tmp_path / f"info_{name}.json").write_text(json.dumps({"sft": {"train_seconds": 1.0}}))


def _run(tmp_path, names, **extra):
    out = tmp_path / "sft_summary.csv"
    main(["report", "sft", "--names", *names,
          "--heldout", *[str(tmp_path / f"heldout_{n}.json") for n in names],
          "--eval", *[str(tmp_path / "eval" / n / "q2_test.json") for n in names],
          "--info", *[str(tmp_path / f"info_{n}.json") for n in names], "--out", str(out),
          *[a for k, v in extra.items() for a in (f"--{k}", v)]])
    with open(out, newline="") as f:
        return {r["model"]: r for r in csv.DictReader(f)}, out.with_suffix(".md").read_text()


def test_every_model_is_compared_with_the_student_task_by_task(tmp_path):
    rng = random.Random(0)
    tasks = [f"t{i}" for i in range(60)]
    student = {t: rng.choice([0.0, 0.5, 1.0]) for t in tasks}
    teacher = {t: min(1.0, v + 0.5) if i % 3 == 0 else v for i, (t, v) in enumerate(student.items())}  # better or equal
    noisy = {t: rng.choice([0.0, 0.5, 1.0]) for t in tasks}
    for name, f1 in (("student_sft", student), ("teacher_sft", teacher), ("other", noisy)):
        _model(tmp_path, name, f1)
    rows, md = _run(tmp_path, ["student_sft", "teacher_sft", "other"])
    for name, f1 in (("teacher_sft", teacher), ("other", noisy)):
        diffs = [f1[t] - student[t] for t in tasks]  # the plain mean of per-task differences
        r = rows[name]
        assert float(r["f1_vs_ref"]) == pytest.approx(sum(diffs) / len(diffs))
        assert float(r["f1_vs_ref_ci_low"]) <= float(r["f1_vs_ref"]) <= float(r["f1_vs_ref_ci_high"])
    # the teacher is never worse and better on a third of the tasks: its interval excludes 0
    assert float(rows["teacher_sft"]["f1_vs_ref_ci_low"]) > 0
    assert "Finding: teacher_sft - student_sft: F1 +" in md and "outside the noise (CI excludes 0)" in md
    # two independent draws: the interval is wide and contains 0
    r = rows["other"]
    assert float(r["f1_vs_ref_ci_low"]) < 0 < float(r["f1_vs_ref_ci_high"])
    assert "Finding: other - student_sft" in md and "inside the noise (CI contains 0)" in md
    assert float(rows["student_sft"]["f1_vs_ref"]) == 0.0  # the reference against itself
    em = [float(teacher[t] == 1.0) - float(student[t] == 1.0) for t in tasks]
    assert float(rows["teacher_sft"]["em_vs_ref"]) == pytest.approx(sum(em) / len(em))


def test_models_evaluated_on_other_tasks_are_refused(tmp_path, capsys):
    _model(tmp_path, "student_sft", {"a": 1.0, "b": 0.0})
    _model(tmp_path, "teacher_sft", {"a": 1.0, "c": 0.0})
    for extra, said in (({}, "other tasks"), ({"reference": "x"}, "--reference x")):
        with pytest.raises(SystemExit) as e:
            _run(tmp_path, ["student_sft", "teacher_sft"], **extra)
        assert e.value.code == 2 and said in capsys.readouterr().err
    assert not (tmp_path / "sft_summary.csv").exists()


def test_a_snapshot_counts_its_runs_seconds_up_to_it(tmp_path):
    tasks = {f"t{i}": float(i % 2) for i in range(10)}
    for name in ("student_sft", "teacher_sft_s600"):
        _model(tmp_path, name, tasks)
    # a snapshot's record keeps the student's SFT (its init) beside its own run up to the snapshot
    (tmp_path / "info_teacher_sft_s600.json").write_text(json.dumps(
        {"sft": {"train_seconds": 1.0}, "snapshot": {"step": 600, "train_seconds": 7.5}}))
    rows, _ = _run(tmp_path, ["student_sft", "teacher_sft_s600"])
    assert float(rows["teacher_sft_s600"]["train_seconds"]) == 7.5 and float(rows["student_sft"]["train_seconds"]) == 1.0
