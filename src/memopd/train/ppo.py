"""One PPO / MemOPD update on a batch of recorded episodes, all scoring on exact packed states.

    episodes -> pack -> (no grad, one pass per model, at action positions only)
        pi_old log-probs, reference log-probs, critic values, teacher hidden states
    -> rewards: task score on each episode's last action token - beta [l_old - l_ref]_+ on every action
    -> GAE over the ordered sampled actions (context-only positions skipped)
    -> PPO epochs over minibatches of episodes:
         actor  = clipped PPO - alpha * entropy + lambda * OPD(teacher-mask positions)
         critic = clipped value loss

Methods (everything else identical): `ppo` (lambda = 0), `memopd` (teacher scored on the exact
packed state), `memopd_persistent` (matched control: the teacher's distribution comes from the
persistent-history flattening at the same action tokens; the student side is unchanged).

Several ranks (torchrun, `memopd.sft.trainer.setup_distributed`): each rank holds a replica of every
model and its own share of the batch's episodes (`ids`: their positions in the batch). The minibatch
order is drawn over the whole batch from the seed, so every rank knows every minibatch; a rank
backpropagates the episodes of the minibatch it holds (possibly none), each divided by the *global*
minibatch size, and the gradients are summed over ranks before clipping. Advantages are normalised
with the batch's global mean and std. So world size W gives the update of one process on the same
episodes, up to the order of floating-point sums.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from memopd.attention import packed_hidden
from memopd.losses import (action_logprobs_entropy, actor_loss, gae, opd_loss, reference_penalty, token_rewards,
                           value_loss)
from memopd.packing import pack
from memopd.rce import RCEError, guard
from memopd.records import Episode

METHODS = ("ppo", "memopd", "memopd_persistent")


class ValueModel(torch.nn.Module):
    """Critic: a causal-LM backbone (initialised from the SFT student) + a scalar head. The value of
    action token j is read at the position that predicts it (the state before the token)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        self.head = torch.nn.Linear(lm.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    @property
    def config(self):
        return self.lm.config

    def values(self, packed, backend: str) -> torch.Tensor:
        return self.head(packed_hidden(self.lm, packed, backend)).squeeze(-1).float()


@dataclass
class PPOConfig:
    method: str = "memopd"
    opd_coef: float = 0.02  # lambda (paper: 0.02); forced to 0 for `ppo`
    clip: float = 0.2
    value_clip: float = 0.2
    entropy_coef: float = 0.0
    beta: float = 0.001  # reference penalty weight
    gamma: float = 1.0
    lam: float = 1.0
    ppo_epochs: int = 1
    minibatch_episodes: int = 4
    max_grad_norm: float = 1.0
    teacher_select: object = "all"  # which calls the teacher scores (packing.select_teacher_calls)
    backend: str = "sdpa"
    chunk_size: int = 512
    rce_sample: int = 2  # episodes checked by the RCE guard before each update (0: off)
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose from {METHODS}")


def _head(model):
    return model.get_output_embeddings()


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def gather(obj) -> list:
    """Every rank's `obj`, in rank order ([obj] in a single process). Small Python objects only."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def allreduce_grads(params) -> None:
    """Sum the gradients of `params` over ranks, in place. A rank that held none of a minibatch's
    episodes contributes zeros (a None gradient would make AdamW skip the parameter there)."""
    if world_size() == 1:
        return
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for w in [dist.all_reduce(p.grad, async_op=True) for p in params]:
        w.wait()


def global_mean_std(x: torch.Tensor) -> tuple[float, float]:
    """Mean and unbiased std of the concatenation of every rank's (N_r,) `x` (two passes, float64)."""
    x = x.detach().double().cpu()
    parts = gather((x.numel(), x.sum().item()))
    n = sum(k for k, _ in parts)
    mean = sum(t for _, t in parts) / max(n, 1)
    sq = sum(gather(((x - mean) ** 2).sum().item()))
    std = (sq / (n - 1)) ** 0.5 if n > 1 else 1.0
    return mean, max(std, 1e-6)


@torch.no_grad()
def score_batch(episodes: list[Episode], policy, ref, critic: ValueModel, teacher, cfg: PPOConfig,
                ids: list[int] | None = None) -> list[dict]:
    """Behaviour, reference, value and teacher quantities at the sampled action tokens, per episode.
    `ids[e]`: episode e's position in the batch (seeds the teacher-call selection; default e)."""
    ids = list(range(len(episodes))) if ids is None else ids
    dev = next(policy.parameters()).device
    out = []
    for e, ep in zip(ids, episodes):
        p = pack(ep, teacher=cfg.teacher_select, seed=cfg.seed + e)
        targets = p.targets.to(dev)
        old_logp, _ = action_logprobs_entropy(packed_hidden(policy, p, cfg.backend), _head(policy), targets, cfg.chunk_size)
        ref_logp, _ = action_logprobs_entropy(packed_hidden(ref, p, cfg.backend), _head(ref), targets, cfg.chunk_size)
        values = critic.values(p, cfg.backend)
        teach_rows = p.teacher_mask[p.action_index]  # (N,) which action tokens the teacher scores
        teacher_hidden = None
        if cfg.method != "ppo" and teach_rows.any():
            # the matched control scores the same action tokens on the persistent flattening
            tp = p if cfg.method == "memopd" else pack(ep, layout="persistent", teacher=cfg.teacher_select,
                                                       seed=cfg.seed + e)
            backend = cfg.backend if cfg.method == "memopd" else "sdpa"  # prefix sharing needs blocked calls
            teacher_hidden = packed_hidden(teacher, tp, backend, index=tp.pred_index[teach_rows])
        out.append({"packed": p, "old_logp": old_logp, "ref_logp": ref_logp, "values": values,
                    "teach_rows": teach_rows, "teacher_hidden": teacher_hidden})
    return out


def advantages(scored: list[dict], episodes: list[Episode], cfg: PPOConfig) -> None:
    """Fill rewards, advantages and returns of each scored episode (in place, on the CPU: GAE is a
    sequential scan over single elements, one device sync each on a GPU)."""
    for s, ep in zip(scored, episodes):
        old, ref, values = s["old_logp"].cpu(), s["ref_logp"].cpu(), s["values"].cpu()
        n = old.numel()
        score = torch.tensor([float(ep.reward or 0.0)])
        r = token_rewards(score, torch.tensor([n - 1]), old, ref, cfg.beta)
        adv, ret = gae(r, values, torch.zeros(n, dtype=torch.long), cfg.gamma, cfg.lam)
        s.update(rewards=r, advantages=adv, returns=ret, kl_ref=reference_penalty(old, ref))


def _rce_check(policy, episodes: list[Episode], cfg: PPOConfig) -> float:
    """The RCE guard on a seeded sample of this rank's episodes; every rank stops if any rank fails
    (a rank raising alone would leave the others waiting in the next collective)."""
    sample = random.Random(cfg.seed).sample(episodes, min(cfg.rce_sample, len(episodes)))
    err, value = None, 0.0
    try:
        value = guard(policy, sample, cfg.backend, dtype=cfg.dtype)["max_abs_dlogp"]  # names episode and call
    except RCEError as e:
        err = e
    reports = gather((value, None if err is None else str(err)))
    if err is not None:
        raise err
    failed = [m for _, m in reports if m is not None]
    if failed:
        raise RCEError(f"RCE failed on another rank: {failed[0]}")
    return max(v for v, _ in reports)


def ppo_update(episodes: list[Episode], policy, ref, critic: ValueModel, teacher, actor_opt, critic_opt,
               cfg: PPOConfig, ids: list[int] | None = None) -> dict:
    """One training step on recorded episodes; returns metrics averaged over the whole batch (every
    rank). With several ranks, `episodes` are this rank's share and `ids` their positions in the batch
    (default: the whole batch, in order)."""
    ids = list(range(len(episodes))) if ids is None else list(ids)
    n_total = sum(gather(len(ids)))
    local = {g: i for i, g in enumerate(ids)}  # batch position -> index into `episodes`
    metrics: dict[str, float] = {}
    if cfg.rce_sample:
        metrics["rce/max_abs_dlogp"] = _rce_check(policy, episodes, cfg)
    t0 = time.perf_counter()
    scored = score_batch(episodes, policy, ref, critic, teacher, cfg, ids=ids)
    advantages(scored, episodes, cfg)
    t_score = time.perf_counter() - t0
    mean, std = global_mean_std(torch.cat([s["advantages"] for s in scored]))
    lam = 0.0 if cfg.method == "ppo" else cfg.opd_coef
    dev = next(policy.parameters()).device
    sums: dict[str, list[float]] = {}
    policy.train()
    critic.train()
    order = list(range(n_total))
    rng = random.Random(cfg.seed)  # the same minibatches on every rank
    for _ in range(cfg.ppo_epochs):
        rng.shuffle(order)
        for mb in range(0, len(order), cfg.minibatch_episodes):
            idx = order[mb : mb + cfg.minibatch_episodes]
            actor_opt.zero_grad(set_to_none=True)
            critic_opt.zero_grad(set_to_none=True)
            for i in (local[g] for g in idx if g in local):  # gradient accumulation over this rank's episodes
                s = scored[i]
                p = s["packed"]
                h = packed_hidden(policy, p, cfg.backend)
                logp, ent = action_logprobs_entropy(h, _head(policy), p.targets.to(dev), cfg.chunk_size)
                opd = None
                m_opd = {}
                if lam and s["teacher_hidden"] is not None:
                    opd, m_opd = opd_loss(h[s["teach_rows"].to(dev)], _head(policy), s["teacher_hidden"],
                                          _head(teacher), cfg.chunk_size)
                adv = ((s["advantages"] - mean) / std).to(dev)
                a_loss, m_a = actor_loss(logp, s["old_logp"], adv, ent, opd, cfg.clip, cfg.entropy_coef, lam)
                v_loss, m_v = value_loss(critic.values(p, cfg.backend), s["values"], s["returns"].to(dev),
                                         clip=cfg.value_clip)
                # divided by the global minibatch size: the sum over ranks is the minibatch mean
                (a_loss / len(idx)).backward()
                (v_loss / len(idx)).backward()
                for k, v in {**m_a, **m_v, **m_opd}.items():
                    sums.setdefault(k, []).append(float(v))
            allreduce_grads(policy.parameters())
            allreduce_grads(critic.parameters())
            # the norms are of the summed gradients: identical on every rank, so are the steps
            sums.setdefault("actor/grad_norm", []).append(
                float(torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)))
            sums.setdefault("critic/grad_norm", []).append(
                float(torch.nn.utils.clip_grad_norm_(critic.parameters(), cfg.max_grad_norm)))
            actor_opt.step()
            critic_opt.step()
    policy.eval()
    critic.eval()
    metrics["time/score_s"] = t_score
    metrics["time/update_s"] = time.perf_counter() - t0 - t_score
    mine = {"sums": sums, "packed": sum(len(s["packed"]) for s in scored),
            "actions": sum(s["old_logp"].numel() for s in scored),
            "reward": sum(float(ep.reward or 0.0) for ep in episodes),
            "kl_ref": float(torch.cat([s["kl_ref"] for s in scored]).double().sum())}
    everyone = gather(mine)
    allsums: dict[str, list[float]] = {}
    for r, o in enumerate(everyone):
        for k, v in o["sums"].items():
            if k.endswith("grad_norm") and r:  # the same value on every rank: count it once
                continue
            allsums.setdefault(k, []).extend(v)
    metrics.update({k: sum(v) / len(v) for k, v in allsums.items()})
    metrics["tokens/packed"] = int(sum(o["packed"] for o in everyone))
    metrics["tokens/actions"] = int(sum(o["actions"] for o in everyone))
    metrics["reward/task"] = sum(o["reward"] for o in everyone) / n_total
    metrics["reward/kl_ref"] = sum(o["kl_ref"] for o in everyone) / max(1, metrics["tokens/actions"])
    return metrics
