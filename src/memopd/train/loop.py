"""The PPO / MemOPD training run: roll out with the current policy, update on exact packed states,
checkpoint, resume.

One run = one (method, seed). Everything that could differ between methods is fixed by the seed
alone (task order, rollout sampling seeds, minibatch order), so `ppo`, `memopd` and
`memopd_persistent` with the same seed see the same data order from the same SFT initialisation.

Rollouts come from the `rollout.backend` of the config: `hf` (the policy itself, through its KV
cache) or `vllm` (a colocated engine whose weights are synced from the policy before every rollout,
`memopd.train.weight_sync`; the sync time is logged as time/sync_s). Under torchrun every rank rolls
out and scores its share of each batch (positions rank, rank + W, ...; sampling seeds by batch
position, so the episodes are those of a single process) and the gradients are summed over ranks
(`ppo_update`); rank 0 writes the metrics, checkpoints and the final model.

Precision and memory (`memopd.train.parallel`): policy, critic and reference are fp32 whatever
`train.dtype` (bf16 autocast when it is bfloat16; the teacher is loaded in `train.dtype`, inference
only). `train.shard: fsdp` shards the three with FSDP2 over the ranks (paper scale: fp32 AdamW of a 3B
policy + 3B critic is ~96 GB); checkpoints then hold whole tensors, gathered by every rank and written
by rank 0, and resume with any number of ranks.

Files in the run directory:
  metrics.jsonl        one JSON object per step (rewards, losses, RCE error, step-time breakdown)
  checkpoint/          policy + critic (safetensors), optimizers, RNG states and the next step
                       (torch.save of tensors only, read back with weights_only=True)
  model/               the final policy (safetensors + tokenizer), evaluated like any model
"""
from __future__ import annotations

import copy
import json
import random
import time
from contextlib import nullcontext
from dataclasses import fields
from pathlib import Path

import torch

from memopd.sft.checkpoint import load_tensors, save_tensors
from memopd.train import parallel
from memopd.train.ppo import PPOConfig, ValueModel, gather, ppo_update


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state()}


def save_checkpoint(path: Path, step: int, policy, critic, actor_opt, critic_opt, write: bool = True) -> None:
    """Every rank calls it when the models are sharded (the whole tensors are gathered); only `write`
    writes. Replicas: ranks that do not write return at once."""
    if not write and not parallel.is_sharded(policy):
        return
    tensors = {name: {k: v.cpu().contiguous() for k, v in parallel.full_state_dict(m).items()}
               for name, m in (("policy", policy), ("critic", critic))}
    opts = {"actor_opt": parallel.optimizer_state(policy, actor_opt),
            "critic_opt": parallel.optimizer_state(critic, critic_opt)}
    if not write:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    for name, t in tensors.items():
        save_tensors(t, tmp / f"{name}.safetensors")  # tied weights stored once
    torch.save({"step": torch.tensor(step), **opts, **_rng_state()}, tmp / "state.pt")
    if path.exists():
        import shutil

        shutil.rmtree(path)
    tmp.replace(path)


def load_checkpoint(path: Path, policy, critic, actor_opt, critic_opt) -> int:
    parallel.load_full_state_dict(policy, load_tensors(path / "policy.safetensors"))
    parallel.load_full_state_dict(critic, load_tensors(path / "critic.safetensors"))
    state = torch.load(path / "state.pt", weights_only=True, map_location="cpu")  # the optimizers move it
    parallel.load_optimizer_state(policy, actor_opt, state["actor_opt"])
    parallel.load_optimizer_state(critic, critic_opt, state["critic_opt"])
    torch.set_rng_state(state["torch"])
    return int(state["step"])


def ppo_config(cfg: dict, method: str, seed: int) -> PPOConfig:
    """The `train.ppo` section; the RCE guard's tolerance follows the training dtype (`train.dtype`)."""
    known = {f.name for f in fields(PPOConfig)}
    return PPOConfig(**{k: v for k, v in cfg.get("ppo", {}).items() if k in known}, method=method, seed=seed,
                     dtype=cfg.get("dtype", "float32"))


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


def train_run(cfg: dict, method: str, seed: int, student_dir: str | Path, teacher_dir: str | Path | None,
              tasks_path: str | Path, index_dir: str | Path, out_dir: str | Path, stop_after: int | None = None,
              tracker=None, log=print) -> list[dict]:
    """Train one (method, seed). `cfg` holds the `train`, `agent` and `rollout` sections.
    `stop_after` ends the process after that many steps of this invocation (tests of resume).
    Under torchrun (WORLD_SIZE > 1) every rank calls this; only rank 0 writes files and calls `tracker`."""
    from memopd.agent.backends import HFBackend, VLLMBackend
    from memopd.agent.evaluate import load_retriever, load_tasks, make_sampling
    from memopd.agent.rollout import AgentConfig, rollout
    from memopd.models import DTYPES, load_model, load_tokenizer
    from memopd.sft.trainer import dist_info, setup_distributed

    tcfg, rcfg = cfg["train"], cfg["rollout"]
    device = setup_distributed()
    rank, world, _ = dist_info()
    if tcfg["batch_tasks"] < world:
        raise ValueError(f"train.batch_tasks {tcfg['batch_tasks']} < {world} ranks: some rank would get no episode")
    torch.manual_seed(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = tcfg.get("dtype", "float32")
    tok = load_tokenizer(student_dir)
    sampling = make_sampling(rcfg)
    sync = None
    if rcfg.get("backend", "hf") == "vllm":  # the engine first: it sizes its memory from what is free
        from memopd.train.weight_sync import WeightSync, colocated_llm

        vcfg = tcfg.get("vllm", {})
        llm = colocated_llm(student_dir, rcfg, vcfg, seed, world)
        sync = WeightSync(llm, sleep=bool(vcfg.get("sleep", False)))
        backend = VLLMBackend(student_dir, tok, sampling, llm=llm)
    # fp32 master weights whatever train.dtype (bf16 autocast computes; pure bf16 parameters would round
    # lr 1e-6 steps away); the reference is the policy's frozen copy, so it is scored exactly like pi_old
    policy = load_model(student_dir, dtype="float32", device=str(device))
    ref = copy.deepcopy(policy).requires_grad_(False)  # frozen at the SFT initialisation
    critic = ValueModel(copy.deepcopy(policy))
    # the frozen teacher stays in train.dtype: inference only (a target distribution, never in a ratio);
    # `ppo` never scores it, so it needs none (its jobs can start before the teacher's SFT ends)
    if method != "ppo" and teacher_dir is None:
        raise ValueError(f"method {method!r} needs a teacher")
    teacher = (load_model(teacher_dir, dtype=dtype, device=str(device)).requires_grad_(False)
               if method != "ppo" else None)
    shard = tcfg.get("shard", "none")
    if shard not in parallel.SHARDING:
        raise ValueError(f"train.shard {shard!r}: choose from {parallel.SHARDING}")
    if shard == "fsdp" and world > 1:  # one rank: a shard is the whole model, the replica path is the same
        policy, ref, critic = (parallel.shard(m, dtype) for m in (policy, ref, critic))
    actor_opt = torch.optim.AdamW(policy.parameters(), lr=tcfg["lr_actor"], weight_decay=0.0)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=tcfg["lr_critic"], weight_decay=0.0)
    pcfg = ppo_config(tcfg, method, seed)
    if sync is None:
        backend = HFBackend(parallel.unwrap(policy), tok, sampling)  # generates inside parallel.gathered

    ckpt, metrics_path = out / "checkpoint", out / "metrics.jsonl"
    start = 0
    if (ckpt / "state.pt").exists():
        start = load_checkpoint(ckpt, policy, critic, actor_opt, critic_opt)
        log(f"resuming {method} seed {seed} at step {start}")
        if rank == 0:  # keep the metrics of the steps the checkpoint covers, drop any written after it
            kept = metrics_path.read_text().splitlines()[:start] if metrics_path.exists() else []
            metrics_path.write_text("".join(line + "\n" for line in kept))
    elif metrics_path.exists() and rank == 0:
        metrics_path.unlink()

    tasks = load_tasks(tasks_path)
    retriever = load_retriever(index_dir)
    agent = AgentConfig.from_dict(cfg["agent"], batch_size=rcfg["batch_size"])
    schedule = task_order(len(tasks), tcfg["steps"], tcfg["batch_tasks"], seed)  # the same on every rank
    history = []
    from tqdm.auto import tqdm

    for step in tqdm(range(start, tcfg["steps"]), desc=f"{method} seed {seed}", initial=start, total=tcfg["steps"],
                     disable=rank != 0):
        t0 = time.perf_counter()
        mine = list(range(rank, tcfg["batch_tasks"], world))  # this rank's positions in the batch
        t_sync = sync.sync(policy) if sync is not None else None
        t1 = time.perf_counter()
        stats: dict = {}
        # hf rollouts: the policy itself samples, whole (gathered if sharded) and in the update's precision
        with (parallel.gathered(policy) if sync is None else nullcontext()), \
                (parallel.autocast(device, dtype) if sync is None else nullcontext()):
            episodes = rollout([tasks[schedule[step][i]] for i in mine], backend, tok, retriever, agent,
                               seed=seed * 1_000_003 + step, progress=False, stats=stats, indices=mine)
        if sync is not None:
            sync.release()
        t2 = time.perf_counter()
        pcfg.seed = seed * 1_000_003 + step
        m = ppo_update(episodes, policy, ref, critic, teacher, actor_opt, critic_opt, pcfg, ids=mine)
        t3 = time.perf_counter()
        m.update(rollout_metrics(episodes))
        m.update({"step": step, "method": method, "seed": seed, "world_size": world, "time/rollout_s": t2 - t1,
                  "time/step_s": t3 - t0})
        if t_sync is not None:
            m["time/sync_s"] = t_sync
        m["tokens_per_s"] = m["tokens/packed"] / max(m["time/update_s"] + m["time/score_s"], 1e-9)
        history.append(m)
        done = step + 1
        if rank == 0:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(m, sort_keys=True) + "\n")
            if tracker is not None:
                tracker(m, step)
        if done % tcfg.get("checkpoint_every", 1) == 0 or done == tcfg["steps"]:  # collective when sharded
            save_checkpoint(ckpt, done, policy, critic, actor_opt, critic_opt, write=rank == 0)
        if world > 1:
            torch.distributed.barrier()  # no rank runs ahead of a checkpoint that may be resumed from
        if stop_after is not None and done - start >= stop_after:
            return history
    # exported in train.dtype (what evaluation and vLLM load); the checkpoint keeps the fp32 master weights
    state = {k: v.to(DTYPES[dtype]) for k, v in parallel.full_state_dict(policy).items()}  # collective if sharded
    if rank == 0:
        parallel.unwrap(policy).save_pretrained(out / "model", state_dict=state, safe_serialization=True)
        tok.save_pretrained(out / "model")
    return history
