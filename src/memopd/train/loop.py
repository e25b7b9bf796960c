"""The PPO / MemOPD training run: roll out with the current policy, update on exact packed states,
checkpoint, resume.

One run = one (method, seed). Everything that could differ between methods is fixed by the seed
alone (task order, rollout sampling seeds, minibatch order), so `ppo`, `memopd` and
`memopd_persistent` with the same seed see the same data order from the same SFT initialisation.

Rollouts come from the `rollout.backend` of the config: `hf` (the policy itself, through its KV
cache) or `vllm` (a colocated engine whose weights are synced from the policy before every rollout,
`memopd.generation.weight_sync`; the sync time is logged as time/sync_s). Under torchrun every rank rolls
out and scores its share of each batch (positions rank, rank + W, ...; sampling seeds by batch
position, so the episodes are those of a single process) and the gradients are summed over ranks
(`ppo_update`); rank 0 writes the metrics and the final model, every rank its part of each checkpoint.

Precision and memory (`memopd.parallel`): policy, critic and reference are fp32 whatever
`train.dtype` (bf16 autocast when it is bfloat16; the teacher is loaded in `train.dtype`, inference
only). `train.shard: fsdp` shards the three with FSDP2 over the ranks (paper scale: fp32 AdamW of a 3B
policy + 3B critic is ~96 GB). Under a process group a checkpoint is sharded (`save_sharded_checkpoint`): each
rank copies what it holds to host memory and writes it in the background while training goes on; it resumes with
any number of ranks.

Files in the run directory:
  metrics.jsonl        one JSON object per step (rewards, losses, RCE error, step-time breakdown)
  checkpoint/          one process: policy + critic (safetensors), optimizers, RNG state and the next step
                       (torch.save of tensors only, read back memory-mapped with weights_only=True); under a
                       process group the same state sharded (torch.distributed.checkpoint: __<rank>_0.distcp
                       per rank, .metadata); meta.json: the step and the run's identity (`run_identity`);
                       metrics.jsonl: the steps before it
  model/               the final policy (safetensors + tokenizer), evaluated like any model

Resume: a run finds checkpoint/ and continues from its step, only if the checkpoint is of this very run
(same config, method, seed, models and data: `run_identity`); any other checkpoint is refused, naming what
changed (continuing it would mix two runs in one model). The metrics of the steps before the checkpoint
come back from checkpoint/metrics.jsonl: Snakemake deletes the output metrics.jsonl before it reruns or
retries a job, and a killed run may have written steps after its last checkpoint; either way the resumed
run's metrics.jsonl holds every step exactly once.
"""
from __future__ import annotations

import copy
import json
import random
import shutil
import time
from contextlib import nullcontext
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch

from memopd import parallel
from memopd.checkpoint import (PendingSave, is_sharded, load_sharded, load_tensors, read_state, save_sharded,
                               save_tensors)
from memopd.dist import dist_info, gather, setup_distributed
from memopd.methods import method as method_spec
from memopd.progress import Progress
from memopd.train.config import RunConfig
from memopd.train.ppo import ValueModel, ppo_update
from memopd.vocab import check_model_dirs

# train.* keys (dotted) that do not change what a step computes, so not part of a run's identity: the data order
# of the first steps does not depend on train.steps (`task_order`), so a finished run can be extended; the vLLM
# engine's settings (its GPU share, sleep mode) and the loss's chunk of logit rows change memory, not the
# result (per-row log-softmax; chunk sums differ in float rounding only), so a resumed run may lower them
# after running out of memory.
NOT_IDENTITY = ("steps", "checkpoint_every", "keep_checkpoint", "activation_checkpointing", "vllm",
                "ppo.chunk_size")


def _without(section: dict, paths) -> dict:
    """`section` less the dotted `paths` (missing ones ignored)."""
    out = dict(section)
    for path in paths:
        head, _, rest = path.partition(".")
        if rest and isinstance(out.get(head), dict):
            out[head] = _without(out[head], [rest])
        elif not rest:
            out.pop(head, None)
    return out


class ResumeMismatch(RuntimeError):
    """A checkpoint of another run (config, method, seed, models or data differ) where this run would resume."""


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state()}


def _publish(tmp: Path, path: Path, step: int, identity: dict | None, metrics: list[str]) -> None:
    """Complete the checkpoint written into `tmp` (meta.json, the metrics of steps 0..step-1) and swap it in."""
    (tmp / "meta.json").write_text(json.dumps({"step": step, "identity": identity}, indent=1, sort_keys=True) + "\n")
    (tmp / "metrics.jsonl").write_text("".join(line + "\n" for line in metrics))
    if path.exists():
        shutil.rmtree(path)
    tmp.replace(path)


def save_checkpoint(path: Path, step: int, policy, critic, actor_opt, critic_opt, identity: dict | None = None,
                    metrics: list[str] = ()) -> None:
    """A single process's checkpoint (no process group; under one, `save_sharded_checkpoint`): whole tensors as
    safetensors + state.pt. `identity` (`run_identity`) and the metrics lines of steps 0..step-1 are stored with it,
    for `resume_point`."""
    tensors = {name: {k: v.cpu().contiguous() for k, v in parallel.full_state_dict(m).items()}
               for name, m in (("policy", policy), ("critic", critic))}
    opts = {"actor_opt": parallel.optimizer_state(policy, actor_opt),
            "critic_opt": parallel.optimizer_state(critic, critic_opt)}
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    for name, t in tensors.items():
        save_tensors(t, tmp / f"{name}.safetensors")  # tied weights stored once
    torch.save({"step": torch.tensor(step), **opts, **_rng_state()}, tmp / "state.pt")
    _publish(tmp, path, step, identity, list(metrics))


def _training_state(policy, critic, actor_opt, critic_opt, rng: bool) -> dict:
    """Policy, critic and their AdamW states as torch.distributed.checkpoint sees them (Hugging Face names, this
    rank's DTensor shards when sharded), and, with `rng`, the torch generator's state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    (p, p_opt), (c, c_opt) = (get_state_dict(parallel.unwrap(m), o) for m, o in ((policy, actor_opt),
                                                                                 (critic, critic_opt)))
    return {"policy": p, "critic": c, "actor_opt": p_opt, "critic_opt": c_opt,
            **({"rng": torch.get_rng_state()} if rng else {})}


def save_sharded_checkpoint(path: Path, step: int, policy, critic, actor_opt, critic_opt, group,
                            identity: dict | None = None, metrics: list[str] = ()) -> PendingSave:
    """Every rank of the process group: write its part of the checkpoint into `<path>.tmp` in the background
    (checkpoint.save_sharded over `group`). Rank 0's `complete()` then adds meta.json and metrics.jsonl and swaps
    the directory in, so a kill before that leaves the previous checkpoint. The RNG state is rank 0's, as in a
    single process's checkpoint; every rank resumes with it."""
    rank = torch.distributed.get_rank()
    tmp = path.with_name(path.name + ".tmp")
    if rank == 0:  # the files of a save that was killed
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    torch.distributed.barrier(group)  # no rank writes into the directory before rank 0 has emptied it
    finish = (lambda lines=list(metrics): _publish(tmp, path, step, identity, lines)) if rank == 0 else None
    return save_sharded(_training_state(policy, critic, actor_opt, critic_opt, rng=rank == 0), tmp, group, finish)


def load_checkpoint(path: Path, policy, critic, actor_opt, critic_opt) -> int:
    """Restore policy, critic, optimizers and RNG from either kind of checkpoint, with any number of ranks;
    returns the step to continue from."""
    if is_sharded(path):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = _training_state(policy, critic, actor_opt, critic_opt, rng=True)
        load_sharded(state, path, [f"{m}.{k}" for m in ("policy", "critic") for k in state[m]] + ["rng"])
        for name, m, opt, key in (("policy", policy, actor_opt, "actor_opt"), ("critic", critic, critic_opt, "critic_opt")):
            set_state_dict(parallel.unwrap(m), opt, model_state_dict=state[name], optim_state_dict=state[key])
        torch.set_rng_state(state["rng"])
        return json.loads((path / "meta.json").read_text())["step"]
    parallel.load_full_state_dict(policy, load_tensors(path / "policy.safetensors"))
    parallel.load_full_state_dict(critic, load_tensors(path / "critic.safetensors"))
    state = read_state(path)  # mapped: a node's ranks share the file's pages, each copies only the shards it keeps
    parallel.load_optimizer_state(policy, actor_opt, state["actor_opt"])
    parallel.load_optimizer_state(critic, critic_opt, state["critic_opt"])
    torch.set_rng_state(state["torch"])
    return int(state["step"])


def file_identity(path: str | Path | None) -> dict | None:
    """Path as given, and size + modification time of every file (a model rebuilt upstream is another
    model; content hashes of multi-GB models would cost minutes at every start)."""
    if path is None:
        return None
    p = Path(path)
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    return {"path": str(path), "files": {str(f.relative_to(p)) if p.is_dir() else f.name:
                                         [f.stat().st_size, f.stat().st_mtime_ns] for f in files}}


def run_identity(cfg: dict, method: str, seed: int, **inputs) -> dict:
    """What a checkpoint must match to be resumed: the config sections the run reads (less NOT_IDENTITY),
    method, seed and every input (`inputs`: name -> file or directory, or None), as JSON values."""
    train = _without(cfg["train"], NOT_IDENTITY)
    identity = {"config": {**cfg, "train": train}, "method": method, "seed": seed,
                **{name: file_identity(path) for name, path in inputs.items()}}
    return json.loads(json.dumps(identity, sort_keys=True, default=str))


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


def resume_point(path: Path, identity: dict) -> dict | None:
    """The checkpoint at `path` to resume ({step, metrics: lines of steps 0..step-1}), None when there is
    none; ResumeMismatch when it is not of the run `identity` describes."""
    if not ((path / "state.pt").exists() or is_sharded(path)):
        return None
    how = f"delete {path} to train this run from scratch, or restore the settings it was trained with"
    if not (path / "meta.json").exists():
        raise ResumeMismatch(f"{path} holds a checkpoint without the identity of its run (written by an older "
                             f"memopd): it cannot be checked against this run; {how}")
    meta = json.loads((path / "meta.json").read_text())
    changes = identity_changes(meta.get("identity") or {}, identity)
    if changes:
        raise ResumeMismatch(f"{path} holds a checkpoint of another run; changed since: {'; '.join(changes)}. {how}")
    lines = (path / "metrics.jsonl").read_text().splitlines() if (path / "metrics.jsonl").exists() else []
    return {"step": meta["step"], "metrics": lines[: meta["step"]]}


def preflight(cfg: dict, run: RunConfig, method: str, seed: int, student_dir, teacher_dir, tasks_path, index_dir,
              ckpt: Path) -> tuple[dict, dict | None]:
    """The refusals of a run, before any model loads (minutes at paper scale): the OPD methods need a
    teacher with the student's tokenizer (OPD compares the two id by id), and a checkpoint is resumed only
    by its own run. Returns (the run's identity, the checkpoint to resume or None)."""
    taught = method_spec(method).needs_teacher
    if taught and teacher_dir is None:
        raise ValueError(f"method {method!r} needs a teacher")
    if taught:
        check_model_dirs(student_dir, teacher_dir)
    identity = run_identity(cfg, method, seed, student=student_dir, teacher=teacher_dir if taught else None,
                            tasks=tasks_path, index=index_dir)
    resume = resume_point(ckpt, identity)
    steps = run.steps
    if resume is not None and resume["step"] > steps:  # train.steps is not part of the identity
        raise ResumeMismatch(f"{ckpt} is at step {resume['step']}, past train.steps {steps}: its model is not "
                             f"this run's; delete {ckpt} to train {steps} steps from scratch")
    return identity, resume


def task_order(n_tasks: int, steps: int, batch: int, seed: int) -> list[list[int]]:
    """The tasks of every step: a seeded permutation, cycled (identical for every method)."""
    rng = random.Random(seed)
    order: list[int] = []
    while len(order) < steps * batch:
        perm = list(range(n_tasks))
        rng.shuffle(perm)
        order += perm
    return [order[s * batch : (s + 1) * batch] for s in range(steps)]


def rollout_metrics(episodes) -> dict:
    """Task scores and protocol statistics of the batch (every rank's episodes)."""
    per_ep = [(e.metrics["f1"], e.metrics["em"], len(e.invocations), e.metrics["invalid_actions"]) for e in episodes]
    rows = [r for part in gather(per_ep) for r in part]
    n, calls = len(rows), sum(r[2] for r in rows)
    return {"episodes": n, "reward/f1": sum(r[0] for r in rows) / n, "reward/em": sum(r[1] for r in rows) / n,
            "rollout/calls_per_episode": calls / n,
            "rollout/invalid_rate": sum(r[3] for r in rows) / max(1, calls)}


def build_models(run: RunConfig, method: str, student_dir, teacher_dir, device, world: int, load=None):
    """Policy, reference, critic and teacher on `device`, each sharded (train.shard: fsdp, W > 1) as soon as it
    exists and the teacher loaded last, so that a rank never holds more than the policy and one copy of it whole
    (the plan's `load` phase). `load` (tests) stands for memopd.models.load_model."""
    if load is None:
        from memopd.models import load_model as load
    fsdp = run.shard == "fsdp" and world > 1  # one rank: a shard is the whole model, the replica path is the same

    def place(model, trained: bool):
        if trained and run.activation_checkpointing:  # recompute each decoder layer in the backward (before sharding)
            model = parallel.checkpoint_activations(model)
        return parallel.shard(model, run.dtype) if fsdp else model

    # fp32 master weights whatever train.dtype (bf16 autocast computes; pure bf16 parameters would round
    # lr 1e-6 steps away); the reference is the policy's frozen copy, so it is scored exactly like pi_old
    policy = load(student_dir, dtype="float32", device=str(device))
    ref = place(copy.deepcopy(policy).requires_grad_(False), trained=False)  # frozen at the SFT initialisation
    critic = place(ValueModel(copy.deepcopy(policy), layers=run.critic_layers), trained=True)  # the first layers
    policy = place(policy, trained=True)
    # the frozen teacher stays in train.dtype and whole: inference only (a target distribution, never in a
    # ratio); `ppo` never scores it, so it needs none (its jobs can start before the teacher's SFT ends)
    teacher = (load(teacher_dir, dtype=run.dtype, device=str(device)).requires_grad_(False)
               if method_spec(method).needs_teacher else None)
    return policy, ref, critic, teacher


def train_run(cfg: dict, method: str, seed: int, student_dir: str | Path, teacher_dir: str | Path | None,
              tasks_path: str | Path, index_dir: str | Path, out_dir: str | Path, stop_after: int | None = None,
              tracker=None, log=print) -> list[dict]:
    """Train one (method, seed). `cfg` holds the `train`, `agent` and `rollout` sections.
    `stop_after` ends the process after that many steps of this invocation (tests of resume).
    Under torchrun (WORLD_SIZE > 1) every rank calls this; only rank 0 writes files and calls `tracker`."""
    from memopd.agent.protocol import load_tasks
    from memopd.agent.rollout import rollout
    from memopd.config import agent_config, rollout_config
    from memopd.generation.backends import HFBackend, VLLMBackend, make_sampling
    from memopd.models import DTYPES, load_tokenizer
    from memopd.retrieval import load_retriever

    run = RunConfig.from_section(cfg["train"], method, seed)  # refuses a bad section before anything runs
    ro = rollout_config(cfg)
    out = Path(out_dir)
    ckpt, metrics_path = out / "checkpoint", out / "metrics.jsonl"
    identity, resume = preflight(cfg, run, method, seed, student_dir, teacher_dir, tasks_path, index_dir, ckpt)
    device = setup_distributed(run.dist_timeout_min)
    rank, world, _ = dist_info()
    # sharded checkpoints are written by a background thread with collectives of their own: a group apart from
    # the training's, so that the two never interleave
    group = torch.distributed.new_group(backend="gloo", timeout=timedelta(minutes=run.dist_timeout_min)) \
        if world > 1 else None
    if run.batch_tasks < world:
        raise ValueError(f"train.batch_tasks {run.batch_tasks} < {world} ranks: some rank would get no episode")
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(student_dir)
    sampling = make_sampling(ro)
    sync = None
    if ro.vllm_engine:  # the engine first: it sizes its memory from what is free
        from memopd.generation.weight_sync import WeightSync, colocated_llm, sleep_mode

        llm = colocated_llm(student_dir, ro, run.vllm, seed, world)
        sync = WeightSync(llm, sleep=sleep_mode(run.vllm))
        backend = VLLMBackend(student_dir, tok, sampling, llm=llm)
    policy, ref, critic, teacher = build_models(run, method, student_dir, teacher_dir, device, world)
    actor_opt = torch.optim.AdamW(policy.parameters(), lr=run.lr_actor, weight_decay=0.0)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=run.lr_critic, weight_decay=0.0)
    # the OPD KL runs over the tokenizer's real ids (heads may be padded beyond them)
    ppo_cfg = replace(run.ppo, vocab=len(tok))
    if sync is None:
        backend = HFBackend(parallel.unwrap(policy), tok, sampling)  # generates inside parallel.gathered

    start, lines = 0, []  # lines: the metrics of every step so far, stored with each checkpoint
    if resume is not None:
        start, lines = load_checkpoint(ckpt, policy, critic, actor_opt, critic_opt), resume["metrics"]
        log(f"resuming {method} seed {seed} at step {start}")
    if rank == 0:  # the steps the checkpoint covers, none written after it
        metrics_path.write_text("".join(line + "\n" for line in lines))

    tasks = load_tasks(tasks_path)
    retriever = load_retriever(index_dir)
    agent = agent_config(cfg)
    schedule = task_order(len(tasks), run.steps, run.batch_tasks, seed)  # the same on every rank
    history, pending = [], None  # pending: a sharded checkpoint being written
    bar = Progress(f"{method} seed {seed}", run.steps, "steps", start=start, enabled=rank == 0)
    for step in range(start, run.steps):
        t0 = time.perf_counter()
        mine = list(range(rank, run.batch_tasks, world))  # this rank's positions in the batch
        t_sync = sync.sync(policy) if sync is not None else None
        t1 = time.perf_counter()
        stats: dict = {}
        # hf rollouts: the policy itself samples, whole (gathered if sharded) and in the update's precision
        with (parallel.gathered(policy) if sync is None else nullcontext()), \
                (parallel.autocast(device, run.dtype) if sync is None else nullcontext()):
            episodes = rollout([tasks[schedule[step][i]] for i in mine], backend, tok, retriever, agent,
                               seed=seed * 1_000_003 + step, progress=False, stats=stats, indices=mine)
        if sync is not None:
            sync.release()
        t2 = time.perf_counter()
        step_cfg = replace(ppo_cfg, seed=seed * 1_000_003 + step)
        m = ppo_update(episodes, policy, ref, critic, teacher, actor_opt, critic_opt, step_cfg, ids=mine)
        t3 = time.perf_counter()
        m.update(rollout_metrics(episodes))
        m.update({"step": step, "method": method, "seed": seed, "world_size": world, "time/rollout_s": t2 - t1,
                  "time/step_s": t3 - t0})
        if t_sync is not None:
            m["time/sync_s"] = t_sync
        m["tokens_per_s"] = m["tokens/packed"] / max(m["time/update_s"] + m["time/score_s"], 1e-9)
        history.append(m)
        done = step + 1
        lines.append(json.dumps(m, sort_keys=True))
        if rank == 0:
            with open(metrics_path, "a") as f:
                f.write(lines[-1] + "\n")
            if tracker is not None:
                tracker(m, step)
        now = done % run.checkpoint_every == 0 or done == run.steps
        if pending is not None and (now or pending.ready()):  # the previous one written: rank 0 publishes it
            pending.complete()
            pending = None
        if now and group is None:
            save_checkpoint(ckpt, done, policy, critic, actor_opt, critic_opt, identity=identity, metrics=lines)
        elif now:  # every rank writes its part in the background and trains on
            pending = save_sharded_checkpoint(ckpt, done, policy, critic, actor_opt, critic_opt, group,
                                              identity=identity, metrics=lines)
        bar.update(1)
        if stop_after is not None and done - start >= stop_after:
            if pending is not None:
                pending.complete()
            bar.close()
            return history
    bar.close()
    # exported in train.dtype (what evaluation and vLLM load); the checkpoint keeps the fp32 master weights
    state = {k: v.to(DTYPES[run.dtype]) for k, v in parallel.full_state_dict(policy).items()}  # collective if sharded
    if pending is not None:
        pending.complete()
    if rank == 0:
        parallel.unwrap(policy).save_pretrained(out / "model", state_dict=state, safe_serialization=True)
        tok.save_pretrained(out / "model")
        if not run.keep_checkpoint:  # resume needs it no more; at paper scale it is ~74 GB
            shutil.rmtree(ckpt, ignore_errors=True)
    return history
