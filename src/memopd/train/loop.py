"""The PPO / MemOPD training run: roll out with the current policy, update on exact packed states,
checkpoint, resume.

One run = one (method, seed). Everything that could differ between methods is fixed by the seed
alone (task order, rollout sampling seeds, minibatch order), so `ppo`, `memopd` and
`memopd_persistent` with the same seed see the same data order from the same SFT initialisation.

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
from dataclasses import fields
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from memopd.train.ppo import PPOConfig, ValueModel, ppo_update


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state()}


def save_checkpoint(path: Path, step: int, policy, critic, actor_opt, critic_opt) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in policy.state_dict().items()}, tmp / "policy.safetensors")
    save_file({k: v.contiguous() for k, v in critic.state_dict().items()}, tmp / "critic.safetensors")
    torch.save({"step": torch.tensor(step), "actor_opt": actor_opt.state_dict(), "critic_opt": critic_opt.state_dict(),
                **_rng_state()}, tmp / "state.pt")
    if path.exists():
        import shutil

        shutil.rmtree(path)
    tmp.replace(path)


def load_checkpoint(path: Path, policy, critic, actor_opt, critic_opt) -> int:
    policy.load_state_dict(load_file(path / "policy.safetensors"), strict=False)
    critic.load_state_dict(load_file(path / "critic.safetensors"), strict=False)
    state = torch.load(path / "state.pt", weights_only=True)
    actor_opt.load_state_dict(state["actor_opt"])
    critic_opt.load_state_dict(state["critic_opt"])
    torch.set_rng_state(state["torch"])
    return int(state["step"])


def ppo_config(cfg: dict, method: str, seed: int) -> PPOConfig:
    known = {f.name for f in fields(PPOConfig)}
    return PPOConfig(**{k: v for k, v in cfg.get("ppo", {}).items() if k in known}, method=method, seed=seed)


def task_order(n_tasks: int, steps: int, batch: int, seed: int) -> list[list[int]]:
    """The tasks of every step: a seeded permutation, cycled (identical for every method)."""
    rng = random.Random(seed)
    order: list[int] = []
    while len(order) < steps * batch:
        perm = list(range(n_tasks))
        rng.shuffle(perm)
        order += perm
    return [order[s * batch : (s + 1) * batch] for s in range(steps)]


def train_run(cfg: dict, method: str, seed: int, student_dir: str | Path, teacher_dir: str | Path,
              tasks_path: str | Path, index_dir: str | Path, out_dir: str | Path, stop_after: int | None = None,
              tracker=None, log=print) -> list[dict]:
    """Train one (method, seed). `cfg` holds the `train`, `agent` and `rollout` sections.
    `stop_after` ends the process after that many steps of this invocation (tests of resume)."""
    from memopd.agent.backends import HFBackend, Sampling
    from memopd.agent.evaluate import load_retriever, load_tasks
    from memopd.agent.rollout import AgentConfig, rollout
    from memopd.models import load_model, load_tokenizer

    tcfg = cfg["train"]
    torch.manual_seed(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = tcfg.get("dtype", "float32")
    policy = load_model(student_dir, dtype=dtype)
    ref = copy.deepcopy(policy).requires_grad_(False)  # frozen at the SFT initialisation
    critic = ValueModel(copy.deepcopy(policy))
    teacher = load_model(teacher_dir, dtype=dtype).requires_grad_(False)
    tok = load_tokenizer(student_dir)
    actor_opt = torch.optim.AdamW(policy.parameters(), lr=tcfg["lr_actor"], weight_decay=0.0)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=tcfg["lr_critic"], weight_decay=0.0)
    pcfg = ppo_config(tcfg, method, seed)

    ckpt, metrics_path = out / "checkpoint", out / "metrics.jsonl"
    start = 0
    if (ckpt / "state.pt").exists():
        start = load_checkpoint(ckpt, policy, critic, actor_opt, critic_opt)
        log(f"resuming {method} seed {seed} at step {start}")
        # keep the metrics of the steps the checkpoint covers, drop any written after it
        kept = metrics_path.read_text().splitlines()[:start] if metrics_path.exists() else []
        metrics_path.write_text("".join(line + "\n" for line in kept))
    elif metrics_path.exists():
        metrics_path.unlink()

    tasks = load_tasks(tasks_path)
    retriever = load_retriever(index_dir)
    agent = AgentConfig.from_dict(cfg["agent"], batch_size=cfg["rollout"]["batch_size"])
    sampling = Sampling(**{k: cfg["rollout"][k] for k in ("temperature", "top_p", "top_k", "max_new_tokens")
                           if k in cfg["rollout"]})
    schedule = task_order(len(tasks), tcfg["steps"], tcfg["batch_tasks"], seed)
    history = []
    from tqdm.auto import tqdm

    for step in tqdm(range(start, tcfg["steps"]), desc=f"{method} seed {seed}", initial=start, total=tcfg["steps"]):
        t0 = time.perf_counter()
        batch = [tasks[i] for i in schedule[step]]
        stats: dict = {}
        episodes = rollout(batch, HFBackend(policy, tok, sampling), tok, retriever, agent,
                           seed=seed * 1_000_003 + step, progress=False, stats=stats)
        t1 = time.perf_counter()
        pcfg.seed = seed * 1_000_003 + step
        m = ppo_update(episodes, policy, ref, critic, teacher, actor_opt, critic_opt, pcfg)
        t2 = time.perf_counter()
        m.update({"step": step, "method": method, "seed": seed, "time/rollout_s": t1 - t0,
                  "time/step_s": t2 - t0, "episodes": len(episodes),
                  "reward/f1": sum(e.metrics["f1"] for e in episodes) / len(episodes),
                  "reward/em": sum(e.metrics["em"] for e in episodes) / len(episodes),
                  "rollout/calls_per_episode": sum(len(e.invocations) for e in episodes) / len(episodes),
                  "rollout/invalid_rate": sum(e.metrics["invalid_actions"] for e in episodes)
                  / max(1, sum(len(e.invocations) for e in episodes))})
        m["tokens_per_s"] = m["tokens/packed"] / max(m["time/update_s"] + m["time/score_s"], 1e-9)
        with open(metrics_path, "a") as f:
            f.write(json.dumps(m, sort_keys=True) + "\n")
        if tracker is not None:
            tracker(m, step)
        history.append(m)
        done = step + 1
        if done % tcfg.get("checkpoint_every", 1) == 0 or done == tcfg["steps"]:
            save_checkpoint(ckpt, done, policy, critic, actor_opt, critic_opt)
        if stop_after is not None and done - start >= stop_after:
            return history
    policy.save_pretrained(out / "model", safe_serialization=True)
    tok.save_pretrained(out / "model")
    return history
