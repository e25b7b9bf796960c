"""The run harness every trainer uses (memopd.harness): RNG state, identity checks, the swap of a checkpoint
directory and the cadence of checkpoints, on a model small enough to compare tensors exactly."""
from __future__ import annotations

import json
import random

import pytest
import torch

from memopd.harness import Harness, Part, ResumeMismatch


def _harness(path, identity=None, **kw) -> Harness:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return Harness(path, identity or {"run": "a"}, kw.pop("total", 4), kw.pop("every", 2), "test",
                   parts=[Part("model", model, "optimizer", opt)], progress=False, **kw)


def _step(h: Harness) -> None:
    model, opt = h.parts[0].model, h.parts[0].optimizer
    opt.zero_grad()
    model(torch.rand(5, 3)).pow(2).sum().backward()
    opt.step()


def test_a_resume_restores_weights_optimizer_and_every_random_generator(tmp_path):
    h = _harness(tmp_path / "ck")
    _step(h)
    random.seed(7)
    random.gauss(0, 1)  # leaves a cached second normal in the generator's state
    torch.manual_seed(8)
    h.save(1)
    expect = (random.random(), random.gauss(0, 1), torch.rand(4))
    _step(h)
    weights = {k: v.clone() for k, v in h.parts[0].model.state_dict().items()}

    random.seed(99)  # another process's generators and a fresh model
    torch.manual_seed(99)
    back = _harness(tmp_path / "ck")
    assert back.resume(back.find()) == 1
    got = (random.random(), random.gauss(0, 1), torch.rand(4))
    assert got[:2] == expect[:2] and torch.equal(got[2], expect[2])
    _step(back)  # the step after the checkpoint again, from the restored weights, AdamW state and generator
    for k, v in back.parts[0].model.state_dict().items():
        assert torch.equal(v, weights[k]), k


def test_another_runs_checkpoint_is_refused_naming_the_change_or_replaced(tmp_path):
    h = _harness(tmp_path / "ck", {"config": {"lr": 0.1}, "seed": 1})
    h.save(2)
    other = _harness(tmp_path / "ck", {"config": {"lr": 0.2}, "seed": 1})
    with pytest.raises(ResumeMismatch, match=r"config\.lr: 0\.1 -> 0\.2"):
        other.find()
    assert _harness(tmp_path / "ck", {"config": {"lr": 0.2}, "seed": 1}, replace_other=True).find() is None
    assert _harness(tmp_path / "ck", {"config": {"lr": 0.1}, "seed": 1}).find()["step"] == 2


def test_a_kill_between_the_two_renames_leaves_the_previous_checkpoint(tmp_path):
    h = _harness(tmp_path / "ck")
    h.metrics = ["{\"step\": 0}", "{\"step\": 1}", "{\"step\": 2}"]
    h.save(2)
    (tmp_path / "ck").rename(tmp_path / "ck.old")  # what the swap leaves if killed after its first rename
    found = _harness(tmp_path / "ck").find()
    assert found["step"] == 2 and found["metrics"] == h.metrics[:2]  # the steps before the checkpoint only


def test_the_loop_checkpoints_at_its_cadence_and_at_the_last_step(tmp_path):
    h = _harness(tmp_path / "ck", total=5, every=2)
    saved = []
    h.save = lambda step: saved.append(step)
    assert h.loop(0, lambda i: "") == 5 and saved == [2, 4, 5]
    saved.clear()
    assert h.loop(1, lambda i: "", stop_after=2) == 3 and saved == [2]
    stored = _harness(tmp_path / "real", total=3, every=2)
    stored.extra = {"train_seconds": 1.5}
    stored.loop(0, lambda i: _step(stored) or "")
    meta = json.loads((tmp_path / "real/meta.json").read_text())
    assert meta["step"] == 3 and meta["train_seconds"] == 1.5 and meta["identity"] == {"run": "a"}
