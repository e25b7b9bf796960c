"""MLflow tracking in a real SQLite store: a run's params/metrics/artifacts/tags, concurrent writers,
the store created once, the environment's tracking URI."""
import json
import multiprocessing as mp
from pathlib import Path

import pytest

from memopd.tracking import flatten, init_store, resolve_uri, start_run


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """Jobs spool their tracking records under ./results/tracking/spool (tracking.spool): here, a test's own."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One store for the module (creating one costs seconds): the URI and its directory."""
    d = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{d}/mlflow.db"
    init_store(uri, "memopd")
    return uri, d


def _client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _runs(uri, experiment):
    c = _client(uri)
    return c.search_runs([c.get_experiment_by_name(experiment).experiment_id], max_results=1000)


def test_flatten():
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": "x", "f": None, "g": {}}) == {
        "a.b": "1", "a.c.d": "[1, 2]", "e": "x", "f": "null", "g": "{}"}


def test_a_run_records_params_metrics_artifacts_and_tags(store, tmp_path):
    uri, d = store
    cfg = {"sft": {"lr": 1e-3, "betas": [0.9, 0.95], "student": {"steps": 3}}, "role": "student"}
    stats = tmp_path / "stats.json"
    stats.write_text('{"turn_examples": 9}')
    with start_run(uri, "memopd", "sft_student", cfg, stage="sft_train", model="student_sft", seed=7) as run:
        for step in range(1, 4):
            run.log_metrics({"train_loss": 5.0 - step, "lr": 1e-3 * step}, step)
        run.log_metrics({"heldout_target_loss": 1.5}, 3)
        run.log_artifact(stats)
        run_id = run.run_id
    c = _client(uri)
    r = c.get_run(run_id)
    assert r.info.status == "FINISHED"
    assert r.data.params == {"sft.lr": "0.001", "sft.betas": "[0.9, 0.95]", "sft.student.steps": "3", "role": "student"}
    assert [(m.step, m.value) for m in c.get_metric_history(run_id, "train_loss")] == [(1, 4.0), (2, 3.0), (3, 2.0)]
    assert r.data.metrics["heldout_target_loss"] == 1.5
    tags = r.data.tags
    assert tags["stage"] == "sft_train" and tags["model"] == "student_sft" and tags["seed"] == "7"
    assert len(tags["git_commit"]) >= 40 or tags["git_commit"] == "unknown"
    assert sorted(a.path for a in c.list_artifacts(run_id)) == ["config.json", "stats.json"]
    assert (d / "mlartifacts").is_dir()  # artifacts live beside the database


def test_the_experiment_opens_as_model_training_and_evaluations_nest_under_their_training_run(store, tmp_path):
    """The experiment kind tag (MLflow 3 UI: model-training view, not GenAI), and the parent link across
    processes: the training job writes its run id into the model directory, the evaluation job reads it."""
    import pandas as pd

    from memopd.tracking import EXPERIMENT_KIND, NullRun, eval_metrics, run_ref

    uri, _ = store
    c = _client(uri)
    exp = c.get_experiment_by_name("memopd")
    assert exp.tags["mlflow.experimentKind"] == EXPERIMENT_KIND == "custom_model_development"
    assert "group by" in exp.tags["mlflow.note.content"].lower()
    init_store(uri, "memopd")  # idempotent: same experiment, tag kept
    assert c.get_experiment_by_name("memopd").experiment_id == exp.experiment_id

    tasks = tmp_path / "q2_train.parquet"
    pd.DataFrame({"task_id": ["t0", "t1", "t2"], "questions": [["a?", "b?"]] * 3}).to_parquet(tasks)
    model = tmp_path / "memopd_seed3"
    with start_run(uri, "memopd", "train-memopd-seed3", {}, stage="train", model="memopd_seed3", seed=3,
                   tags={"method": "memopd", "benchmark": "q2_train"}) as run:
        run.log_input(tasks, "train")
        run.log_metrics({"reward/f1": 0.5}, 0)
        run.write_ref(model)
    train_id = run.run_id
    ref = run_ref(model)
    assert ref["run_id"] == train_id and (ref["method"], ref["seed"]) == ("memopd", 3)
    with start_run(uri, "memopd", "eval-memopd_seed3-q2_train", {}, stage="eval", model="memopd_seed3", seed=0,
                   tags={"benchmark": "q2_train"}, parent=ref) as ev:
        ev.log_input(tasks, "eval")
        ev.log_metrics(eval_metrics({"f1": 0.25, "em": 0.0, "invalid_action_rate": 0.1, "episodes": 3,
                                     "throughput": {"episodes_per_s": 2.0}, "model": "x"}), 0)
    r = c.get_run(ev.run_id)
    assert r.data.tags["mlflow.parentRunId"] == train_id and r.data.tags["parent_run_name"] == "train-memopd-seed3"
    assert (r.data.tags["method"], r.data.tags["seed"], r.data.tags["benchmark"]) == ("memopd", "3", "q2_train")
    assert r.data.tags["mlflow.source.name"] == "memopd eval"
    assert r.data.metrics == {"eval/f1": 0.25, "eval/em": 0.0, "eval/invalid_rate": 0.1, "eval/episodes": 3.0,
                              "eval/throughput/episodes_per_s": 2.0}
    d_train, d_eval = (c.get_run(i).inputs.dataset_inputs[0] for i in (train_id, ev.run_id))
    assert d_train.dataset.name == d_eval.dataset.name == "q2_train"
    assert d_train.dataset.digest == d_eval.dataset.digest and len(d_train.dataset.digest) == 16
    assert json.loads(d_train.dataset.source)["uri"] == str(tasks.resolve())
    assert json.loads(d_train.dataset.profile)["num_rows"] == 3 and "questions" in d_train.dataset.schema

    # a reference to a run of another store leaves the run top-level; an untracked job removes a stale one
    with start_run(uri, "memopd", "eval-orphan", {}, stage="eval", model="m", seed=0,
                   parent={"run_id": "0" * 32, "method": "x"}) as orphan:
        pass
    assert "mlflow.parentRunId" not in c.get_run(orphan.run_id).data.tags
    NullRun().write_ref(model)
    assert run_ref(model) is None


def test_a_failing_job_leaves_a_failed_run(store):
    uri, _ = store
    with pytest.raises(RuntimeError):
        with start_run(uri, "memopd", "boom", {}, stage="sft_eval", model="m", seed=0) as run:
            run.log_metrics({"x": 1.0}, 0)
            run_id = run.run_id
            raise RuntimeError("boom")
    r = _client(uri).get_run(run_id)
    assert r.info.status == "FAILED" and r.data.metrics["x"] == 1.0  # buffered metrics still written


def test_jobs_never_create_the_store_themselves(tmp_path):
    uri = f"sqlite:///{tmp_path}/absent.db"
    with pytest.raises(FileNotFoundError, match="tracking init"):
        with start_run(uri, "memopd", "r", {}, stage="s", model="m", seed=0):
            pass
    assert not (tmp_path / "absent.db").exists()


def test_the_environment_uri_is_used_unchanged(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert resolve_uri("sqlite:///results/mlflow.db") == "http://127.0.0.1:5999"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert resolve_uri("sqlite:///results/mlflow.db") == "sqlite:///results/mlflow.db"


@pytest.mark.parametrize("uri", ["http://127.0.0.1:5000", "http://localhost:5000/", "https://[::1]:8443"])
def test_a_loopback_server_is_refused_inside_a_slurm_job(monkeypatch, uri):
    """A compute job that inherits MLFLOW_TRACKING_URI=http://127.0.0.1:5000 from the login node would log to
    the compute node itself. Inside a SLURM job that is refused, naming the fix; outside one (a local run) and
    for a server on a reachable host it is used unchanged."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert resolve_uri() == uri
    monkeypatch.setenv("SLURM_JOB_ID", "17")
    with pytest.raises(ValueError, match="SLURM job 17 points at this compute node"):
        resolve_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://login01.cluster:5000")
    assert resolve_uri() == "http://login01.cluster:5000"


def test_a_sqlite_store_is_refused_inside_a_slurm_job_unless_allowed(monkeypatch):
    """Concurrent jobs on many nodes writing one SQLite file over a shared file system lose runs: inside a SLURM job
    a sqlite URI is refused, naming the fix, unless the config allows it; outside SLURM it is the default store."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert resolve_uri("sqlite:///results/mlflow.db") == "sqlite:///results/mlflow.db"
    monkeypatch.setenv("SLURM_JOB_ID", "17")
    with pytest.raises(ValueError, match="cannot share a SQLite store.*MLFLOW_TRACKING_URI"):
        resolve_uri("sqlite:///results/mlflow.db")
    assert resolve_uri("sqlite:///results/mlflow.db", sqlite_in_slurm_jobs=True) == "sqlite:///results/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://login01.cluster:5000")
    assert resolve_uri("sqlite:///results/mlflow.db") == "http://login01.cluster:5000"


def test_a_jobs_tracking_section_decides_whether_sqlite_is_allowed_in_slurm(store, monkeypatch):
    """What a job runs (`tracked` with the `tracking` section as --tracking JSON): inside SLURM the section's
    sqlite_in_slurm_jobs is what lets a SQLite store through; without it the job refuses before opening a run."""
    from memopd.tracking import tracked

    uri, _ = store
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "17")
    section = {"uri": uri, "experiment": "memopd"}
    with pytest.raises(ValueError, match="cannot share a SQLite store"):
        with tracked(json.dumps(section), "refused", {}, stage="test", model="m", seed=0):
            pass
    allowed = json.dumps({**section, "sqlite_in_slurm_jobs": True})
    with tracked(allowed, "allowed", {}, stage="test", model="m", seed=0) as run:
        run_id = run.run_id
    assert _client(uri).get_run(run_id).info.run_name == "allowed"


N_WRITERS, STEPS, PARAMS = 4, 150, 30


def _writer(uri, k, barrier, dataset):
    from memopd.tracking import start_run

    cfg = {f"p{i}": i * k for i in range(PARAMS)}
    barrier.wait()  # all four start together
    with start_run(uri, "concurrent", f"writer{k}", cfg, stage="test", model=f"w{k}", seed=k) as run:
        run.log_input(dataset, "train")  # the same new dataset from every writer at once
        for s in range(STEPS):
            run.log_metrics({"loss": k + s / 1000, "lr": float(s)}, s)
        run.log_dict({"writer": k}, "stats.json")


def test_four_concurrent_writers_lose_nothing(store, tmp_path):
    import pandas as pd

    uri, _ = store
    init_store(uri, "concurrent")  # once, before the parallel jobs (as `memopd tracking init` does)
    dataset = tmp_path / "q2_train.parquet"
    pd.DataFrame({"task_id": ["t0", "t1"]}).to_parquet(dataset)
    ctx = mp.get_context("spawn")  # fresh interpreters, like parallel Snakemake jobs
    barrier = ctx.Barrier(N_WRITERS)
    procs = [ctx.Process(target=_writer, args=(uri, k, barrier, str(dataset))) for k in range(N_WRITERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert [p.exitcode for p in procs] == [0] * N_WRITERS
    runs = _runs(uri, "concurrent")
    assert sorted(r.info.run_name for r in runs) == [f"writer{k}" for k in range(N_WRITERS)]
    c = _client(uri)
    for r in runs:
        k = int(r.info.run_name.removeprefix("writer"))
        assert r.info.status == "FINISHED"
        assert r.data.params == {f"p{i}": str(i * k) for i in range(PARAMS)}
        hist = c.get_metric_history(r.info.run_id, "loss")
        assert sorted((m.step, m.value) for m in hist) == [(s, k + s / 1000) for s in range(STEPS)]
        assert len(c.get_metric_history(r.info.run_id, "lr")) == STEPS
        assert sorted(a.path for a in c.list_artifacts(r.info.run_id)) == ["config.json", "stats.json"]
        assert [d.dataset.name for d in r.inputs.dataset_inputs] == ["q2_train"]


def test_sft_commands_end_to_end_are_tracked_runs(store, tmp_path, monkeypatch):
    """`memopd tracking init`, `sft examples`, `sft train`, `sft eval` through the
    real CLI (in process), recorded as MLflow runs in a real SQLite store."""
    import torch

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    threads = torch.get_num_threads()  # `--threads 1` sets torch's global thread count: restore it after
    try:
        _end_to_end(store, tmp_path)
    finally:
        torch.set_num_threads(threads)


def _end_to_end(store, tmp_path):
    import csv
    import json
    import random

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from memopd.cli import main
    from memopd.models import train_tokenizer
    from memopd.records import save_episodes
    from memopd.synthetic import random_episode

    uri, _ = store
    tracking = json.dumps({"uri": uri, "experiment": "e2e"})
    main(["tracking", "init", "--cfg", tracking, "--out", str(tmp_path / "store.json")])
    assert json.loads((tmp_path / "store.json").read_text())["experiment"] == "e2e"

    rng = random.Random(0)
    eps = [random_episode(rng, range(3, 300), "full_retention", 3, 10, (3, 12), (2, 8), task_id=f"t{i}") for i in range(24)]
    for i, e in enumerate(eps):
        e.reward = float(i % 4 != 0)
    save_episodes(tmp_path / "traj.parquet", eps)
    torch.manual_seed(0)
    init = tmp_path / "init"
    Qwen2ForCausalLM(Qwen2Config(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
                                 use_sliding_window=False)).save_pretrained(init)
    train_tokenizer(["a tiny corpus for a tokenizer"] * 10, 300, init, min_frequency=2)
    sft = {"min_reward": 0.5, "seq_len": 128, "grad_accum": 2, "lr": 3e-3, "min_lr_ratio": 0.1, "warmup_steps": 1,
           "weight_decay": 0.0, "betas": [0.9, 0.95], "adam_eps": 1e-8, "clip": 1.0, "eval_fraction": 0.2,
           "eval_every": 3, "checkpoint_every": 4, "precision": "fp32", "mode": "packed", "backend": "segmented",
           "log_every": 1, "student": {"steps": 6}, "teacher": {"epochs": 1}}
    common = ["--cfg", json.dumps(sft), "--tracking", tracking, "--seed", "3"]
    main(["sft", "examples", *common, "--teacher", "scripted", "--episodes", str(tmp_path / "traj.parquet"),
          "--out", str(tmp_path / "ex.parquet"), "--stats", str(tmp_path / "stats.json"),
          "--table", str(tmp_path / "sft_data_stats.csv")])
    with open(tmp_path / "sft_data_stats.csv") as f:
        assert list(csv.DictReader(f)) == [{"teacher": "scripted", "trajectories_generated": "24",
                                            "trajectories_kept": "18", "turn_examples": "54"}]
    out = tmp_path / "student_sft"
    main(["sft", "train", *common, "--threads", "1", "--role", "student", "--examples", str(tmp_path / "ex.parquet"),
          "--init", str(init), "--out", str(out)])
    info = json.loads((out / "memopd_model.json").read_text())
    assert info["sft"]["steps"] == 6 and info["sft"]["config"]["lr"] == 3e-3 and info["sft"]["heldout"]["examples"] > 0
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    assert not (out / "checkpoint").exists()  # removed once the model is written
    main(["sft", "eval", *common, "--threads", "1", "--role", "student", "--name", "student_sft", "--model", str(out),
          "--examples", str(tmp_path / "ex.parquet"), "--out", str(tmp_path / "eval.json")])
    ev = json.loads((tmp_path / "eval.json").read_text())
    assert abs(ev["heldout_target_loss"] - info["sft"]["heldout"]["target_loss"]) < 1e-5  # same held-out split

    # the same job killed after 5 steps (its checkpoint is from step 4), then rerun: it resumes and
    # writes the same weights as the uninterrupted job
    import memopd.sft.trainer as trainer

    real_train = trainer.train

    def killed_after_5(*args, **kwargs):
        real_train(*args, **kwargs, stop_after=5)
        raise RuntimeError("killed")

    resumed = tmp_path / "student_sft_resumed"
    argv = ["sft", "train", *common, "--threads", "1", "--role", "student", "--examples", str(tmp_path / "ex.parquet"),
            "--init", str(init), "--out", str(resumed)]
    trainer.train = killed_after_5
    try:
        with pytest.raises(RuntimeError, match="killed"):
            main(argv)
    finally:
        trainer.train = real_train
    assert json.loads((resumed / "checkpoint/meta.json").read_text())["step"] == 4
    main(argv)
    assert json.loads((resumed / "memopd_model.json").read_text())["sft"]["resumed_from"] == 4
    from safetensors.torch import load_file

    a, b = load_file(out / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    c = _client(uri)
    all_runs = _runs(uri, "e2e")
    train_runs = sorted((r for r in all_runs if r.data.tags["stage"] == "sft_train"), key=lambda r: r.info.start_time)
    assert [r.info.status for r in train_runs] == ["FINISHED", "FAILED", "FINISHED"]
    assert [m.step for m in c.get_metric_history(train_runs[2].info.run_id, "train_loss")] == [5, 6]
    runs = {r.data.tags["stage"]: r for r in all_runs if r.info.run_id not in [t.info.run_id for t in train_runs[1:]]}
    assert set(runs) == {"sft_examples", "sft_train", "sft_eval"}
    tr = runs["sft_train"]
    assert tr.info.status == "FINISHED" and tr.data.tags["model"] == "student_sft" and tr.data.tags["seed"] == "3"
    assert tr.data.params["sft.student.steps"] == "6" and tr.data.params["resolved.steps"] == "6"
    assert [m.step for m in c.get_metric_history(tr.info.run_id, "train_loss")] == [1, 2, 3, 4, 5, 6]
    assert [m.step for m in c.get_metric_history(tr.info.run_id, "heldout_target_loss")] == [3, 6]
    assert len(c.get_metric_history(tr.info.run_id, "lr")) == 6
    assert {a.path for a in c.list_artifacts(tr.info.run_id)} == {"config.json", "summary.json"}
    assert {a.path for a in c.list_artifacts(runs["sft_examples"].info.run_id)} == {"config.json", "stats.json"}
    assert runs["sft_examples"].data.metrics["turn_examples"] == 54
    assert runs["sft_eval"].data.metrics["eval/heldout_target_loss"] == pytest.approx(ev["heldout_target_loss"])
    # the SFT run wrote its id into the model directory; the evaluation of that model is its child run,
    # with its method; both show the examples file as an input dataset (same name and digest)
    assert json.loads((out / "mlflow_run.json").read_text())["run_id"] == tr.info.run_id
    ev_run = runs["sft_eval"]
    assert ev_run.data.tags["mlflow.parentRunId"] == tr.info.run_id and ev_run.data.tags["method"] == "sft"
    assert "mlflow.parentRunId" not in tr.data.tags and tr.data.tags["role"] == "student"
    ins = {s: [(d.dataset.name, d.dataset.digest, {t.key: t.value for t in d.tags}["mlflow.data.context"])
               for d in c.get_run(runs[s].info.run_id).inputs.dataset_inputs] for s in ("sft_train", "sft_eval")}
    assert ins["sft_train"][0][:2] == ins["sft_eval"][0][:2] and ins["sft_train"][0][0] == "sft/ex"
    assert (ins["sft_train"][0][2], ins["sft_eval"][0][2]) == ("train", "eval")
    assert json.loads(c.get_run(runs["sft_train"].info.run_id).inputs.dataset_inputs[0].dataset.profile)["num_rows"] == 54


def test_a_store_that_fails_mid_run_loses_nothing_and_never_holds_the_job(store, monkeypatch):
    """A store failing mid-run (a server restarting): the job's writes return at once, the sender retries in the
    background, and everything lands in order once the store is back."""
    from mlflow.tracking import MlflowClient

    uri, _ = store
    real, calls = MlflowClient.log_batch, []

    def flaky(self, *a, **kw):
        calls.append(1)
        if "metrics" in kw and len(calls) <= 4:
            raise ConnectionError("server restarting")
        return real(self, *a, **kw)

    import time

    with start_run(uri, "memopd", "flaky", {}, stage="train", model="m", seed=0) as run:
        monkeypatch.setattr(MlflowClient, "log_batch", flaky)
        t0 = time.monotonic()
        for s in range(3):
            run.log_metrics({"x": float(s)}, s)
        assert time.monotonic() - t0 < 0.5  # three steps' writes did not wait for the store
        run_id = run.run_id
    r = _client(uri).get_run(run_id)
    assert r.info.status == "FINISHED" and len(calls) > 4
    assert [(m.step, m.value) for m in _client(uri).get_metric_history(run_id, "x")] == [(0, 0.0), (1, 1.0), (2, 2.0)]
    assert not list(Path("results/tracking/spool").glob("*"))  # all sent: nothing left behind


def test_the_schema_states_the_tracking_defaults_the_code_declares():
    """Snakemake fills a missing key from the schema's `default`, a command from TrackingConfig: one value each."""
    from dataclasses import MISSING, fields

    import yaml

    from memopd.tracking import TrackingConfig

    schema = yaml.safe_load((Path(__file__).parents[1] / "workflow/schemas/config.schema.yaml").read_text())
    props = schema["properties"]["tracking"]["properties"]
    declared = {f.name: f.default for f in fields(TrackingConfig) if f.default is not MISSING}
    assert set(props) == {f.name for f in fields(TrackingConfig)}
    assert {k: props[k]["default"] for k in declared} == declared
    assert set(schema["properties"]["tracking"]["required"]) == {f.name for f in fields(TrackingConfig)} - set(declared)


def test_a_misspelt_tracking_key_is_named():
    from memopd.inputs import ConfigError
    from memopd.tracking import TrackingConfig

    with pytest.raises(ConfigError, match=r"unknown keys \['end_timeout'\]"):
        TrackingConfig.from_json('{"uri": "sqlite:///x.db", "experiment": "e", "end_timeout": 3}')
    with pytest.raises(ConfigError, match=r"lacks \['experiment'\]"):
        TrackingConfig.from_json('{"uri": "sqlite:///x.db"}')
