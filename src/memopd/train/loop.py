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
policy + 3B critic is ~96 GB). Under a process group a checkpoint is sharded (memopd.harness): each
rank copies what it holds to host memory and writes it in the background while training goes on; it resumes with
any number of ranks.

Files in the run directory:
  metrics.jsonl        one JSON object per step (rewards, losses, RCE error, step-time breakdown)
  checkpoint/          one process: policy + critic (safetensors), optimizers, RNG state and the next step
                       (torch.save of tensors only, read back memory-mapped with weights_only=True); under a
                       process group the same state sharded (torch.distributed.checkpoint: __<rank>_0.distcp
                       per rank, .metadata); meta.json: the step and the run's identity (`training_identity`);
                       metrics.jsonl: the steps before it. Written every train.checkpoint_every steps and at
                       the last (memopd.harness); `memopd train` deletes it once the model is exported and the
                       run recorded (unless train.keep_checkpoint), so a failure up to then costs no step
  model/               the final policy (safetensors + tokenizer), evaluated like any model

Resume: a run finds checkpoint/ and continues from its step, only if the checkpoint is of this very run
(same config, method, seed, models and data: `training_identity`); any other checkpoint is refused, naming what
changed (continuing it would mix two runs in one model). The metrics of the steps before the checkpoint
come back from checkpoint/metrics.jsonl: Snakemake deletes the output metrics.jsonl before it reruns or
retries a job, and a killed run may have written steps after its last checkpoint; either way the resumed
run's metrics.jsonl holds every step exactly once.
"""
from __future__ import annotations

import copy
import json
import random
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch

from memopd import parallel
from memopd.dist import dist_info, gather, setup_distributed
from memopd.harness import Harness, Part, ResumeMismatch, export, run_identity
from memopd.methods import method as method_spec
from memopd.train.config import RunConfig, RunSections
from memopd.train.update import ValueModel, ppo_update
from memopd.vocab import check_model_dirs

# Settings (dotted, from the config's root) that do not change what a step computes, so not part of a run's
# identity: the data order of the first steps does not depend on train.steps (`task_order`), so a finished run can
# be extended; the colocated vLLM engine's settings (its GPU share, sleep mode), the loss's chunk of logit rows and
# the collective timeout change memory or waiting, not the result (per-row log-softmax; chunk sums differ in float
# rounding only), so a resumed run may lower them after running out of memory; rollout.vllm's GPU share is an
# evaluation engine's, which a training run does not start.
NOT_IDENTITY = ("train.steps", "train.checkpoint_every", "train.keep_checkpoint", "train.activation_checkpointing",
                "train.vllm", "train.dist_timeout_min", "train.ppo.chunk_size", "rollout.vllm.gpu_memory_utilization")


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


def training_identity(s: RunSections, method: str, seed: int, **inputs) -> dict:
    """What a checkpoint must match to be resumed (harness.run_identity): the typed sections the run reads (train,
    with the method's own settings, agent and rollout; every default filled in, less NOT_IDENTITY), method, seed
    and every input (`inputs`: name -> file or directory, or None). A default written out or left out, or another
    method's settings, is the same run."""
    typed = {"train": asdict(s.run), "agent": asdict(s.agent), "rollout": asdict(s.rollout)}
    return run_identity(_without(typed, NOT_IDENTITY), seed, inputs, method=method)


def preflight(s: RunSections, method: str, seed: int, student_dir, teacher_dir, tasks_path, index_dir,
              harness: Harness) -> dict | None:
    """The refusals of a run, before any model loads (minutes at paper scale): the OPD methods need a
    teacher with the student's tokenizer (OPD compares the two id by id), and a checkpoint is resumed only
    by its own run. Sets the harness's identity; returns the checkpoint to resume or None."""
    taught = method_spec(method).needs_teacher
    if taught and teacher_dir is None:
        raise ValueError(f"method {method!r} needs a teacher")
    if taught:
        check_model_dirs(student_dir, teacher_dir)
    harness.identity = training_identity(s, method, seed, student=student_dir,
                                         teacher=teacher_dir if taught else None, tasks=tasks_path, index=index_dir)
    resume = harness.find()
    if resume is not None and resume["step"] > s.run.steps:  # train.steps is not part of the identity
        raise ResumeMismatch(f"{harness.path} is at step {resume['step']}, past train.steps {s.run.steps}: its "
                             f"model is not this run's; delete {harness.path} to train {s.run.steps} steps from "
                             "scratch")
    return resume


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
    Under torchrun (WORLD_SIZE > 1) every rank calls this; only rank 0 writes files and calls `tracker`.
    Returns the metrics of this invocation's steps."""
    sections = RunSections.parse(cfg, method, seed)  # refuses a bad section before anything runs
    run, out = sections.run, Path(out_dir)
    harness = Harness(out / "checkpoint", {}, run.steps, run.checkpoint_every, f"{method} seed {seed}")
    resume = preflight(sections, method, seed, student_dir, teacher_dir, tasks_path, index_dir, harness)
    device = setup_distributed(run.dist_timeout_min)
    rank, world, _ = dist_info()
    if world > 1:  # sharded checkpoints are written by a background thread with collectives of their own: a
        # group apart from the training's, so that the two never interleave
        harness.group = torch.distributed.new_group(backend="gloo", timeout=timedelta(minutes=run.dist_timeout_min))
    if run.batch_tasks < world:
        raise ValueError(f"train.batch_tasks {run.batch_tasks} < {world} ranks: some rank would get no episode")
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    step = _RunStep.build(sections, method, seed, student_dir, teacher_dir, tasks_path, index_dir, device)
    harness.parts = [Part("policy", step.policy, "actor_opt", step.actor_opt),
                     Part("critic", step.critic, "critic_opt", step.critic_opt)]
    start = harness.resume(resume)
    if resume is not None:
        log(f"resuming {method} seed {seed} at step {start}")
    metrics_path = out / "metrics.jsonl"
    if rank == 0:  # the steps the checkpoint covers, none written after it
        metrics_path.write_text("".join(line + "\n" for line in harness.metrics))
    history: list[dict] = []

    def run_step(i: int) -> str:
        m = step(i)
        history.append(m)
        harness.metrics.append(json.dumps(m, sort_keys=True))
        if rank == 0:
            with open(metrics_path, "a") as f:
                f.write(harness.metrics[-1] + "\n")
            if tracker is not None:
                tracker(m, i)
        return ""

    if harness.loop(start, run_step, stop_after) == run.steps:
        # in train.dtype (what evaluation and vLLM load); the checkpoint keeps the fp32 master weights
        export(step.policy, out / "model", step.tok, run.dtype)  # the checkpoint stays: `memopd train` lets it
        # go once the model is exported and the run recorded, so a failure up to then loses no step
    return history


@dataclass
class _RunStep:
    """One training step: sync the engine's weights (vLLM), roll out this rank's share of the batch, update
    on the exact packed states (`ppo_update`). Returns the step's metrics."""
    run: RunConfig
    method: str
    seed: int
    device: torch.device
    policy: torch.nn.Module
    ref: torch.nn.Module
    critic: torch.nn.Module
    teacher: torch.nn.Module | None
    actor_opt: torch.optim.Optimizer
    critic_opt: torch.optim.Optimizer
    ppo_cfg: object
    backend: object
    sync: object  # generation.weight_sync.WeightSync of a vLLM engine, or None (the policy samples)
    tok: object
    tasks: list
    retriever: object
    agent: object
    schedule: list[list[int]]

    @classmethod
    def build(cls, s: RunSections, method, seed, student_dir, teacher_dir, tasks_path, index_dir, device):
        from memopd.agent.protocol import load_tasks
        from memopd.generation.backends import HFBackend, VLLMBackend, make_sampling
        from memopd.models import load_tokenizer
        from memopd.retrieval import load_retriever

        run, ro = s.run, s.rollout
        _, world, _ = dist_info()
        tok = load_tokenizer(student_dir)
        sampling = make_sampling(ro)
        sync = backend = None
        if ro.vllm_engine:  # the engine first: it sizes its memory from what is free
            from memopd.generation.weight_sync import WeightSync, colocated_llm

            llm = colocated_llm(student_dir, ro, run.vllm, seed, world)
            sync = WeightSync(llm, sleep=run.vllm.sleep)
            backend = VLLMBackend(student_dir, tok, sampling, llm=llm)
        policy, ref, critic, teacher = build_models(run, method, student_dir, teacher_dir, device, world)
        actor_opt = torch.optim.AdamW(policy.parameters(), lr=run.lr_actor, weight_decay=0.0)
        critic_opt = torch.optim.AdamW(critic.parameters(), lr=run.lr_critic, weight_decay=0.0)
        if sync is None:
            backend = HFBackend(parallel.unwrap(policy), tok, sampling)  # generates inside parallel.gathered
        tasks = load_tasks(tasks_path)
        # the OPD KL runs over the tokenizer's real ids (heads may be padded beyond them)
        return cls(run, method, seed, device, policy, ref, critic, teacher, actor_opt, critic_opt,
                   replace(run.ppo, vocab=len(tok)), backend, sync, tok, tasks, load_retriever(index_dir),
                   s.agent, task_order(len(tasks), run.steps, run.batch_tasks, seed))

    def __call__(self, step: int) -> dict:
        from memopd.agent.rollout import rollout

        rank, world, _ = dist_info()
        run, sync = self.run, self.sync
        t0 = time.perf_counter()
        mine = list(range(rank, run.batch_tasks, world))  # this rank's positions in the batch
        t_sync = sync.sync(self.policy) if sync is not None else None
        t1 = time.perf_counter()
        stats: dict = {}
        # hf rollouts: the policy itself samples, whole (gathered if sharded) and in the update's precision
        with (parallel.gathered(self.policy) if sync is None else nullcontext()), \
                (parallel.autocast(self.device, run.dtype) if sync is None else nullcontext()):
            episodes = rollout([self.tasks[self.schedule[step][i]] for i in mine], self.backend, self.tok,
                               self.retriever, self.agent, seed=self.seed * 1_000_003 + step, progress=False,
                               stats=stats, indices=mine)
        if sync is not None:
            sync.release()
        t2 = time.perf_counter()
        step_cfg = replace(self.ppo_cfg, seed=self.seed * 1_000_003 + step)
        m = ppo_update(episodes, self.policy, self.ref, self.critic, self.teacher, self.actor_opt, self.critic_opt,
                       step_cfg, ids=mine)
        t3 = time.perf_counter()
        m.update(rollout_metrics(episodes))
        m.update({"step": step, "method": self.method, "seed": self.seed, "world_size": world,
                  "time/rollout_s": t2 - t1, "time/step_s": t3 - t0})
        if t_sync is not None:
            m["time/sync_s"] = t_sync
        m["tokens_per_s"] = m["tokens/packed"] / max(m["time/update_s"] + m["time/score_s"], 1e-9)
        return m
