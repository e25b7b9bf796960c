"""A job killed during its last writes (the tracking run's final records) trains nothing again when it is rerun:
every kind of run the harness drives (SFT, pre-training, PPO / MemOPD) lets its checkpoint go only after its export,
its run's final records and the process group's teardown (memopd.harness.job)."""
from __future__ import annotations

import json

import pytest

from memopd.cli import main
from memopd.tracking import init_store


def _kill_during_the_final_tracking_writes(monkeypatch):
    """The job ends (as SIGTERM would end it) while its run's last records are being sent."""
    import memopd.spool

    def killed(self, timeout_s):
        raise SystemExit(143)

    monkeypatch.setattr(memopd.spool.Sender, "finish", killed)


def _no_step(monkeypatch, target, name):
    monkeypatch.setattr(target, name, lambda *a, **kw: pytest.fail("the rerun trained a step"))


@pytest.fixture
def tracking(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    init_store(uri, "memopd")
    return json.dumps({"uri": uri, "experiment": "memopd"})


@pytest.mark.parametrize("stage", ["sft", "pretrain"])
def test_sft_and_pretraining_killed_in_their_last_writes_retrain_nothing(stage, tmp_path, tracking, monkeypatch):
    from test_sft import TINY_SFT, episodes, tiny

    import memopd.sft.trainer
    from memopd.models import train_tokenizer
    from memopd.records import save_episodes
    from memopd.sft.data import turn_examples

    init = tmp_path / "init"
    tiny().save_pretrained(init)
    train_tokenizer([f"word{i} thing{i % 7}" for i in range(200)], 300, init, min_frequency=2)
    save_episodes(tmp_path / "ex.parquet", turn_examples(episodes(), min_reward=0.5)[0])
    sft = {**TINY_SFT, "seq_len": 160, "student": {"steps": 3}, "pretrain": {"student": {"steps": 3}}}
    argv = ["sft", "train", "--cfg", json.dumps(sft), "--tracking", tracking, "--seed", "1", "--threads", "1",
            "--stage", stage, "--role", "student", "--examples", str(tmp_path / "ex.parquet"), "--init", str(init),
            "--out", str(tmp_path / "out")]
    _kill_during_the_final_tracking_writes(monkeypatch)
    with pytest.raises(SystemExit):
        main(argv)
    assert (tmp_path / "out/checkpoint/meta.json").exists()
    assert json.loads((tmp_path / "out/checkpoint/meta.json").read_text())["step"] == 3
    (tmp_path / "out/model.safetensors").unlink()  # the retry: Snakemake removed the failed job's outputs
    monkeypatch.undo()
    _no_step(monkeypatch, memopd.sft.trainer._Step, "__call__")
    main(argv)
    info = json.loads((tmp_path / "out/memopd_model.json").read_text())[stage]
    assert info["resumed_from"] == 3 and info["steps"] == 3
    assert (tmp_path / "out/model.safetensors").exists() and not (tmp_path / "out/checkpoint").exists()


def test_a_training_run_killed_in_its_last_writes_retrains_nothing(tmp_path, tracking, monkeypatch):
    import memopd.train.loop
    from agent_support import training_dir

    d = tmp_path
    cfg = training_dir(d, tasks=6, steps=2, batch_tasks=2, new_tokens=16)
    argv = ["train", "--cfg", json.dumps(cfg), "--method", "memopd", "--seed", "0", "--student", str(d / "student"),
            "--teacher", str(d / "teacher"), "--tasks", str(d / "q2_train.parquet"), "--index", str(d / "index"),
            "--out-dir", str(d / "run"), "--export", str(d / "export"), "--tracking", tracking]
    _kill_during_the_final_tracking_writes(monkeypatch)
    with pytest.raises(SystemExit):
        main(argv)
    assert json.loads((d / "run/checkpoint/meta.json").read_text())["step"] == 2
    monkeypatch.undo()
    _no_step(monkeypatch, memopd.train.loop, "ppo_update")
    main(argv)
    assert (d / "export/model.safetensors").exists() and not (d / "run/checkpoint").exists()
    assert [json.loads(x)["step"] for x in (d / "run/metrics.jsonl").read_text().splitlines()] == [0, 1]


def test_a_training_runs_steps_are_its_tracked_runs_steps(tmp_path, tracking):
    """Each step's metrics go to the run at the step metrics.jsonl gives it."""
    from mlflow.tracking import MlflowClient

    from agent_support import training_dir

    cfg = training_dir(tmp_path, tasks=4, steps=2, batch_tasks=2, new_tokens=12)
    main(["train", "--cfg", json.dumps(cfg), "--method", "ppo", "--seed", "0", "--student", str(tmp_path / "student"),
          "--tasks", str(tmp_path / "q2_train.parquet"), "--index", str(tmp_path / "index"), "--out-dir",
          str(tmp_path / "run"), "--tracking", tracking])
    steps = [json.loads(x)["step"] for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    uri = json.loads(tracking)["uri"]
    run_id = json.loads((tmp_path / "run/mlflow_run.json").read_text())["run_id"]
    assert [m.step for m in MlflowClient(uri).get_metric_history(run_id, "reward/f1")] == steps == [0, 1]
