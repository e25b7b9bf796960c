"""A run's tracking writes, on disk first: the job appends each write (an op) to the run's spool file and goes on; a
background thread sends the ops to the MLflow store in order. A store that is down (at the start, mid-run, at the
end) never holds the job: its steps only append to a local file, and at the end the job waits at most
`end_timeout_s` for the sender. What could not be sent stays in the spool, and `memopd tracking replay` sends it
later into the same run (created then if the store was down from the start), rewriting the run references
(`mlflow_run.json`) the job wrote.

Files, in the spool directory (tracking.spool), per run (`key`: the run name and a unique suffix):
    {key}.jsonl        the ops, one JSON object a line: create, params, tags, metrics, dict, artifact, input, refs, end
    {key}.state.json   how many ops the store has taken, and the run's id once it exists
    {key}.files/       the artifacts, copied when logged (the file may change or go before it is sent)
A run whose ops were all sent leaves nothing behind.
"""
from __future__ import annotations

import json
import shutil
import threading
import time
import uuid
from pathlib import Path

from memopd.atomic import write_text

SUFFIX, STATE, FILES = ".jsonl", ".state.json", ".files"
RUN_FILE = "mlflow_run.json"  # a run's reference, written into a model / run directory by the job that tracked it
METRICS_PER_BATCH, PARAMS_PER_BATCH = 1000, 100  # MLflow's limits per log_batch


class Spool:
    """The ops of one run on disk; appends and reads are safe between the job's thread and its sender."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.state_path = self.path.with_name(self.path.name.removesuffix(SUFFIX) + STATE)
        self.files = self.path.with_name(self.path.name.removesuffix(SUFFIX) + FILES)
        self._lock = threading.Lock()

    @classmethod
    def new(cls, directory: str | Path, run_name: str) -> "Spool":
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_name)[:80]
        Path(directory).mkdir(parents=True, exist_ok=True)
        return cls(Path(directory) / f"{safe}-{uuid.uuid4().hex[:8]}{SUFFIX}")

    def append(self, op: dict) -> None:
        line = json.dumps(op, sort_keys=True) + "\n"
        with self._lock, open(self.path, "a") as f:
            f.write(line)

    def ops(self) -> list[dict]:
        with self._lock:
            if not self.path.exists():
                return []
            return [json.loads(x) for x in self.path.read_text().splitlines() if x.strip()]

    def state(self) -> dict:
        return json.loads(self.state_path.read_text()) if self.state_path.exists() else {"sent": 0, "run_id": None}

    def save_state(self, state: dict) -> None:
        write_text(self.state_path, json.dumps(state, sort_keys=True))

    def keep_file(self, path: str | Path) -> Path:
        """A copy of an artifact to send, kept with the spool until it is sent."""
        self.files.mkdir(exist_ok=True)
        dst = self.files / f"{len(list(self.files.iterdir())):04d}" / Path(path).name
        dst.parent.mkdir()
        shutil.copy2(path, dst)
        return dst

    def pending(self) -> int:
        return len(self.ops()) - self.state()["sent"]

    def remove(self) -> None:
        for p in (self.path, self.state_path):
            p.unlink(missing_ok=True)
        shutil.rmtree(self.files, ignore_errors=True)


def write_ref_file(directory: str | Path, ref: dict) -> None:
    Path(directory).mkdir(parents=True, exist_ok=True)
    write_text(Path(directory) / RUN_FILE, json.dumps(ref, indent=2) + "\n")


def _run_ref(create: dict, run_id: str) -> dict:
    return {**create["ref"], "run_id": run_id}


def send_op(client, op: dict, state: dict, create: dict) -> None:
    """Send one op (a `metrics` op may hold several ops' metrics, merged); `state["run_id"]` is set by `create`."""
    from mlflow.entities import Metric, Param

    kind, run_id = op["op"], state.get("run_id")
    if kind == "create":
        state["run_id"] = _create(client, op)
    elif kind == "params":
        items = [Param(k, v) for k, v in op["params"].items()]
        for i in range(0, len(items), PARAMS_PER_BATCH):
            client.log_batch(run_id, params=items[i:i + PARAMS_PER_BATCH])
    elif kind == "metrics":
        items = [Metric(k, float(v), ts, int(step)) for k, v, ts, step in op["items"]]
        for i in range(0, len(items), METRICS_PER_BATCH):
            client.log_batch(run_id, metrics=items[i:i + METRICS_PER_BATCH])
    elif kind == "dict":
        client.log_dict(run_id, op["obj"], op["name"])
    elif kind == "artifact":
        client.log_artifact(run_id, op["path"], op.get("artifact_path"))
    elif kind == "input":
        from mlflow.entities import Dataset, DatasetInput, InputTag

        client.log_inputs(run_id, datasets=[DatasetInput(Dataset(**op["dataset"]),
                                                         tags=[InputTag("mlflow.data.context", op["context"])])])
    elif kind == "refs":
        for d in op["dirs"]:
            write_ref_file(d, _run_ref(create, run_id))
    elif kind == "end":
        client.set_terminated(run_id, op["status"])
    else:
        raise ValueError(f"unknown tracking op {kind!r}")


def _create(client, op: dict) -> str:
    """The run in its experiment, a child of `op["parent"]` when that run is in the same experiment."""
    exp = client.get_experiment_by_name(op["experiment"])
    if exp is None:
        raise LookupError(f"experiment {op['experiment']!r} not in {op['uri']}: run `memopd tracking init` first")
    tags = dict(op["tags"])
    parent = op.get("parent") or {}
    if parent.get("run_id"):
        try:
            parent_run = client.get_run(parent["run_id"])
        except Exception as e:  # another store, or a deleted run
            print(f"tracking: parent run {parent['run_id']} not in {op['uri']} ({type(e).__name__}); this run is "
                  "top-level", flush=True)
        else:
            if parent_run.info.experiment_id == exp.experiment_id:
                tags.update({"mlflow.parentRunId": parent["run_id"], "parent_run_name": parent_run.info.run_name,
                             **{k: str(parent[k]) for k in ("method", "seed") if k in parent}})
            else:
                print(f"tracking: parent run {parent['run_id']} is in another experiment; this run is top-level",
                      flush=True)
    elif parent:
        print(f"tracking: the model's run was never recorded ({parent.get('pending_spool', 'no id')}); this run "
              "is top-level", flush=True)
    return client.create_run(exp.experiment_id, run_name=op["run_name"], tags=tags).info.run_id


def _merged(ops: list[dict], start: int) -> tuple[dict, int]:
    """The op at `start`, with the metrics of the metrics ops right after it merged in (one batch); how many."""
    op = ops[start]
    if op["op"] != "metrics":
        return op, 1
    items, n = list(op["items"]), 1
    while start + n < len(ops) and ops[start + n]["op"] == "metrics" and len(items) < METRICS_PER_BATCH:
        items += ops[start + n]["items"]
        n += 1
    return {"op": "metrics", "items": items}, n


class Sender(threading.Thread):
    """Sends a spool's ops in order; a failed send is retried with back-off (first_s doubling up to cap_s) until it
    lands or the sender is told to stop. Never raises: `last_error` says what failed."""

    def __init__(self, spool: Spool, client, first_s: float = 0.5, cap_s: float = 15.0):
        import mlflow.entities  # noqa: F401  here, not first in the thread: two threads importing one package race
        import mlflow.store.tracking.sqlalchemy_store  # noqa: F401

        super().__init__(daemon=True, name=f"tracking-{spool.path.stem}")
        self.spool, self.client, self.first_s, self.cap_s = spool, client, first_s, cap_s
        self.wake, self.stop_at, self.last_error = threading.Event(), None, None
        self.created = threading.Event()  # the run exists in the store

    def step(self) -> bool:
        """Send what is pending, in order; False when a send failed (the rest waits)."""
        ops, state = self.spool.ops(), self.spool.state()
        create = next((o for o in ops if o["op"] == "create"), {})
        if state.get("run_id"):
            self.created.set()
        while state["sent"] < len(ops):
            op, n = _merged(ops, state["sent"])
            try:
                send_op(self.client, op, state, create)
            except Exception as e:  # a store that is down, restarting or locked: kept, retried
                self.last_error = f"{op['op']}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
                return False
            state["sent"] += n
            self.spool.save_state(state)
            if state.get("run_id"):
                self.created.set()
        return True

    def run(self) -> None:
        delay = self.first_s
        while True:
            # read before the step: once finish() has set it, every op the job wrote is in the spool, so the step
            # below sees the last of them (read after, a step that missed the end op could end the thread)
            stopping = self.stop_at is not None
            try:
                ok = self.step()
            except Exception as e:  # reading the spool itself failed: said, and tried again
                self.last_error, ok = f"spool {self.spool.path}: {type(e).__name__}: {e}", False
            done = ok and self.spool.pending() == 0
            if stopping and (done or time.monotonic() >= self.stop_at):
                return
            if ok:
                delay = self.first_s
                self.wake.wait(1.0)  # new ops wake it; a second at most between looks
            else:
                self.wake.wait(min(delay, max(0.0, (self.stop_at or float("inf")) - time.monotonic())))
                delay = min(self.cap_s, delay * 2)
            self.wake.clear()

    def finish(self, timeout_s: float) -> bool:
        """Send what is left for at most `timeout_s`; True when every op was sent."""
        self.stop_at = time.monotonic() + timeout_s
        self.wake.set()
        self.join(timeout_s + 5)
        return self.spool.pending() == 0


def spool_files(paths: list[str | Path]) -> list[Path]:
    """The spool files named, or found in the directories named."""
    out = []
    for p in map(Path, paths):
        out += sorted(p.glob(f"*{SUFFIX}")) if p.is_dir() else [p]
    return out


def replay(path: str | Path, uri: str | None = None, tries: int = 3, first_s: float = 1.0) -> str:
    """Send what a job left in its spool into the same run (creating it when the store was down from the start),
    rewriting the run references it wrote; the spool is removed once all is sent. Returns the run id; a store
    that refuses every try raises ConnectionError naming the op and the error."""
    from mlflow.tracking import MlflowClient

    spool = Spool(path)
    ops = spool.ops()
    if not ops or ops[0]["op"] != "create":
        raise ValueError(f"{path}: not a tracking spool (no create record first)")
    sender = Sender(spool, MlflowClient(tracking_uri=uri or ops[0]["uri"]))
    for attempt in range(tries):
        if sender.step():
            break
        time.sleep(first_s * 2 ** attempt)
    if spool.pending():
        raise ConnectionError(f"{path}: {spool.pending()} records not taken ({sender.last_error})")
    run_id = spool.state()["run_id"]
    spool.remove()
    return run_id
