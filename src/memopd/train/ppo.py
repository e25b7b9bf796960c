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
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from memopd.attention import packed_hidden
from memopd.losses import (action_logprobs_entropy, actor_loss, gae, opd_loss, reference_penalty, token_rewards,
                           value_loss)
from memopd.packing import pack
from memopd.rce import guard
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


@torch.no_grad()
def score_batch(episodes: list[Episode], policy, ref, critic: ValueModel, teacher, cfg: PPOConfig) -> dict:
    """Behaviour, reference, value and teacher quantities at the sampled action tokens, per episode."""
    out = []
    for e, ep in enumerate(episodes):
        p = pack(ep, teacher=cfg.teacher_select, seed=cfg.seed + e)
        targets = p.targets
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
    """Fill rewards, advantages and returns of each scored episode (in place)."""
    for s, ep in zip(scored, episodes):
        n = s["old_logp"].numel()
        score = torch.tensor([float(ep.reward or 0.0)])
        r = token_rewards(score, torch.tensor([n - 1]), s["old_logp"], s["ref_logp"], cfg.beta)
        adv, ret = gae(r, s["values"], torch.zeros(n, dtype=torch.long), cfg.gamma, cfg.lam)
        s.update(rewards=r, advantages=adv, returns=ret, kl_ref=reference_penalty(s["old_logp"], s["ref_logp"]))


def ppo_update(episodes: list[Episode], policy, ref, critic: ValueModel, teacher, actor_opt, critic_opt,
               cfg: PPOConfig) -> dict:
    """One training step on recorded episodes; returns averaged metrics."""
    rng = random.Random(cfg.seed)
    metrics: dict[str, float] = {}
    if cfg.rce_sample:
        sample = rng.sample(episodes, min(cfg.rce_sample, len(episodes)))
        r = guard(policy, sample, cfg.backend, dtype=cfg.dtype)  # raises RCEError naming episode and call
        metrics["rce/max_abs_dlogp"] = r["max_abs_dlogp"]
    t0 = time.perf_counter()
    scored = score_batch(episodes, policy, ref, critic, teacher, cfg)
    advantages(scored, episodes, cfg)
    t_score = time.perf_counter() - t0
    all_adv = torch.cat([s["advantages"] for s in scored])
    mean, std = all_adv.mean(), all_adv.std().clamp_min(1e-6) if all_adv.numel() > 1 else torch.tensor(1.0)
    lam = 0.0 if cfg.method == "ppo" else cfg.opd_coef
    sums: dict[str, list[float]] = {}
    policy.train()
    critic.train()
    order = list(range(len(episodes)))
    for _ in range(cfg.ppo_epochs):
        rng.shuffle(order)
        for mb in range(0, len(order), cfg.minibatch_episodes):
            idx = order[mb : mb + cfg.minibatch_episodes]
            actor_opt.zero_grad(set_to_none=True)
            critic_opt.zero_grad(set_to_none=True)
            a_total = c_total = 0.0
            for i in idx:  # gradient accumulation over the episodes of the minibatch
                s = scored[i]
                p = s["packed"]
                h = packed_hidden(policy, p, cfg.backend)
                logp, ent = action_logprobs_entropy(h, _head(policy), p.targets, cfg.chunk_size)
                opd = None
                m_opd = {}
                if lam and s["teacher_hidden"] is not None:
                    opd, m_opd = opd_loss(h[s["teach_rows"]], _head(policy), s["teacher_hidden"], _head(teacher),
                                          cfg.chunk_size)
                adv = (s["advantages"] - mean) / std
                a_loss, m_a = actor_loss(logp, s["old_logp"], adv, ent, opd, cfg.clip, cfg.entropy_coef, lam)
                v_loss, m_v = value_loss(critic.values(p, cfg.backend), s["values"], s["returns"], clip=cfg.value_clip)
                (a_loss / len(idx)).backward()
                (v_loss / len(idx)).backward()
                a_total += a_loss.item()
                c_total += v_loss.item()
                for k, v in {**m_a, **m_v, **m_opd}.items():
                    sums.setdefault(k, []).append(float(v))
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
    metrics["tokens/packed"] = int(sum(len(s["packed"]) for s in scored))
    metrics.update({k: sum(v) / len(v) for k, v in sums.items()})
    metrics["reward/task"] = sum(float(ep.reward or 0.0) for ep in episodes) / len(episodes)
    metrics["reward/kl_ref"] = torch.cat([s["kl_ref"] for s in scored]).mean().item()
    metrics["tokens/actions"] = int(sum(s["old_logp"].numel() for s in scored))
    return metrics
