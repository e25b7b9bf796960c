"""MLflow tracking: every training and evaluation job is one MLflow run.

A run records params = the flattened step config, metrics = loss / lr curves and evaluation scores
(by step), artifacts = the config and the step's stats, tags = stage, model, method, seed, benchmark,
git commit, and its input datasets (`Run.log_input`: name, digest, source, schema, row count).

How the UI shows it. The experiment is tagged `mlflow.experimentKind = custom_model_development`
(`init_store`): model training (runs table, metric columns, charts), not a GenAI app (traces,
evaluations). MLflow 3.17.2's UI does not read that tag to pick its view: it opens experiments on its
GenAI view unless its "Model training" switch is set (kept in the browser) or the URL asks for it
(`#/experiments/ID/runs?workflowType=machine_learning`); the experiment's note says so. A job that trains a model
writes its run's id into the model directory (`Run.write_ref`, file `mlflow_run.json`); a later job
that evaluates that model, in another process, reads it (`run_ref`) and becomes a child run
(`mlflow.parentRunId`), with the parent's method and seed as its tags. Evaluation scores are logged
as `eval/<name>` (eval/f1, eval/em, eval/invalid_rate, ...), the same names in every evaluation run.

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
# A write during a run: any error is retried for ~1 minute (0.5 s ... 30 s: a tracking server restarting), then
# reported and skipped, never fatal: the run's metrics stay in its metrics.jsonl (`memopd tracking replay`)
CALL_TRIES, CALL_FIRST_S, CALL_CAP_S = 8, 0.5, 30.0
# MLflow 3 UI (server/js): the experiment tag `mlflow.experimentKind` (genai_development |
# custom_model_development | ...) says the experiment is model training, not a GenAI app.
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
# The experiment's description, shown above its pages. MLflow 3.17's UI (3.17.2 checked) picks the view from
# its own GenAI / Model training switch (browser storage, default GenAI, or ?workflowType= in the URL),
# not from the tag above: the note says how to get to the runs.
EXPERIMENT_NOTE = ("MemOPD pipeline runs. Open the **Model training** view (switch at the top left, or add "
                   "`?workflowType=machine_learning` to the URL), then Runs. Training runs (stage train, one per "
                   "method x seed) and SFT runs hold their evaluations as child runs; group by the tag `method`; "
                   "evaluation scores are eval/f1, eval/em, eval/invalid_rate in every evaluation run.")
RUN_FILE = "mlflow_run.json"  # written into a model / run directory by the job that tracked its training


LOOPBACK = ("127.0.0.1", "localhost", "::1", "0.0.0.0")


def resolve_uri(configured: str = DEFAULT_URI, sqlite_in_slurm_jobs: bool = False) -> str:
    """MLFLOW_TRACKING_URI when it is set (unchanged), else the configured URI. Inside a SLURM job a server URI on
    the loopback address is refused: it names the compute node itself, where no server runs (a login-node
    server exported as http://127.0.0.1:5000 would receive nothing; docs/tracking.md "On a SLURM cluster").
    So is a SQLite store unless the config allows it (`tracking.sqlite_in_slurm_jobs`): many jobs on many
    nodes writing one SQLite file over NFS or Lustre lose runs to unreliable locking."""
    from urllib.parse import urlsplit

    uri = os.environ.get("MLFLOW_TRACKING_URI") or configured
    host = urlsplit(uri).hostname if uri.startswith(("http://", "https://")) else None
    if host in LOOPBACK and os.environ.get("SLURM_JOB_ID"):
        raise ValueError(f"tracking URI {uri} inside SLURM job {os.environ['SLURM_JOB_ID']} points at this compute "
                         "node, not at the login node's server: start `mlflow server --host $(hostname -f)` and "
                         "export MLFLOW_TRACKING_URI=http://<that host>:5000 before submitting "
                         "(docs/tracking.md \"On a SLURM cluster\")")
    if uri.startswith("sqlite:") and os.environ.get("SLURM_JOB_ID") and not sqlite_in_slurm_jobs:
        raise ValueError(f"tracking URI {uri} inside SLURM job {os.environ['SLURM_JOB_ID']}: concurrent jobs on a "
                         "shared file system cannot share a SQLite store; start `mlflow server` on the login node "
                         "and export MLFLOW_TRACKING_URI before submitting "
                         "(docs/tracking.md \"On a SLURM cluster\"), "
                         "or set tracking.sqlite_in_slurm_jobs: true if the store is on a local disk")
    return uri


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


def _retry(fn, *args, transient=("database is locked", "busy"), tries: int = _RETRIES, first_s: float = 0.05,
           cap_s: float = 5.0, **kwargs):
    """Call fn, retrying SQLite lock errors (or other `transient` messages; "" matches every error) with
    exponential back-off (first_s ... cap_s)."""
    for attempt in range(tries):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # MlflowException wraps sqlalchemy's OperationalError
            if attempt == tries - 1 or not any(s in str(e).lower() for s in transient):
                raise
            time.sleep(min(cap_s, first_s * 2 ** attempt))


def dataset_entity(path: str | Path, name: str | None = None):
    """An MLflow dataset for a parquet file: name (default: the file's stem), digest (sha256 of the
    file's bytes, 16 hex digits: the same file gives the same dataset in every run), source (its absolute
    path), schema (inferred from its first rows) and profile (rows, columns, bytes)."""
    import hashlib
    import warnings

    import mlflow
    import pyarrow.parquet as pq
    from mlflow.entities import Dataset

    path = Path(path).resolve()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()[:16]
    pf = pq.ParquetFile(path)
    head = next(pf.iter_batches(batch_size=32), None)
    head = head.to_pandas() if head is not None else pf.schema_arrow.empty_table().to_pandas()
    with warnings.catch_warnings():  # "source can be interpreted in multiple ways": both are the local file
        warnings.simplefilter("ignore")
        schema = mlflow.data.from_pandas(head, source=str(path), name=name or path.stem, digest=digest).to_dict()["schema"]
    profile = {"num_rows": pf.metadata.num_rows, "num_columns": len(pf.schema_arrow.names),
               "bytes": path.stat().st_size}
    return Dataset(name=name or path.stem, digest=digest, source_type="local", source=json.dumps({"uri": str(path)}),
                   schema=schema, profile=json.dumps(profile))


EVAL_NAMES = {"invalid_action_rate": "invalid_rate"}  # as the training runs' rollout/invalid_rate


def eval_metrics(out: dict, prefix: str = "eval/") -> dict[str, float]:
    """The numbers of an evaluation result as MLflow metrics under one naming in every run: eval/f1,
    eval/em, eval/invalid_rate, eval/calls_per_episode, ...; nested dicts as eval/<key>/<key>."""
    metrics = {}
    for k, v in out.items():
        if isinstance(v, dict):
            metrics.update(eval_metrics(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            metrics[prefix + EVAL_NAMES.get(k, k)] = float(v)
    return metrics


def run_ref(directory: str | Path | None) -> dict | None:
    """The run reference (`RUN_FILE`) that the job which trained the model in `directory` wrote, or None."""
    if not directory:
        return None
    path = Path(directory) / RUN_FILE
    return json.loads(path.read_text()) if path.exists() else None


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
    client.set_experiment_tag(exp_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)  # also on a store made before the tag
    if "mlflow.note.content" not in client.get_experiment(exp_id).tags:  # the experiment's description
        client.set_experiment_tag(exp_id, "mlflow.note.content", EXPERIMENT_NOTE)
    exp = client.get_experiment(exp_id)
    return {"tracking_uri": uri, "experiment": experiment, "experiment_id": exp_id,
            "artifact_location": exp.artifact_location,
            # where `mlflow ui` shows the runs (append to http://HOST:PORT/): the model-training view
            "ui_path": f"#/experiments/{exp_id}/runs?workflowType=machine_learning"}


class Run:
    """One MLflow run written through the client: metrics are buffered and flushed in batches."""

    def __init__(self, client, run_id: str, flush_every: int = 200, ref: dict | None = None):
        self.client, self.run_id, self.flush_every = client, run_id, flush_every
        self.ref = ref or {"run_id": run_id}  # what write_ref records
        self._metrics = []
        self.failures: list[str] = []  # the writes given up on (each reported as it happened)

    def _call(self, what: str, fn, *args, transient=("",), **kwargs):
        """A write to the store, retried with back-off; given up on with a message, never raised: a tracking
        failure must not cost the run (its metrics stay in metrics.jsonl)."""
        try:
            return _retry(fn, *args, transient=transient, tries=CALL_TRIES, first_s=CALL_FIRST_S, cap_s=CALL_CAP_S,
                          **kwargs)
        except Exception as e:
            first = (str(e).splitlines() or [""])[0][:200]
            self.failures.append(f"{what}: {type(e).__name__}: {first}")
            print(f"tracking: {what} failed after {CALL_TRIES} tries ({type(e).__name__}: {first}); the run goes "
                  "on (`memopd tracking replay` records a run's metrics.jsonl later)", flush=True)
            return None

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
            self._call("log params", self.client.log_batch, self.run_id, params=items[i : i + 100])

    def set_tags(self, tags: dict) -> None:
        from mlflow.entities import RunTag

        self._call("set tags", self.client.log_batch, self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_dict(self, obj: dict, name: str) -> None:
        """An artifact `name` (.json or .yaml) holding obj."""
        self._call(f"log {name}", self.client.log_dict, self.run_id, obj, name)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._call(f"log artifact {Path(path).name}", self.client.log_artifact, self.run_id, str(path), artifact_path)

    def log_input(self, path: str | Path, context: str, name: str | None = None) -> None:
        """The parquet file `path` as an input dataset of this run (`context`: train, eval, ...)."""
        from mlflow.entities import DatasetInput, InputTag

        inp = DatasetInput(dataset_entity(path, name), tags=[InputTag("mlflow.data.context", context)])
        # two jobs logging the same new dataset at once: the second insert fails once, then finds it
        self._call(f"log input {Path(path).name}", self.client.log_inputs, self.run_id, datasets=[inp])

    def write_ref(self, *directories: str | Path) -> None:
        """Record this run in `directories` (file RUN_FILE): a job that later evaluates the model saved
        there nests its runs under this one (`run_ref`, start_run's parent)."""
        for d in directories:
            Path(d).mkdir(parents=True, exist_ok=True)
            tmp = Path(d) / (RUN_FILE + ".tmp")
            tmp.write_text(json.dumps(self.ref, indent=2) + "\n")
            tmp.replace(Path(d) / RUN_FILE)

    def flush(self) -> None:
        while self._metrics:
            batch, self._metrics = self._metrics[:1000], self._metrics[1000:]
            self._call(f"log {len(batch)} metrics", self.client.log_batch, self.run_id, metrics=batch)


@contextmanager
def start_run(uri: str, experiment: str, run_name: str, config: dict, stage: str, model: str, seed: int,
              tags: dict | None = None, flush_every: int = 200, parent: dict | None = None):
    """A run in an existing store/experiment (created by `init_store`): params = flatten(config),
    artifact config.json, tags stage/model/method/seed/git_commit and the run's source (+ `tags`, which
    win). `parent`: a `run_ref` (the run that trained the model this run evaluates): the run becomes its
    child and takes its method and seed tags, unless that run is not in this store (then the run stays
    top-level, and says so). Yields a `Run`; the run ends FINISHED, or FAILED (KILLED on Ctrl-C) when the
    body raises, after the buffered metrics are written."""
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
    all_tags = {"stage": stage, "model": model, "method": model, "seed": seed, "git_commit": commit,
                "mlflow.source.git.commit": commit.removesuffix("-dirty"), "mlflow.source.type": "LOCAL",
                "mlflow.source.name": f"memopd {stage}"}
    if parent:
        try:
            parent_run = _retry(client.get_run, parent["run_id"])
        except Exception as e:  # another store, or a deleted run
            print(f"tracking: parent run {parent['run_id']} not in {uri} ({type(e).__name__}); this run is top-level")
        else:
            if parent_run.info.experiment_id == exp.experiment_id:
                all_tags["mlflow.parentRunId"] = parent["run_id"]
                all_tags.update({k: parent[k] for k in ("method", "seed") if k in parent})
                all_tags["parent_run_name"] = parent_run.info.run_name
            else:
                print(f"tracking: parent run {parent['run_id']} is in another experiment; this run is top-level")
    all_tags.update(tags or {})
    info = _retry(client.create_run, exp.experiment_id, run_name=run_name,
                  tags={k: str(v) for k, v in all_tags.items()}).info
    run = Run(client, info.run_id, flush_every,
              ref={"run_id": info.run_id, "run_name": run_name, "experiment_id": exp.experiment_id,
                   "tracking_uri": uri, "stage": stage, "model": model, "method": all_tags["method"],
                   "seed": all_tags["seed"]})
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
        run.flush()
        run._call(f"end the run ({status})", client.set_terminated, info.run_id, status)


class NullRun:
    """Stands in for a `Run` when a command runs without tracking (same methods, records nothing)."""

    def log_metrics(self, metrics: dict, step: int) -> None: ...
    def log_params(self, params: dict) -> None: ...
    def set_tags(self, tags: dict) -> None: ...
    def log_dict(self, obj: dict, name: str) -> None: ...
    def log_artifact(self, path, artifact_path=None) -> None: ...
    def log_input(self, path, context, name=None) -> None: ...
    def flush(self) -> None: ...

    def write_ref(self, *directories) -> None:
        """No run to refer to: remove a reference left by an earlier tracked job (it would nest a later
        evaluation under a run that did not train this model)."""
        for d in directories:
            (Path(d) / RUN_FILE).unlink(missing_ok=True)


@contextmanager
def tracked(tracking_json: str | None, run_name: str, config: dict, stage: str, model: str, seed: int,
            tags: dict | None = None, parent: dict | None = None):
    """A run when the step got `--tracking JSON` (the `tracking` config section), else a NullRun."""
    if not tracking_json:
        print("tracking: off (no --tracking given)")
        yield NullRun()
        return
    t = json.loads(tracking_json)
    uri = resolve_uri(t["uri"], t.get("sqlite_in_slurm_jobs", False))
    with start_run(uri, t["experiment"], run_name, config, stage=stage, model=model, seed=seed, tags=tags,
                   parent=parent) as run:
        print(f"tracking: run {run.run_id} in {uri} (experiment {t['experiment']})")
        yield run
