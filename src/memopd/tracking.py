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
serialises the writers.

Writes never wait for the store (memopd.spool): a job appends each write to its run's spool file, and a background
thread sends them in order, retrying what fails (a locked database, a server restarting or down), consecutive
metrics in one batch. A store down at the start, mid-run or at the end costs the job at most start_timeout_s +
end_timeout_s (TrackingConfig); what was not sent stays spooled and `memopd tracking replay` sends it into the
same run. `MLFLOW_TRACKING_URI` from the environment (e.g. an `mlflow server` on a cluster) is used unchanged.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path

from memopd.spool import RUN_FILE, Sender, Spool, write_ref_file

DEFAULT_URI = "sqlite:///results/mlflow.db"
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


@dataclass(frozen=True)
class TrackingConfig:
    """The `tracking` config section (every default declared here; workflow/schemas/config.schema.yaml documents
    the keys): where runs go, and how long a job ever waits for the store."""

    uri: str
    experiment: str
    sqlite_in_slurm_jobs: bool = False
    spool: str = "results/tracking/spool"  # what could not be sent yet, per run (memopd.spool)
    http_timeout_s: float = 10.0  # one HTTP request to a tracking server, at most (MLflow's own retries off)
    start_timeout_s: float = 10.0  # a job waits this long for its run to be created, then goes on offline
    end_timeout_s: float = 30.0  # and this long at its end for what is left to be sent; the rest stays spooled

    @classmethod
    def from_json(cls, text: str) -> "TrackingConfig":
        """--tracking JSON; a misspelt, unknown or missing key is a ConfigError naming it (one line, exit 2)."""
        from memopd.inputs import ConfigError

        d = json.loads(text)
        if unknown := set(d) - {f.name for f in fields(cls)}:
            raise ConfigError(f"config section 'tracking': unknown keys {sorted(unknown)}")
        if missing := [k for k in ("uri", "experiment") if k not in d]:
            raise ConfigError(f"config section 'tracking' lacks {missing}")
        return cls(**d)


def bounded_http(timeout_s: float) -> None:
    """MLflow's HTTP client inside a job: one try of at most `timeout_s` per request (by default it retries 7 times
    with back-off and waits 120 s a try: a dead server held one write for 2,031 s); the spool's sender retries."""
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(max(1, int(math.ceil(timeout_s))))


class Run:
    """One MLflow run as a job writes it: every write goes to the run's spool (memopd.spool) and a background
    sender takes it to the store, so no write waits for the store."""

    def __init__(self, spool: Spool, sender: Sender, ref: dict):
        self.spool, self.sender, self.ref = spool, sender, ref
        self._run_id = None

    @property
    def run_id(self) -> str | None:
        """The run's id in the store, None while it has not been created (the store down since the start)."""
        if self._run_id is None and self.spool.state_path.exists():
            self._run_id = self.spool.state().get("run_id")
        return self._run_id

    def _op(self, op: dict) -> None:
        self.spool.append(op)
        self.sender.wake.set()

    def log_metrics(self, metrics: dict, step: int) -> None:
        ts = int(time.time() * 1000)
        self._op({"op": "metrics", "items": [[k, float(v), ts, int(step)] for k, v in metrics.items()]})

    def log_params(self, params: dict) -> None:
        self._op({"op": "params", "params": {k: str(v) for k, v in params.items()}})

    def log_dict(self, obj: dict, name: str) -> None:
        """An artifact `name` (.json or .yaml) holding obj."""
        self._op({"op": "dict", "obj": json.loads(json.dumps(obj, default=str)), "name": name})

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._op({"op": "artifact", "path": str(self.spool.keep_file(path)), "artifact_path": artifact_path})

    def log_input(self, path: str | Path, context: str, name: str | None = None) -> None:
        """The parquet file `path` as an input dataset of this run (`context`: train, eval, ...)."""
        d = dataset_entity(path, name)
        self._op({"op": "input", "context": context, "dataset": {
            "name": d.name, "digest": d.digest, "source_type": d.source_type, "source": d.source, "schema": d.schema,
            "profile": d.profile}})

    def write_ref(self, *directories: str | Path) -> None:
        """Record this run in `directories` (file RUN_FILE): a job that later evaluates the model saved there nests
        its runs under this one (`run_ref`, start_run's parent). A run not created yet is named by its spool
        (`pending_spool`); its sender, or `memopd tracking replay`, writes the id once the run exists."""
        ref = {**self.ref, "run_id": self.run_id}
        if ref["run_id"] is None:
            ref["pending_spool"] = str(self.spool.path.resolve())
        for d in directories:
            write_ref_file(d, ref)
        self._op({"op": "refs", "dirs": [str(Path(d).resolve()) for d in directories]})

    def flush(self) -> None:
        """Nothing to do: every write is on disk when the call returns; the sender sends it."""


@contextmanager
def start_run(uri: str, experiment: str, run_name: str, config: dict, stage: str, model: str, seed: int,
              tags: dict | None = None, parent: dict | None = None, settings: TrackingConfig | None = None):
    """A run in an existing store/experiment (created by `init_store`): params = flatten(config),
    artifact config.json, tags stage/model/method/seed/git_commit and the run's source (+ `tags`, which
    win). `parent`: a `run_ref` (the run that trained the model this run evaluates): the run becomes its
    child and takes its method and seed tags, unless that run is not in this store (then the run stays
    top-level, and says so). Yields a `Run`; the run ends FINISHED, or FAILED (KILLED on Ctrl-C) when the
    body raises. The store may be down at any point: the job waits at most settings.start_timeout_s for the run
    to be created and settings.end_timeout_s at the end; what was not sent stays in the spool."""
    from mlflow.tracking import MlflowClient

    settings = settings or TrackingConfig(uri=uri, experiment=experiment)
    path = sqlite_path(uri)
    if path is not None and not path.exists():
        raise FileNotFoundError(f"tracking store {path} does not exist: run `memopd tracking init` first "
                                "(parallel jobs must not create a SQLite store themselves)")
    if path is None:
        bounded_http(settings.http_timeout_s)
    commit = git_commit()
    all_tags = {"stage": stage, "model": model, "method": model, "seed": seed, "git_commit": commit,
                "mlflow.source.git.commit": commit.removesuffix("-dirty"), "mlflow.source.type": "LOCAL",
                "mlflow.source.name": f"memopd {stage}", **(tags or {})}
    ref = {"run_name": run_name, "experiment": experiment, "tracking_uri": uri, "stage": stage, "model": model,
           "method": all_tags["method"], "seed": all_tags["seed"]}
    spool = Spool.new(settings.spool, run_name)
    spool.append({"op": "create", "uri": uri, "experiment": experiment, "run_name": run_name, "parent": parent,
                  "tags": {k: str(v) for k, v in all_tags.items()}, "ref": ref})
    sender = Sender(spool, MlflowClient(tracking_uri=uri))
    sender.start()
    run = Run(spool, sender, ref)
    if not sender.created.wait(settings.start_timeout_s):
        print(f"tracking: the store {uri} did not take run {run_name} within {settings.start_timeout_s:g} s "
              f"({sender.last_error}); the job goes on, its records spooled in {spool.path}", flush=True)
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
        run._op({"op": "end", "status": status})
        sent = sender.finish(settings.end_timeout_s)
        run.run_id  # noqa: B018  the id, read before the spool goes
        if sent:
            spool.remove()
        else:
            why = sender.last_error or "still sending"
            print(f"tracking: {spool.pending()} records of run {run_name} not taken by {uri} within "
                  f"{settings.end_timeout_s:g} s ({why}); kept in {spool.path}: `memopd tracking "
                  f"replay --spool {spool.path}` sends them into the same run", flush=True)


class NullRun:
    """Stands in for a `Run` when a command runs without tracking (same methods, records nothing)."""

    def log_metrics(self, metrics: dict, step: int) -> None: ...
    def log_params(self, params: dict) -> None: ...
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
    t = TrackingConfig.from_json(tracking_json)
    uri = resolve_uri(t.uri, t.sqlite_in_slurm_jobs)
    with start_run(uri, t.experiment, run_name, config, stage=stage, model=model, seed=seed, tags=tags,
                   parent=parent, settings=t) as run:
        print(f"tracking: run {run.run_id or '(not created yet)'} in {uri} (experiment {t.experiment})")
        yield run
