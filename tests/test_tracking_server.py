"""Tracking against a real MLflow server on 127.0.0.1 that the tests start and kill: a server down mid-run, at the
start and through the end never holds a job longer than its stated bound (TrackingConfig: start_timeout_s +
end_timeout_s, plus one request's http_timeout_s), and `memopd tracking replay` sends what was kept into the same
run, rewriting the run reference the job wrote."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from memopd.tracking import TrackingConfig, init_store, run_ref, start_run

MLFLOW = Path(sys.executable).with_name("mlflow")


class Server:
    """`mlflow server` on 127.0.0.1 over one SQLite store, stopped and started again on the same port."""

    def __init__(self, root: Path):
        self.root, self.proc = root, None
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        log = open(self.root / "server.log", "a")
        self.proc = subprocess.Popen([str(MLFLOW), "server", "--backend-store-uri", f"sqlite:///{self.root}/mlflow.db",
                                      "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1",
                                      "--port", str(self.port), "--workers", "1"], stdout=log, stderr=log, env=env,
                                     start_new_session=True)
        for _ in range(240):
            try:
                if urllib.request.urlopen(f"{self.uri}/health", timeout=1).read() == b"OK":
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"mlflow server did not start: {(self.root / 'server.log').read_text()[-2000:]}")

    def stop(self) -> None:
        os.killpg(self.proc.pid, 9)  # the whole server, workers included: gone at once, as a crash
        self.proc.wait(30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("server"))
    s.start()
    init_store(s.uri, "memopd")
    yield s
    if s.proc.poll() is None:
        s.stop()


@pytest.fixture
def up(server):
    if server.proc.poll() is not None:
        server.start()
    return server


def _client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


SETTINGS = dict(http_timeout_s=2.0, start_timeout_s=3.0, end_timeout_s=4.0)
BOUND_S = SETTINGS["start_timeout_s"] + SETTINGS["end_timeout_s"] + SETTINGS["http_timeout_s"] + 3.0


def _replay(*spools):
    from memopd.cli import main

    main(["tracking", "replay", "--spool", *map(str, spools)])


def test_a_server_killed_mid_run_then_replayed_into_the_same_run(up, tmp_path):
    settings = TrackingConfig(uri=up.uri, experiment="memopd", spool=str(tmp_path / "spool"), **SETTINGS)
    t0 = time.monotonic()
    with start_run(up.uri, "memopd", "mid-run", {"lr": 1}, stage="train", model="m", seed=0, settings=settings) as run:
        for s in range(3):
            run.log_metrics({"loss": float(s)}, s)
        time.sleep(1.5)  # the sender takes them
        up.stop()
        steps_t0 = time.monotonic()
        for s in range(3, 6):
            run.log_metrics({"loss": float(s)}, s)
        assert time.monotonic() - steps_t0 < 0.5  # a dead server costs the steps nothing
        run.write_ref(tmp_path / "model")
    assert time.monotonic() - t0 < BOUND_S + 1.5
    run_id = run.run_id
    (spool,) = (tmp_path / "spool").glob("*.jsonl")
    up.start()
    c = _client(up.uri)
    assert c.get_run(run_id).info.status == "RUNNING"  # what the outage left: the end was never sent
    _replay(spool)
    r = c.get_run(run_id)
    assert r.info.status == "FINISHED" and r.data.params == {"lr": "1"}
    assert [(m.step, m.value) for m in c.get_metric_history(run_id, "loss")] == [(s, float(s)) for s in range(6)]
    assert run_ref(tmp_path / "model")["run_id"] == run_id and not list((tmp_path / "spool").iterdir())


def test_a_server_down_at_the_start_the_job_goes_on_and_replay_creates_its_run(up, tmp_path):
    settings = TrackingConfig(uri=up.uri, experiment="memopd", spool=str(tmp_path / "spool"), **SETTINGS)
    up.stop()
    t0 = time.monotonic()
    with start_run(up.uri, "memopd", "offline", {}, stage="sft_train", model="student_sft", seed=1,
                   settings=settings) as run:
        run.log_metrics({"train_loss": 2.0}, 1)
        run.log_dict({"steps": 1}, "summary.json")
        run.write_ref(tmp_path / "model")
    assert time.monotonic() - t0 < BOUND_S
    ref = run_ref(tmp_path / "model")
    assert ref["run_id"] is None and Path(ref["pending_spool"]).exists()
    up.start()
    _replay(tmp_path / "spool")  # a directory of spools
    ref = run_ref(tmp_path / "model")  # rewritten: the run that now holds the metrics
    c = _client(up.uri)
    r = c.get_run(ref["run_id"])
    assert r.info.run_name == "offline" and r.info.status == "FINISHED" and r.data.metrics == {"train_loss": 2.0}
    assert sorted(a.path for a in c.list_artifacts(ref["run_id"])) == ["config.json", "summary.json"]


def test_an_sft_job_with_the_server_down_through_its_end(up, tmp_path):
    """The real job: `sft train` with the server gone before it starts and still gone at its end finishes within
    its bound; its model's run record names the spool, and after the replay the run that holds its metrics."""
    from test_sft import TINY_SFT, episodes, tiny

    from memopd.models import train_tokenizer
    from memopd.records import save_episodes
    from memopd.sft.data import turn_examples

    init = tmp_path / "init"
    tiny().save_pretrained(init)
    train_tokenizer([f"word{i} thing{i % 7}" for i in range(200)], 300, init, min_frequency=2)
    save_episodes(tmp_path / "ex.parquet", turn_examples(episodes(), min_reward=0.5)[0])
    tracking = json.dumps({"uri": up.uri, "experiment": "memopd", "spool": str(tmp_path / "spool"), **SETTINGS})
    up.stop()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}

    def job(out: str, *extra: str) -> tuple[subprocess.CompletedProcess, float]:
        """The job's run and its seconds outside training (start-up, tracking, export)."""
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "memopd.cli", "sft", "train", "--cfg",
                            json.dumps({**TINY_SFT, "seq_len": 160}), *extra, "--seed", "1", "--threads", "1", "--role",
                            "student", "--examples", str(tmp_path / "ex.parquet"), "--init", str(init), "--out",
                            str(tmp_path / out)], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        train_s = json.loads((tmp_path / out / "memopd_model.json").read_text())["sft"]["train_seconds"]
        return r, time.monotonic() - t0 - train_s

    _, untracked = job("untracked")  # the same job without tracking, beside it: the machine's start-up today
    r, took = job("sft", "--tracking", tracking)
    assert took - untracked < BOUND_S + 5, (took, untracked)
    assert "not taken by" in r.stdout and "memopd tracking replay --spool" in r.stdout
    assert run_ref(tmp_path / "sft")["run_id"] is None
    up.start()
    _replay(tmp_path / "spool")
    ref = run_ref(tmp_path / "sft")
    c = _client(up.uri)
    assert c.get_run(ref["run_id"]).info.status == "FINISHED"
    assert [m.step for m in c.get_metric_history(ref["run_id"], "train_loss")] == [1, 2]
