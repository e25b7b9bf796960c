"""Process-group plumbing of the trainers: torchrun's environment, the process group, and the collectives the
updates need (small Python objects, gradient sums, a global mean and std).

Without an initialised process group every collective is the single-process identity, so a trainer runs the
same code alone or under torchrun (WORLD_SIZE > 1).
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as tdist


def dist_info() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment (1 process without it)."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


# Minutes a collective may wait (config `train.dist_timeout_min`, `sft.dist_timeout_min`). In SFT rank 0 writes a
# whole checkpoint while the others wait in a barrier: ~92 GB for the 7B teacher at paper scale, 10 minutes at
# ~150 MB/s; torch's own default of 10 minutes would abort every rank on slower storage. (Training checkpoints
# are sharded and written in the background: train/loop.py.)
TIMEOUT_MIN = 60


def setup_distributed(timeout_min: float = TIMEOUT_MIN) -> torch.device:
    """Initialise the process group under torchrun (nccl on GPUs, gloo on CPUs) and return this rank's device;
    a collective that waits longer than `timeout_min` minutes aborts the job. MEMOPD_DEVICE=cpu keeps a process
    on the CPU (gloo) where CUDA is visible: CPU runs and tests on a GPU node."""
    _, world, local = dist_info()
    if torch.cuda.is_available() and os.environ.get("MEMOPD_DEVICE", "") != "cpu":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if world > 1 and not tdist.is_initialized():
        tdist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(minutes=timeout_min))
    return device


def one_process_group(backend: str, timeout_min: float = TIMEOUT_MIN) -> None:
    """A process group of this process alone (a one-rank FSDP run) that listens on no network interface: its store
    is in-process (torch's env:// store would listen on every interface at MASTER_PORT) and gloo's own socket is
    put on the loopback device."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    tdist.init_process_group(backend, store=tdist.HashStore(), rank=0, world_size=1,
                             timeout=timedelta(minutes=timeout_min))


def rank_threads(threads: int | None) -> None:
    """Give this rank its share of the job's `threads` CPUs (0 or None: torch's default). Snakemake exports
    OMP_NUM_THREADS = the job's threads and torchrun keeps it, so without this every rank of a node would run
    that many threads on the same CPUs (torch's and faiss's pools: 4 ranks x 32 threads over a 64.6 GB index)."""
    if threads:
        n = max(1, threads // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        torch.set_num_threads(n)
        try:  # faiss-cpu has its own OpenMP pool, which torch's setting does not reach
            import faiss
        except ImportError:
            return
        faiss.omp_set_num_threads(n)


def world_size() -> int:
    """Ranks of the initialised process group (1 without one)."""
    return tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else 1


def gather(obj) -> list:
    """Every rank's `obj`, in rank order ([obj] in a single process). Small Python objects only."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    tdist.all_gather_object(out, obj)
    return out


def allreduce_grads(params) -> None:
    """Sum the gradients of `params` over ranks, in place. A rank that held none of a minibatch's
    episodes contributes zeros (a None gradient would make AdamW skip the parameter there)."""
    if world_size() == 1:
        return
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for w in [tdist.all_reduce(p.grad, async_op=True) for p in params]:
        w.wait()


def global_mean_std(x: torch.Tensor) -> tuple[float, float]:
    """Mean and unbiased std of the concatenation of every rank's (N_r,) `x` (two passes, float64); the std
    is at least 1e-6 (1.0 for a single element)."""
    x = x.detach().double().cpu()
    parts = gather((x.numel(), x.sum().item()))
    n = sum(k for k, _ in parts)
    mean = sum(t for _, t in parts) / max(n, 1)
    sq = sum(gather(((x - mean) ** 2).sum().item()))
    std = (sq / (n - 1)) ** 0.5 if n > 1 else 1.0
    return mean, max(std, 1e-6)
