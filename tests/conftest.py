import fcntl
import os
import tempfile
from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA: skip them (with the reason) on CPU machines."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs when a GPU machine is available)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def one_worker_at_a_time(request):
    """Under the README's `pytest -n 2 --dist loadfile` (pytest-xdist) a file's tests share a worker (its module
    fixtures are built once); `gpu` tests (one GPU) and `slurm` tests (one test cluster) of different files
    take turns through a lock file of the run. (xdist's loadgroup would group them, but its groups do not
    reach pytest 9.2's node ids.)"""
    kind = next((k for k in ("gpu", "slurm") if k in request.node.keywords), None)
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if kind is None or run is None:
        yield
        return
    with open(Path(tempfile.gettempdir()) / f"memopd-tests-{run}-{kind}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(autouse=True)
def cpu_unless_gpu_marked(request, monkeypatch):
    """Tests not marked `gpu` run on the CPU even where CUDA is visible (their multi-rank ones use gloo, as
    their expected figures assume): MEMOPD_DEVICE=cpu, inherited by the processes they spawn."""
    if "gpu" not in request.node.keywords:
        monkeypatch.setenv("MEMOPD_DEVICE", "cpu")
    yield


@pytest.fixture(scope="session")
def tiny_lm():
    """A random-init tiny Qwen2 (the Qwen2.5 architecture) in fp32: exactness needs no training."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=False, use_sliding_window=False)
    return Qwen2ForCausalLM(cfg).eval()
