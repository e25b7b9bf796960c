"""On a finished run of the whole DAG, Snakemake reruns exactly what a change of code affects (the rules' code
params, memopd.codegraph): a one-line change of the training update reruns the training jobs and what depends on
them; a change of the audit steps reruns the audits and no training job.

Needs a finished smoke run (config/smoke.yaml): `.ci/run` makes one and points MEMOPD_SMOKE_DIR at it; elsewhere
these tests skip. Each test appends a line to one module of that run's src/, dry-runs `all`, and restores it.
"""
from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SMOKE = os.environ.get("MEMOPD_SMOKE_DIR")
pytestmark = pytest.mark.skipif(not SMOKE, reason="needs a finished smoke run: MEMOPD_SMOKE_DIR (.ci/run sets it)")


def _rules_to_run() -> dict[str, int]:
    """Jobs per rule that `snakemake -n all` would run in the smoke directory."""
    out = subprocess.run([sys.executable, "-m", "snakemake", "-n", "all", "--configfile", "config/smoke.yaml"],
                         cwd=SMOKE, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout + out.stderr
    if "Nothing to be done" in text:
        return {}
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", text, re.M) if m[1] not in ("total", "job")}


def _after_change(module: str) -> dict[str, int]:
    path = Path(SMOKE) / "src" / "memopd" / module
    text = path.read_text()
    try:
        path.write_text(text + "\n# one more line\n")
        return _rules_to_run()
    finally:
        path.write_text(text)


def test_an_unchanged_tree_reruns_nothing():
    assert _rules_to_run() == {}


def test_a_change_of_the_training_update_reruns_training_and_what_depends_on_it():
    rules = _after_change("train/update.py")
    assert rules.pop("train") >= 3 and rules.pop("eval") >= 1, rules
    # the controlled study (rule study) trains too: its nested workflow reruns its own training
    assert set(rules) <= {"results_tables", "matched_control", "training_curves", "study", "all"}, rules


def test_a_change_of_the_audit_steps_reruns_the_audits_and_no_training():
    rules = _after_change("audit/steps.py")
    assert {"audit_alignment", "audit_state_corruption", "audit_episodes"} <= set(rules), rules
    assert not {"train", "sft_train", "eval", "results_tables"} & set(rules), rules


def test_a_study_killed_mid_job_resumes_when_its_rule_reruns():
    """A hard kill leaves Snakemake's incomplete marker on a nested job's output; the command of rule study must
    then plan that job again rather than stop with IncompleteFilesException (the study runs for hours)."""
    out = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-p", "--forcerun", "study", "all",
                          "--configfile", "config/smoke.yaml"], cwd=SMOKE, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    command = next(line.removeprefix("Shell command: ") for line in (out.stdout + out.stderr).splitlines()
                   if line.startswith("Shell command: ") and " -d results/study " in line)
    command = command.split(" > ")[0] + " -n"  # the nested workflow's plan, without running it
    # Snakemake's file persistence: .snakemake/incomplete/<urlsafe base64 of the output's path>
    marker = Path(SMOKE, "results/study/.snakemake/incomplete",
                  base64.urlsafe_b64encode(b"results/tables/matched_control.csv").decode())
    marker.write_text('{"external_jobid": null}')
    try:
        nested = subprocess.run(command, shell=True, cwd=SMOKE, capture_output=True, text=True, timeout=300)
    finally:
        marker.unlink()
    text = nested.stdout + nested.stderr
    assert nested.returncode == 0 and "IncompleteFilesException" not in text, text[-2000:]
    assert re.search(r"^matched_control\s+1$", text, re.M), text[-2000:]


def test_the_study_archive_rebuilds_the_study_tables(tmp_path):
    """The smoke study's archive (rule archive) alone gives its result tables' CSVs again, byte for byte."""
    study = Path(SMOKE) / "results/study/results"
    out = subprocess.run([sys.executable, "-m", "memopd.cli", "report", "from-archive", "--archive",
                          str(study / "archive"), "--out-dir", str(tmp_path)], cwd=SMOKE, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(Path(SMOKE) / "src")})
    assert out.returncode == 0, out.stderr[-2000:]
    for table in ("multiobjective", "wikirag", "vs_student", "matched_control", "training_curves"):
        rebuilt, own = tmp_path / "tables" / f"{table}.csv", study / "tables" / f"{table}.csv"
        assert rebuilt.read_bytes() == own.read_bytes(), table
