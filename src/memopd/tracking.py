"""MLflow tracking: every training and evaluation job is one MLflow run.

A run records params = the flattened step config, metrics = loss / lr curves and evaluation scores
(by step), artifacts = the config and the step's stats, tags = stage, model, seed, git commit.

Store. The default is a SQLite file under results/ (`sqlite:///results/mlflow.db`). MLflow migrates a
fresh SQLite store's schema when the first client opens it, and several processes doing that at once
break it ("table _alembic_tmp_latest_metrics already exists", measured with 8 jobs). So the store and
the experiment are created exactly once by `memopd tracking init` (`init_store`), which every
tracking job depends on, and `start_run` refuses to create a SQLite store itself. After that, SQLite
serialises the writers; a write that still meets "database is locked" is retried with back-off.
Metrics are buffered and written in batches (one transaction each) to keep the writes few.
`MLFLOW_TRACKING_URI` from the environment (e.g. an `mlflow server` on a cluster) is used unchanged.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

DEFAULT_URI = "sqlite:///results/mlflow.db"
_RETRIES = 12  # ~1 minute of back-off in all before a locked write is an error


def resolve_uri(configured: str = DEFAULT_URI) -> str:
    """MLFLOW_TRACKING_URI when it is set (unchanged), else the configured URI."""
    return os.environ.get("MLFLOW_TRACKING_URI") or configured


def sqlite_path(uri: str) -> Path | None:
    """The database file of a sqlite:/// URI (relative or absolute), None for other stores."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri[len("sqlite:///"):])


def flatten(cfg: dict, prefix: str = "") -> dict[str, str]:
    """{"a": {"b": 1}, "c": [1, 2]} -> {"a.b": "1", "c": "[1, 2]"} (MLflow params are strings)."""
    out = {}
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v if isinstance(v, str) else json.dumps(v)
    return out


def git_commit() -> str:
    """HEAD of the repository holding this code, with "-dirty" when the tree has changes."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def _retry(fn, *args, **kwargs):
    """Call fn, retrying SQLite lock errors with exponential back-off (0.05 s ... 5 s)."""
    for attempt in range(_RETRIES):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # MlflowException wraps sqlalchemy's OperationalError
            if attempt == _RETRIES - 1 or not any(s in str(e).lower() for s in ("database is locked", "busy")):
                raise
            time.sleep(min(5.0, 0.05 * 2 ** attempt))


def init_store(uri: str, experiment: str) -> dict:
    """Create the store (schema migration) and the experiment, once, before any parallel job.
    Idempotent. A SQLite store keeps its artifacts in `mlartifacts/` beside the database file."""
    from mlflow.tracking import MlflowClient

    path = sqlite_path(uri)
    artifacts = None
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        artifacts = (path.parent.resolve() / "mlartifacts" / experiment).as_uri()
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(experiment, artifact_location=artifacts)
    exp = client.get_experiment(exp_id)
    return {"tracking_uri": uri, "experiment": experiment, "experiment_id": exp_id,
            "artifact_location": exp.artifact_location}


class Run:
    """One MLflow run written through the client: metrics are buffered and flushed in batches."""

    def __init__(self, client, run_id: str, flush_every: int = 200):
        self.client, self.run_id, self.flush_every = client, run_id, flush_every
        self._metrics = []

    def log_metrics(self, metrics: dict, step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self._metrics += [Metric(k, float(v), ts, int(step)) for k, v in metrics.items()]
        if len(self._metrics) >= self.flush_every:
            self.flush()

    def log_params(self, params: dict) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            _retry(self.client.log_batch, self.run_id, params=items[i : i + 100])

    def set_tags(self, tags: dict) -> None:
        from mlflow.entities import RunTag

        _retry(self.client.log_batch, self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_dict(self, obj: dict, name: str) -> None:
        """An artifact `name` (.json or .yaml) holding obj."""
        _retry(self.client.log_dict, self.run_id, obj, name)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        _retry(self.client.log_artifact, self.run_id, str(path), artifact_path)

    def flush(self) -> None:
        while self._metrics:
            batch, self._metrics = self._metrics[:1000], self._metrics[1000:]
            _retry(self.client.log_batch, self.run_id, metrics=batch)


@contextmanager
def start_run(uri: str, experiment: str, run_name: str, config: dict, stage: str, model: str, seed: int,
              tags: dict | None = None, flush_every: int = 200):
    """A run in an existing store/experiment (created by `init_store`): params = flatten(config),
    artifact config.json, tags stage/model/seed/git_commit (+ `tags`). Yields a `Run`; the run ends
    FINISHED, or FAILED (KILLED on Ctrl-C) when the body raises, after the buffered metrics are written."""
    from mlflow.tracking import MlflowClient

    path = sqlite_path(uri)
    if path is not None and not path.exists():
        raise FileNotFoundError(f"tracking store {path} does not exist: run `memopd tracking init` first "
                                "(parallel jobs must not create a SQLite store themselves)")
    client = MlflowClient(tracking_uri=uri)
    exp = _retry(client.get_experiment_by_name, experiment)
    if exp is None:
        raise LookupError(f"experiment {experiment!r} not in {uri}: run `memopd tracking init` first")
    commit = git_commit()
    all_tags = {"stage": stage, "model": model, "seed": seed, "git_commit": commit,
                "mlflow.source.git.commit": commit.removesuffix("-dirty"), **(tags or {})}
    info = _retry(client.create_run, exp.experiment_id, run_name=run_name,
                  tags={k: str(v) for k, v in all_tags.items()}).info
    run = Run(client, info.run_id, flush_every)
    status = "FAILED"
    try:
        run.log_params(flatten(config))
        run.log_dict(config, "config.json")
        yield run
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        try:
            run.flush()
        finally:
            _retry(client.set_terminated, info.run_id, status)


class NullRun:
    """Stands in for a `Run` when a command runs without tracking (same methods, records nothing)."""

    def log_metrics(self, metrics: dict, step: int) -> None: ...
    def log_params(self, params: dict) -> None: ...
    def set_tags(self, tags: dict) -> None: ...
    def log_dict(self, obj: dict, name: str) -> None: ...
    def log_artifact(self, path, artifact_path=None) -> None: ...
    def flush(self) -> None: ...


@contextmanager
def tracked(tracking_json: str | None, run_name: str, config: dict, stage: str, model: str, seed: int):
    """A run when the step got `--tracking JSON` (the `tracking` config section), else a NullRun."""
    if not tracking_json:
        print("tracking: off (no --tracking given)")
        yield NullRun()
        return
    t = json.loads(tracking_json)
    uri = resolve_uri(t["uri"])
    with start_run(uri, t["experiment"], run_name, config, stage=stage, model=model, seed=seed) as run:
        print(f"tracking: run {run.run_id} in {uri} (experiment {t['experiment']})")
        yield run
