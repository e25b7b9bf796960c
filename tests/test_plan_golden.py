"""The plan of each shipped config, byte for byte: `memopd plan --config config/<name>.yaml --out <name>.csv` writes
the CSV and the Markdown plan, prints the plan, refuses what does not fit (stderr, exit code) exactly as stored
under tests/data/plan/, and `memopd plan --help` reads as stored.

The runs see an empty Hugging Face cache and a working directory without results/models/, so the model sizes
come from each config's plan.models table, whatever this machine has downloaded or built. The runs do not fix
Python's string hash seed, so a plan that depended on set order would fail here. After a deliberate
change of the plan (or of a config), rewrite the stored files and review their diff:
MEMOPD_WRITE_GOLDEN=1 .venv/bin/python -m pytest tests/test_plan_golden.py
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests/data/plan"
CONFIGS = ["config", "small", "paper"]
WRITE = os.environ.get("MEMOPD_WRITE_GOLDEN") == "1"


def _memopd(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`memopd ...` of this checkout, in an empty directory, offline, with an empty hub cache, 80 columns wide."""
    env = {**os.environ, "COLUMNS": "80", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_CACHE": str(tmp_path / "hf_hub"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))}
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "memopd.cli", *args], cwd=run, env=env, capture_output=True,
                          check=False, timeout=300)


def _same(name: str, got: bytes) -> None:
    path = GOLDEN / name
    if WRITE:
        path.write_bytes(got)
    assert got == path.read_bytes(), f"{name} differs from tests/data/plan/{name}"


@pytest.mark.parametrize("name", CONFIGS)
def test_the_plan_of_each_shipped_config_byte_for_byte(tmp_path, name):
    out = tmp_path / f"{name}.csv"
    r = _memopd(tmp_path, "plan", "--config", str(REPO / f"config/{name}.yaml"), "--out", str(out))
    _same(f"{name}.csv", out.read_bytes())
    _same(f"{name}.md", out.with_suffix(".md").read_bytes())
    _same(f"{name}.stdout", r.stdout)
    _same(f"{name}.stderr", r.stderr)
    _same(f"{name}.exit", f"{r.returncode}\n".encode())


def test_the_plan_help_byte_for_byte(tmp_path):
    r = _memopd(tmp_path, "plan", "--help")
    assert r.returncode == 0, r.stderr
    _same("help.txt", r.stdout)
