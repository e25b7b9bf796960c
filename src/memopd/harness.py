"""The run harness of every trainer (SFT, pre-training, PPO / MemOPD): the job around a run (`job`: threads, process
group, tracking, teardown and the checkpoint's release, in one order for every kind of run), a run's identity and
resume, checkpoint cadence and storage, RNG state, the step loop with `stop_after` and progress with time left, and
the export of the final model. The trainers keep only what a step computes.

A checkpoint directory holds
  {part}.safetensors  each trained model's whole weights (checkpoint.save_tensors: tied ones once)
  state.pt            every optimizer's and scheduler's state and the RNG state, tensors and plain numbers only
                      (read back with torch.load(weights_only=True, mmap=True))
  meta.json           the next step, the run's identity and what the trainer adds (train seconds)
  metrics.jsonl       the metrics lines of the steps before it (trainers that keep them)
or, written by every rank of a process group in the background (`sharded`), the same state as
torch.distributed.checkpoint pieces (__<rank>_0.distcp, .metadata) beside meta.json and metrics.jsonl. Either is
written into `<dir>.tmp` and swapped in (checkpoint.publish_dir), so a kill leaves the previous one or the new one.
A checkpoint is resumed only by the run of the same identity; another run's is refused (naming what changed) or,
for trainers that say so, replaced.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from memopd import parallel
from memopd.checkpoint import (PendingSave, is_sharded, load_sharded, load_tensors, publish_dir, read_state,
                               rng_state, save_sharded, save_tensors, set_rng_state)
from memopd.dist import TIMEOUT_MIN, dist_info
from memopd.progress import Progress


def file_identity(path: str | Path | None) -> dict | None:
    """Path as given, and size + modification time of every file (a model rebuilt upstream is another
    model; content hashes of multi-GB models would cost minutes at every start)."""
    if path is None:
        return None
    p = Path(path)
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p] if p.exists() else []
    return {"path": str(path), "files": {str(f.relative_to(p)) if p.is_dir() else f.name:
                                         [f.stat().st_size, f.stat().st_mtime_ns] for f in files}}


def run_identity(config: dict, seed: int, inputs: dict, **more) -> dict:
    """A run's identity, what its saved state must match to be taken up again (a checkpoint, a finished chunk): the
    config it reads, its seed, the identity of every input (`inputs`: name -> file or directory, or None) and what
    else decides its result (`more`), as JSON values. Every trainer's and every resumable step's identity is this."""
    identity = {"config": config, "seed": seed, **{k: file_identity(p) for k, p in inputs.items()}, **more}
    return json.loads(json.dumps(identity, sort_keys=True, default=str))


def digest(identity: dict) -> str:
    """The SHA-256 of an identity's JSON (keys sorted)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


class ResumeMismatch(RuntimeError):
    """A checkpoint of another run (config, method, seed, models or data differ) where this run would resume."""


@dataclass
class Part:
    """A trained model and its optimizer, stored under their names (`{name}.safetensors`, `optimizer` in
    state.pt)."""
    name: str
    model: torch.nn.Module
    optimizer_name: str
    optimizer: torch.optim.Optimizer


def _flat(node, prefix: str = ""):
    for k, v in node.items():
        if isinstance(v, dict) and v:
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def identity_changes(saved: dict, now: dict, show: int = 8) -> list[str]:
    """'key: saved -> now' for every leaf that differs (at most `show`, then a count)."""
    a, b = dict(_flat(saved)), dict(_flat(now))
    keys = sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or a[k] != b[k])
    out = [f"{k}: {a.get(k, '(absent)')!r} -> {b.get(k, '(absent)')!r}" for k in keys[:show]]
    return out + ([f"... {len(keys)} differences in all"] if len(keys) > show else [])


@dataclass
class Harness:
    path: Path  # the checkpoint directory
    identity: dict  # what a checkpoint must match to be resumed (JSON values)
    total: int  # steps of the run
    every: int  # steps between checkpoints (and one at the last step)
    label: str  # progress label
    replace_other: bool = False  # another run's checkpoint: start afresh and replace it (else refuse)
    group: object = None  # a process group of its own: checkpoints sharded, written in the background
    progress: bool = True  # a progress line with the time left (rank 0)
    parts: list[Part] = field(default_factory=list)
    schedulers: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # stored in meta.json and given back on resume
    metrics: list[str] = field(default_factory=list)  # lines of the steps so far, stored with each checkpoint
    _pending: PendingSave | None = None

    def __post_init__(self):
        self.path = Path(self.path)
        self.rank, self.world, _ = dist_info()

    def find(self) -> dict | None:
        """The checkpoint to resume (its meta.json, metrics lines under "metrics"), None when there is none or it
        is another run's that `replace_other` lets go; ResumeMismatch when it is another run's otherwise. Reads no
        model: a run refuses before anything loads."""
        path = self.path if self.path.exists() else self.path.with_name(self.path.name + ".old")
        if not ((path / "state.pt").exists() or is_sharded(path)) or not (path / "meta.json").exists():
            return None
        meta = json.loads((path / "meta.json").read_text())
        changes = identity_changes(meta.get("identity") or {}, self.identity)
        if changes and self.replace_other:
            if self.rank == 0:
                print(f"checkpoint in {self.path} belongs to another run ({'; '.join(changes)}); starting from "
                      "scratch and replacing it")
            return None
        if changes:
            raise ResumeMismatch(f"{self.path} holds a checkpoint of another run; changed since: {'; '.join(changes)}."
                                 f" Delete {self.path} to train this run from scratch, or restore the settings it "
                                 "was trained with")
        lines = (path / "metrics.jsonl").read_text().splitlines() if (path / "metrics.jsonl").exists() else []
        return {**meta, "path": str(path), "metrics": lines[: meta["step"]]}

    def resume(self, found: dict | None) -> int:
        """Restore the parts, schedulers, RNG, `extra` and `metrics` from `found` (`find`); the step to go on
        from (0 without a checkpoint)."""
        if found is None:
            return 0
        path = Path(found["path"])
        if is_sharded(path):
            self._load_sharded(path)
        else:
            for p in self.parts:
                parallel.load_full_state_dict(p.model, load_tensors(path / f"{p.name}.safetensors"))
            state = read_state(path)  # mapped: a node's ranks share its pages, each copies only what it keeps
            for p in self.parts:
                parallel.load_optimizer_state(p.model, p.optimizer, state[p.optimizer_name])
            for name, s in self.schedulers.items():
                s.load_state_dict(state[name])
            set_rng_state(state["rng"])
        self.extra.update({k: found[k] for k in self.extra if k in found}, resumed_from=found["step"])
        self.metrics = list(found["metrics"])
        if self.rank == 0:
            print(f"resuming {self.label} from the checkpoint at step {found['step']} in {self.path}")
        return found["step"]

    def _state(self, rng: bool) -> dict:
        """Parts and optimizers as torch.distributed.checkpoint sees them (this rank's shards) and the RNG."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        out = {}
        for p in self.parts:
            out[p.name], out[p.optimizer_name] = get_state_dict(parallel.unwrap(p.model), p.optimizer)
        return {**out, **({"rng": rng_state()} if rng else {})}

    def _load_sharded(self, path: Path) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state(rng=True)
        load_sharded(state, path, [f"{p.name}.{k}" for p in self.parts for k in state[p.name]] +
                     [f"rng.{k}" for k in state["rng"]])
        for p in self.parts:
            set_state_dict(parallel.unwrap(p.model), p.optimizer, model_state_dict=state[p.name],
                           optim_state_dict=state[p.optimizer_name])
        set_rng_state(state["rng"])

    def _meta(self, step: int) -> dict:
        return {"step": step, "identity": self.identity, **{k: v for k, v in self.extra.items() if k != "resumed_from"}}

    def save(self, step: int) -> None:
        """A checkpoint at `step` (the next step to run). Whole (collective when a model is sharded: rank 0
        writes) or, with a group, every rank's part in the background, published once all are written."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        meta, lines = self._meta(step), list(self.metrics)
        if self.group is not None:
            if self.rank == 0:  # the files of a save that was killed
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            torch.distributed.barrier(self.group)  # no rank writes into it before rank 0 has emptied it
            finish = (lambda: self._publish(tmp, meta, lines)) if self.rank == 0 else None
            self._pending = save_sharded(self._state(rng=self.rank == 0), tmp, self.group, finish)
            return
        keep = self.rank == 0
        tensors = {p.name: parallel.full_state_dict(p.model, keep=keep) for p in self.parts}
        optims = {p.optimizer_name: parallel.optimizer_state(p.model, p.optimizer) for p in self.parts}
        if keep:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for name, t in tensors.items():
                save_tensors(t, tmp / f"{name}.safetensors")
            torch.save({**optims, **{n: s.state_dict() for n, s in self.schedulers.items()}, "rng": rng_state()},
                       tmp / "state.pt")
            self._publish(tmp, meta, lines)
        if self.world > 1:
            torch.distributed.barrier()

    def _publish(self, tmp: Path, meta: dict, lines: list[str]) -> None:
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
        (tmp / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
        publish_dir(tmp, self.path)

    def _complete(self) -> None:
        if self._pending is not None:
            self._pending.complete()
            self._pending = None

    def loop(self, start: int, step: Callable[[int], str], stop_after: int | None = None) -> int:
        """Run `step(i)` (returns a progress note) for i = start .. total - 1, checkpointing every `every` steps
        and at the last; `stop_after=k` returns after the k-th step of this call and its checkpoint, keeping
        nothing else (what a kill leaves: resume tests). Returns the steps done."""
        bar = Progress(self.label, self.total, "steps", start=start, enabled=self.progress and self.rank == 0)
        done = start
        for i in range(start, self.total):
            note = step(i)
            done = i + 1
            due = done % self.every == 0 or done == self.total
            if self._pending is not None and (due or self._pending.ready()):  # rank 0 publishes the previous one
                self._complete()
            if due:
                self.save(done)
            bar.update(1, note=note)
            if stop_after is not None and done - start >= stop_after:
                break
        self._complete()
        bar.close()
        return done


def export(model, out: str | Path, tokenizer, dtype: str = "float32") -> None:
    """A run's final model as a Hugging Face directory (weights in `dtype`, whole: collective when the model is
    sharded, every rank calls it; written by rank 0)."""
    rank, _, _ = dist_info()
    state = parallel.full_state_dict(model, keep=rank == 0)
    if rank == 0:
        dt = getattr(torch, dtype)
        parallel.unwrap(model).save_pretrained(out, state_dict={k: v.to(dt) for k, v in state.items()},
                                               safe_serialization=True)
        tokenizer.save_pretrained(out)


def discard(checkpoint: str | Path, keep: bool = False) -> None:
    """After the export and its records, a run's checkpoint is needed no more (~74 GB a run at paper scale),
    unless the run keeps it (rank 0 deletes it)."""
    if dist_info()[0] == 0 and not keep:
        shutil.rmtree(checkpoint, ignore_errors=True)


@dataclass
class Job:
    """What `job` gives its body: the tracked run (rank 0; a NullRun on the others), this rank, the world size, the
    device, and `done(checkpoint)`: the body has exported its model and written its records."""
    run: object
    rank: int
    world: int
    device: object
    release: tuple[Path, bool] | None = None

    def done(self, checkpoint: str | Path, keep: bool = False) -> None:
        """Let `checkpoint` go at the very end of the job (unless `keep`)."""
        self.release = (Path(checkpoint), keep)


@contextmanager
def job(tracking: str | None, run_name: str, config: dict, stage: str, model: str, seed: int, *, tags: dict | None = None,
        threads: int = 0, dist_timeout_min: float = TIMEOUT_MIN):
    """Everything around a trainer's run, in one order for SFT, pre-training and PPO / MemOPD: this rank's threads
    and the process group; the tracked run (rank 0); the body (train, export, records; it calls `done`); then the
    run's final records, the process group's teardown and, last of all, the checkpoint's release. A failure or a
    kill anywhere before the release leaves the checkpoint, so the job's retry resumes at its last step and trains
    nothing again."""
    from memopd.dist import rank_threads, setup_distributed
    from memopd.tracking import NullRun, tracked

    rank_threads(threads)
    device = setup_distributed(dist_timeout_min)
    rank, world, _ = dist_info()
    scope = Job(NullRun(), rank, world, device)
    with tracked(tracking, run_name, config, stage, model, seed, tags=tags) if rank == 0 else nullcontext(NullRun()) as run:
        scope.run = run
        yield scope
    if world > 1 and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if scope.release is not None:
        discard(*scope.release)
