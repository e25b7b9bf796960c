"""tests/gpu/check.sh without a GPU: it exits 0 and its summary names every part as skipped."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARTS = ["gpu_tests", "vllm_sleep_wake", "rce_bf16", "bench_packing"]  # as docs/testing.md "GPU check" lists them


def test_check_script_skips_every_part_without_a_gpu(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "GPU_CHECK_OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(REPO / "tests/gpu/check.sh")], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = (tmp_path / "out/summary.tsv").read_text().splitlines()
    assert lines[0].split("\t") == ["part", "status", "seconds", "detail"]
    assert [line.split("\t") for line in lines[1:]] == [[p, "skip", "0", "no CUDA GPU"] for p in PARTS]
    assert "no CUDA GPU, every part skipped" in r.stdout
