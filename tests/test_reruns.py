"""On a finished run of the whole DAG, Snakemake reruns exactly what a change of code affects (the rules' code
params, memopd.codegraph): a one-line change of the training update reruns the training jobs and what depends on
them; a change of the audit steps reruns the audits and no training job.

Needs a finished smoke run (config/smoke.yaml): `.ci/run` makes one and points MEMOPD_SMOKE_DIR at it; elsewhere
these tests skip. Each test appends a line to one module of that run's src/, dry-runs `all`, and restores it.
"""
from __future__ import annotations

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
    rules = _after_change("train/ppo.py")
    assert rules.pop("train") >= 3 and rules.pop("eval") >= 1, rules
    # the controlled study (rule study) trains too: its nested workflow reruns its own training
    assert set(rules) <= {"results_tables", "matched_control", "training_curves", "study", "all"}, rules


def test_a_change_of_the_audit_steps_reruns_the_audits_and_no_training():
    rules = _after_change("audit/steps.py")
    assert {"audit_alignment", "audit_state_corruption", "audit_episodes"} <= set(rules), rules
    assert not {"train", "sft_train", "eval", "results_tables"} & set(rules), rules
