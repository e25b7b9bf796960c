"""memopd.dist on two gloo ranks: the process group waits as long as the config says (rank 0 writing a checkpoint
while the others wait in a barrier must not abort them at torch's default of 10 minutes)."""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp


def _rank(rank: int, port: int, minutes: float, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from memopd.dist import setup_distributed

    setup_distributed(minutes)
    backend = tdist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    with open(f"{out}.{rank}", "w") as f:
        f.write(str(backend.options._timeout.total_seconds()))
    tdist.barrier()
    tdist.destroy_process_group()


def test_the_process_group_timeout_comes_from_the_config(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, 7.5, str(tmp_path / "timeout")), nprocs=2, join=True)
    assert [float((tmp_path / f"timeout.{r}").read_text()) for r in (0, 1)] == [450.0, 450.0]


def test_the_default_timeout_is_the_schemas():
    import yaml

    from memopd.dist import TIMEOUT_MIN

    schema = yaml.safe_load(open(os.path.join(os.path.dirname(__file__), "../workflow/schemas/config.schema.yaml")))
    sections = schema["properties"]
    assert sections["train"]["properties"]["dist_timeout_min"]["default"] == TIMEOUT_MIN
    assert sections["sft"]["properties"]["dist_timeout_min"]["default"] == TIMEOUT_MIN


def test_each_rank_of_a_node_takes_its_share_of_the_jobs_threads(monkeypatch):
    from memopd.dist import rank_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
        rank_threads(32)
        assert torch.get_num_threads() == 8
        rank_threads(2)
        assert torch.get_num_threads() == 1
        monkeypatch.delenv("LOCAL_WORLD_SIZE")
        rank_threads(2)
        assert torch.get_num_threads() == 2
        rank_threads(0)  # 0: left as it is
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_faiss_takes_the_ranks_share_of_threads_too():
    """faiss-cpu's OpenMP pool is its own when faiss loads first (torch.set_num_threads does not reach it): a rank
    would search a 64.6 GB index with all of the node's cores."""
    import os
    import subprocess
    import sys

    code = ("import faiss, torch\nfrom memopd.dist import rank_threads\nrank_threads(32)\n"
            "print(torch.get_num_threads(), faiss.omp_get_max_threads())")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "LOCAL_WORLD_SIZE": "4"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["8", "8"]


def test_every_step_runs_with_expandable_segments_unless_the_site_sets_otherwise():
    import os
    import subprocess
    import sys

    code = "import os, memopd.cli; print(os.environ['PYTORCH_CUDA_ALLOC_CONF'])"
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "expandable_segments:True"
    env["PYTORCH_CUDA_ALLOC_CONF"] = "max_split_size_mb:512"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "max_split_size_mb:512"


def test_memopd_device_cpu_keeps_a_process_off_a_visible_gpu(monkeypatch):
    """Where CUDA is visible, setup_distributed takes the rank's GPU (NCCL) unless MEMOPD_DEVICE=cpu, which the
    CPU tests set so that their gloo ranks stay on the CPU of a GPU node. CUDA is faked visible here."""
    from memopd import dist

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("MEMOPD_DEVICE", "cpu")
    assert dist.setup_distributed() == torch.device("cpu") and chosen == []
    monkeypatch.delenv("MEMOPD_DEVICE")
    assert dist.setup_distributed() == torch.device("cuda", 0) and chosen == [0]


LISTENER = """
import os
import torch.distributed as tdist
from memopd.dist import one_process_group

def listening():
    inodes = {os.readlink(f"/proc/self/fd/{fd}")[8:-1] for fd in os.listdir("/proc/self/fd")
              if os.path.exists(f"/proc/self/fd/{fd}") and os.readlink(f"/proc/self/fd/{fd}").startswith("socket:[")}
    out = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(name).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN, one of this process's sockets
                out.append(f[1].split(":")[0])
    return out

one_process_group("gloo", 1)
print(listening())
tdist.destroy_process_group()
"""


def test_a_one_process_group_listens_on_no_network_interface():
    """Its addresses in /proc/net/tcp(6): loopback only (0100007F = 127.0.0.1), never the wildcard address."""
    import ast
    import subprocess
    import sys

    if not os.path.exists("/proc/net/tcp"):
        import pytest

        pytest.skip("no /proc/net/tcp here")
    r = subprocess.run([sys.executable, "-c", LISTENER], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")})
    assert r.returncode == 0, r.stderr
    addresses = ast.literal_eval(r.stdout.strip().splitlines()[-1])
    assert all(a == "0100007F" for a in addresses), addresses
