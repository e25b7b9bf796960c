"""tests/gpu/check.sh without a GPU: it exits 0 and its summary names every part as skipped."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARTS = ["gpu_tests", "fsdp_one_rank", "flex_recompile", "vllm_sleep_wake", "rce_bf16", "bench_packing"]


def _check(tmp_path, **env):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "GPU_CHECK_OUT": str(tmp_path / "out"), **env}
    return subprocess.run(["bash", str(REPO / "tests/gpu/check.sh")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def test_check_script_skips_every_part_without_a_gpu_saying_why(tmp_path):
    r = _check(tmp_path, PYTHON=sys.executable)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = (tmp_path / "out/summary.tsv").read_text().splitlines()
    assert lines[0].split("\t") == ["part", "status", "seconds", "detail"]
    rows = [line.split("\t") for line in lines[1:]]
    assert [r_[:3] for r_ in rows] == [[p, "skip", "0"] for p in PARTS]
    assert all(r_[3].startswith("skip: no CUDA GPU (nvidia-smi: none; ") and "cuda false" in r_[3] for r_ in rows)
    assert "every part skipped" in r.stdout


def test_a_gpu_that_no_interpreter_can_use_fails_the_check(tmp_path):
    """nvidia-smi sees a GPU, the interpreter's torch is a CPU build (the venv of this machine, carried to a GPU
    machine): the check fails and names the cause, where it used to skip every part and exit 0."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text('#!/bin/sh\necho "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n')
    (fake / "nvidia-smi").chmod(0o755)
    r = _check(tmp_path, PYTHON=sys.executable, PATH=f"{fake}:{os.environ['PATH']}")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "nvidia-smi sees GPU 0: NVIDIA H100" in r.stdout and "cuda false" in r.stdout
    assert (tmp_path / "out/summary.tsv").read_text().splitlines()[1].split("\t")[:2] == ["interpreter", "fail"]


def test_the_one_rank_fsdp_check_passes_on_gloo():
    import socket

    with socket.socket() as s:  # a free port for its process group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, str(REPO / "tests/gpu/fsdp_one_rank.py")], cwd=REPO, capture_output=True,
                       text=True, timeout=300, check=False, env={**os.environ, "CUDA_VISIBLE_DEVICES": "",
                                                                 "MASTER_PORT": str(port)})
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert [x.split(":")[0] for x in lines if x.startswith(("ok", "FAIL"))] == [
        "ok   fp32 sharded = unsharded", "ok   bf16 mixed precision", "ok   async sharded save and load"]
    assert lines[-1].startswith("pass: FSDP2 on one rank (gloo, cpu)")
