"""Training checkpoints under a process group: every rank writes its part (torch.distributed.checkpoint) in the
background, and a run stopped after its checkpoint at step 1 resumes to exactly the uninterrupted run; one process
resumes it too (a site with fewer GPUs on the retry)."""
from __future__ import annotations

import json
import shutil
import socket

import pytest
import torch
from safetensors.torch import load_file

from test_train_loop import _run, setup  # noqa: F401  (fixture: student, teacher, tasks and index on disk)


def _worker(rank: int, port: int, setup, out, stop_after, record) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    history = _run(setup, out, method="memopd", stop_after=stop_after)
    if rank == 0:  # the steps this invocation trained
        record.write_text(json.dumps([m["step"] for m in history]))
    dist.destroy_process_group()


def _two_ranks(setup, out, record, stop_after=None) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(port, setup, out, stop_after, record), nprocs=2, start_method="spawn")


@pytest.mark.slow  # three runs of two gloo ranks in subprocesses and one of one process: ~90 s on 2 cores
def test_a_sharded_checkpoint_resumes_to_the_uninterrupted_run(setup, tmp_path):
    import torch.distributed.checkpoint as dcp

    d, cfg = setup
    cfg = {**cfg, "train": {**cfg["train"], "steps": 2, "checkpoint_every": 1, "shard": "fsdp"}}
    _two_ranks((d, cfg), tmp_path / "full", tmp_path / "full.json")
    _two_ranks((d, cfg), tmp_path / "cut", tmp_path / "cut.json", stop_after=1)
    ckpt = tmp_path / "cut/checkpoint"
    assert not (tmp_path / "cut/model").exists() and json.loads((ckpt / "meta.json").read_text())["step"] == 1
    # each rank wrote its own file, and each file holds pieces of the policy's weights (its FSDP shards)
    stored = dcp.FileSystemReader(str(ckpt)).read_metadata().storage_data
    files = {info.relative_path for key, info in stored.items() if key.fqn.startswith("policy.")}
    assert files == {"__0_0.distcp", "__1_0.distcp"}
    assert all((ckpt / f).stat().st_size > 0 for f in files)
    assert not (tmp_path / "cut/checkpoint.tmp").exists()  # published: the written directory swapped in
    shutil.copytree(tmp_path / "cut", tmp_path / "solo")
    solo = _run((d, cfg), tmp_path / "solo", method="memopd")  # one process, no process group, the same config
    _two_ranks((d, cfg), tmp_path / "cut", tmp_path / "resumed.json")
    steps = {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in ("full", "cut", "resumed")}
    assert steps == {"full": [0, 1], "cut": [0], "resumed": [1]}  # the resume trained step 1 only
    a, b = (load_file(tmp_path / f"{n}/model/model.safetensors") for n in ("full", "cut"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit for bit
    full, cut = ([json.loads(x) for x in (tmp_path / f"{n}/metrics.jsonl").read_text().splitlines()]
                 for n in ("full", "cut"))
    assert [m["step"] for m in cut] == [0, 1]
    for k in ("actor/loss", "opd/loss", "reward/f1", "actor/grad_norm"):
        assert [m[k] for m in full] == [m[k] for m in cut], k
    assert all(m["actor/grad_norm"] > 0 for m in full)  # the policy moves: step 2 depends on step 1's AdamW state
    # one process from the two ranks' checkpoint: step 1 alone, on the same episodes (sampling seeds by batch
    # position), the same update up to the order of the gradients' sum; AdamW moves a weight by <= ~lr per step
    assert [m["step"] for m in solo] == [1] and solo[0]["world_size"] == 1
    assert solo[0]["reward/f1"] == full[1]["reward/f1"]
    assert solo[0]["actor/loss"] == pytest.approx(full[1]["actor/loss"], rel=1e-5, abs=1e-7)
    c = load_file(tmp_path / "solo/model/model.safetensors")
    lr = cfg["train"]["lr_actor"]
    assert c.keys() == a.keys() and max((c[k] - a[k]).abs().max().item() for k in a) < 0.1 * lr
