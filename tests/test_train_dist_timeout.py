"""The training run opens its process group with the config's train.dist_timeout_min: two gloo ranks run train_run
for one step (the group not opened beforehand), and rank 0 reads the group's timeout while the run is inside it."""
from __future__ import annotations

import json
import socket

import pytest
import torch

from test_train_loop import _run, setup  # noqa: F401  (fixture: student, teacher, tasks and index on disk)


def _worker(rank: int, port: int, setup, out) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)

    def tracker(metrics, step):  # rank 0, after a step: the group train_run opened is the default one
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        (out / "timeout.json").write_text(json.dumps({"step": step, "seconds": backend.options._timeout.total_seconds()}))

    _run(setup, out / "run", method="ppo", stop_after=1, tracker=tracker)
    dist.destroy_process_group()


@pytest.mark.slow  # two gloo ranks in subprocesses: ~10-20 s
def test_train_run_opens_its_process_group_with_the_configs_timeout(setup, tmp_path):
    import torch.multiprocessing as mp

    d, cfg = setup
    cfg = {**cfg, "train": {**cfg["train"], "dist_timeout_min": 7.5}}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(port, (d, cfg), tmp_path), nprocs=2, start_method="spawn")
    assert json.loads((tmp_path / "timeout.json").read_text()) == {"step": 0, "seconds": 7.5 * 60}
