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


def _fake_bin(tmp_path, smi: str) -> Path:
    """A folder with a fake nvidia-smi running `smi` (a shell body), to put first on PATH."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "nvidia-smi").write_text(f"#!/bin/sh\n{smi}\n")
    (fake / "nvidia-smi").chmod(0o755)
    return fake


def test_an_output_folder_or_summary_that_cannot_be_written_fails_the_check(tmp_path):
    (tmp_path / "a_file").write_text("")
    r = _check(tmp_path, PYTHON=sys.executable, GPU_CHECK_OUT=str(tmp_path / "a_file/out"))
    assert r.returncode == 1 and "gpu check: FAIL: cannot create the output folder" in r.stdout, r.stdout + r.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full/summary.tsv").symlink_to("/dev/full")  # every write fails: a full disk
    r = _check(tmp_path, PYTHON=sys.executable, GPU_CHECK_OUT=str(tmp_path / "full"))
    assert r.returncode == 1 and "gpu check: FAIL: cannot write" in r.stdout, r.stdout + r.stderr


def test_a_failing_nvidia_smi_is_a_failure_not_a_machine_without_a_gpu(tmp_path):
    fake = _fake_bin(tmp_path, 'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver." >&2'
                               "\nexit 9")
    r = _check(tmp_path, PYTHON=sys.executable, PATH=f"{fake}:{os.environ['PATH']}")
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1].startswith("gpu check: FAIL: nvidia-smi -L exits 9 (NVIDIA-SMI has failed")
    row = (tmp_path / "out/summary.tsv").read_text().splitlines()[1].split("\t")
    assert row[:2] == ["nvidia_smi", "fail"] and "exits 9" in row[3]


def _cuda_interpreter(tmp_path, site: Path | None) -> Path:
    """An interpreter that says its torch sees CUDA (check.sh's probe) and otherwise runs this one, with `site`
    first on its path."""
    py = tmp_path / "python"
    path = f'PYTHONPATH="{site}:$PYTHONPATH" ' if site else ""
    py.write_text('#!/bin/sh\ncase "$*" in *"import torch; print"*) echo "torch 2.13.0, cuda true"; exit 0;; esac\n'
                  f'{path}exec {sys.executable} "$@"\n')
    py.chmod(0o755)
    return py


def test_an_installed_package_that_fails_to_import_fails_its_part_an_absent_one_skips(tmp_path):
    fake = _fake_bin(tmp_path, 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"')
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm/__init__.py").write_text('raise OSError("libcudart.so.12: cannot open shared object file")\n')
    env = {"PATH": f"{fake}:{os.environ['PATH']}", "GPU_CHECK_PARTS": "vllm_sleep_wake"}
    r = _check(tmp_path, PYTHON=str(_cuda_interpreter(tmp_path, site)), **env)
    assert r.returncode == 1, r.stdout + r.stderr
    row = (tmp_path / "out/summary.tsv").read_text().splitlines()[1].split("\t")
    assert row[:2] == ["vllm_sleep_wake", "fail"] and "libcudart" in row[3]
    assert "gpu check: FAIL: vllm_sleep_wake failed" in r.stdout
    # vllm not installed at all: a named, expected absence
    r = _check(tmp_path, PYTHON=str(_cuda_interpreter(tmp_path, None)), **env)
    assert r.returncode == 0, r.stdout + r.stderr
    row = (tmp_path / "out/summary.tsv").read_text().splitlines()[1].split("\t")
    assert row[:2] == ["vllm_sleep_wake", "skip"] and row[3] == "skip: vllm is not installed"
