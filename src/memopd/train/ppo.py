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

Precision and sharding (`memopd.train.parallel`): policy and critic are fp32 parameters with fp32
AdamW state; with dtype bfloat16 every policy / critic / reference forward runs under bf16 autocast,
the update's and the scoring's alike (one function, `actor_forward`), so the ratio of the first
minibatch is exactly 1. The reference is a frozen copy of the policy in the same precision and sharding
(its KL penalty is exactly 0 at the first step); the frozen teacher stays in `train.dtype` (bf16 at
paper scale) without autocast: inference only, its distribution is a target, never in a ratio.
With FSDP (`parallel.Root` models) every forward and backward is a collective, so each rank runs as
many passes per minibatch as the rank holding most of its episodes (extra ones with a zero loss), and
scoring runs with the full parameters gathered (`parallel.gathered`).
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
from memopd.packing import Packed, pack
from memopd.rce import RCEError, guard
from memopd.records import Episode
from memopd.train.parallel import autocast, call, clip_grad_norm, gathered, is_checkpointed, is_sharded

METHODS = ("ppo", "memopd", "memopd_persistent")


class ValueModel(torch.nn.Module):
    """Critic: a causal-LM backbone (initialised from the SFT student) + a scalar head. The value of
    action token j is read at the position that predicts it (the state before the token)."""

    def __init__(self, lm, layers: int | None = None):
        """`layers`: keep only the first `layers` decoder layers of `lm` (a cheaper critic than the policy;
        same tokenizer and embeddings, the final norm kept); None keeps them all."""
        super().__init__()
        if layers is not None:
            n = len(lm.model.layers)
            if not 1 <= layers <= n:
                raise ValueError(f"train.critic_layers {layers}: the student has {n} decoder layers")
            lm.model.layers = lm.model.layers[:layers]
            lm.config.num_hidden_layers = layers  # caches and masks are sized from the config
            if getattr(lm.config, "layer_types", None):
                lm.config.layer_types = lm.config.layer_types[:layers]
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
    backend: str = "auto"  # memopd.attention: auto picks each pack's fastest exact path
    chunk_size: int = 512
    rce_sample: int = 2  # episodes checked by the RCE guard before each update (0: off)
    dtype: str = "float32"
    seed: int = 0
    vocab: int | None = None  # ids of the OPD KL: len(tokenizer); None: the rows both heads have (losses.shared_vocab)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose from {METHODS}")
        autocast(torch.device("cpu"), self.dtype)  # refuses a dtype training does not support


def _head(model):
    return model.get_output_embeddings()


def actor_forward(lm, p: Packed, backend: str, chunk_size: int, teach_rows: torch.Tensor | None = None,
                  teacher_hidden: torch.Tensor | None = None, teacher_head=None, opd_denom: float | None = None,
                  vocab: int | None = None):
    """The policy on one packed episode: (N,) log-probs and (N,) entropies of the sampled actions, and
    (OPD loss, metrics) at `teach_rows` (the teacher-mask rows of the N actions) when a teacher is
    given, else None; the OPD sum is divided by `opd_denom` (the minibatch's teacher tokens). pi_old,
    the reference and the update all score through this function (under the caller's autocast), so
    their precision paths are the same."""
    dev = next(lm.parameters()).device
    h = packed_hidden(lm, p, backend)
    logp, ent = action_logprobs_entropy(h, _head(lm), p.targets.to(dev), chunk_size)
    opd = None
    if teacher_hidden is not None:
        opd = opd_loss(h[teach_rows.to(dev)], _head(lm), teacher_hidden, teacher_head, chunk_size, opd_denom, vocab)
    return logp, ent, opd


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
def score_batch(episodes: list[Episode], policy, ref, critic, teacher, cfg: PPOConfig,
                ids: list[int] | None = None) -> list[dict]:
    """Behaviour, reference, value and teacher quantities at the sampled action tokens, per episode.
    `ids[e]`: episode e's position in the batch (seeds the teacher-call selection; default e).
    Policy, reference and critic: replicas or sharded (`parallel.Root`, then call it inside
    `parallel.gathered`)."""
    ids = list(range(len(episodes))) if ids is None else ids
    dev = next(policy.parameters()).device
    out = []
    for e, ep in zip(ids, episodes):
        p = pack(ep, teacher=cfg.teacher_select, seed=cfg.seed + e)
        with autocast(dev, cfg.dtype):  # the update's precision path
            old_logp = call(policy, lambda m: actor_forward(m, p, cfg.backend, cfg.chunk_size)[0])
            ref_logp = call(ref, lambda m: actor_forward(m, p, cfg.backend, cfg.chunk_size)[0])
            values = call(critic, lambda m: m.values(p, cfg.backend))
        teach_rows = p.teacher_mask[p.action_index]  # (N,) which action tokens the teacher scores
        teacher_hidden = None
        if cfg.method != "ppo" and teach_rows.any():
            # the matched control scores the same action tokens on the persistent flattening
            tp = p if cfg.method == "memopd" else pack(ep, layout="persistent", teacher=cfg.teacher_select,
                                                       seed=cfg.seed + e)
            # prefix sharing and calls need blocked calls; auto picks among the paths the layout allows
            backend = cfg.backend if tp.block_calls or cfg.backend not in ("prefix_shared", "calls") else "sdpa"
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
        with autocast(next(policy.parameters()).device, cfg.dtype):  # the precision the update computes in
            value = call(policy, lambda m: guard(m, sample, cfg.backend, dtype=cfg.dtype))["max_abs_dlogp"]
    except RCEError as e:
        err = e
    reports = gather((value, None if err is None else str(err)))
    if err is not None:
        raise err
    failed = [m for _, m in reports if m is not None]
    if failed:
        raise RCEError(f"RCE failed on another rank: {failed[0]}")
    return max(v for v, _ in reports)


def minibatch_plan(idx: list[int], local: dict[int, int], owners: list[list[int]],
                   pad: bool) -> list[tuple[int, bool]]:
    """This rank's passes for minibatch `idx` (batch positions): (index into its episodes, real?).
    `local`: this rank's batch position -> index; `owners[r]`: rank r's batch positions. With `pad`
    (FSDP: every forward and backward is a collective) every rank runs as many passes as the rank
    holding most of the minibatch, the extra ones on its first episode with a zero loss (so every rank
    needs one episode: train_run requires batch_tasks >= ranks)."""
    mine = [(local[g], True) for g in idx if g in local]
    if not pad:
        return mine
    most = max(sum(g in set(o) for g in idx) for o in owners)
    return mine + [(0, False)] * (most - len(mine))


MAX_METRICS = ("ppo/ratio_max", "opd/kl_max")  # combined by max; every other per-episode metric adds up


def _combine(into: dict, metrics: dict) -> None:
    """Add one episode's (or rank's) share of a minibatch's metrics: each loss term is already divided
    by the minibatch's token count, so the shares sum to the minibatch value."""
    for k, v in metrics.items():
        v = float(v)
        into[k] = max(into.get(k, v), v) if k in MAX_METRICS else into.get(k, 0.0) + v


def ppo_update(episodes: list[Episode], policy, ref, critic, teacher, actor_opt, critic_opt,
               cfg: PPOConfig, ids: list[int] | None = None) -> dict:
    """One training step on recorded episodes; returns metrics averaged over the minibatches of the
    whole batch (every rank). With several ranks, `episodes` are this rank's share and `ids` their
    positions in the batch (default: the whole batch, in order). Policy, reference and critic are all
    replicas (fp32, the gradients summed by `allreduce_grads`) or all FSDP-sharded `parallel.Root`s.

    Every loss term is a token mean over the minibatch (`losses.aggregate`): PPO, entropy and value
    over its sampled action tokens, OPD over its teacher-mask tokens (1 / sum m_T)."""
    if cfg.backend == "prefix_shared" and (is_checkpointed(policy) or is_checkpointed(critic)):
        # the calls read the prefix's KV cache, which checkpointed layers do not keep (parallel.py)
        raise ValueError("train.ppo.backend prefix_shared cannot run activation-checkpointed models: "
                         "use auto, flex, calls or sdpa, or train.activation_checkpointing: false")
    ids = list(range(len(episodes))) if ids is None else list(ids)
    owners = gather(ids)
    n_total = sum(len(o) for o in owners)
    local = {g: i for i, g in enumerate(ids)}  # batch position -> index into `episodes`
    sharded = is_sharded(policy)
    metrics: dict[str, float] = {}
    with gathered(policy, ref, critic):  # sharded: ranks may score different numbers of episodes
        if cfg.rce_sample:
            metrics["rce/max_abs_dlogp"] = _rce_check(policy, episodes, cfg)
        t0 = time.perf_counter()
        scored = score_batch(episodes, policy, ref, critic, teacher, cfg, ids=ids)
    advantages(scored, episodes, cfg)
    t_score = time.perf_counter() - t0
    mean, std = global_mean_std(torch.cat([s["advantages"] for s in scored]))
    lam = 0.0 if cfg.method == "ppo" else cfg.opd_coef
    # token counts of every episode of the batch (all ranks): the minibatch denominators
    n_act, n_teach = {}, {}
    for part in gather([(g, s["old_logp"].numel(), int(s["teach_rows"].sum()) if s["teacher_hidden"] is not None
                         else 0) for g, s in zip(ids, scored)]):
        for g, a, t in part:
            n_act[g], n_teach[g] = a, t
    dev = next(policy.parameters()).device
    per_mb: list[dict] = []  # this rank's share of each minibatch's metrics
    first_ratio_err = 0.0  # max |ratio - 1| over the first minibatch: 0 when scoring and update agree
    policy.train()
    critic.train()
    order = list(range(n_total))
    rng = random.Random(cfg.seed)  # the same minibatches on every rank
    for epoch in range(cfg.ppo_epochs):
        rng.shuffle(order)
        for mb in range(0, len(order), cfg.minibatch_episodes):
            idx = order[mb : mb + cfg.minibatch_episodes]
            acts, teach_tokens = sum(n_act[g] for g in idx), sum(n_teach[g] for g in idx)
            mb_metrics: dict[str, float] = {}
            actor_opt.zero_grad(set_to_none=True)
            critic_opt.zero_grad(set_to_none=True)
            for i, real in minibatch_plan(idx, local, owners, pad=sharded):  # gradient accumulation
                s = scored[i]
                p = s["packed"]
                teach = bool(lam) and s["teacher_hidden"] is not None and teach_tokens > 0
                with autocast(dev, cfg.dtype):
                    logp, ent, opd = call(policy, lambda m: actor_forward(
                        m, p, cfg.backend, cfg.chunk_size, s["teach_rows"], s["teacher_hidden"] if teach else None,
                        _head(teacher) if teach else None, teach_tokens, cfg.vocab))
                    values = call(critic, lambda m: m.values(p, cfg.backend))
                opd, m_opd = opd if opd is not None else (None, {})
                adv = ((s["advantages"] - mean) / std).to(dev)
                # each term is this episode's token sum over the minibatch's token count (a padding
                # pass of FSDP contributes a zero loss): the shares of all episodes and ranks sum to
                # the minibatch token mean, and the gradient sum over ranks is its gradient
                denom = acts if real else float("inf")
                a_loss, m_a = actor_loss(logp, s["old_logp"], adv, ent, opd if real else None, cfg.clip,
                                         cfg.entropy_coef, lam, denom)
                v_loss, m_v = value_loss(values, s["values"], s["returns"].to(dev), cfg.value_clip, denom)
                (a_loss + v_loss).backward()  # separate models: each gets its own loss's gradient
                if not real:
                    continue
                if epoch == 0 and mb == 0:
                    err = (logp.detach() - s["old_logp"]).exp().sub(1).abs().max().item()
                    first_ratio_err = max(first_ratio_err, err)
                m_a.pop("actor/loss")
                _combine(mb_metrics, {**m_a, **m_v, **m_opd})
            if not sharded:
                allreduce_grads(policy.parameters())
                allreduce_grads(critic.parameters())
            # the norms are of the summed gradients: identical on every rank, so are the steps
            mb_metrics["actor/grad_norm"] = clip_grad_norm(policy.parameters(), cfg.max_grad_norm)
            mb_metrics["critic/grad_norm"] = clip_grad_norm(critic.parameters(), cfg.max_grad_norm)
            actor_opt.step()
            critic_opt.step()
            per_mb.append(mb_metrics)
    policy.eval()
    critic.eval()
    metrics["time/score_s"] = t_score
    metrics["time/update_s"] = time.perf_counter() - t0 - t_score
    mine = {"per_mb": per_mb, "packed": sum(len(s["packed"]) for s in scored),
            "actions": sum(s["old_logp"].numel() for s in scored),
            "reward": sum(float(ep.reward or 0.0) for ep in episodes), "first_ratio_err": first_ratio_err,
            "kl_ref": float(torch.cat([s["kl_ref"] for s in scored]).double().sum())}
    everyone = gather(mine)
    minibatches = []
    for k in range(len(per_mb)):  # every rank ran the same minibatches
        mb = {}
        for r, o in enumerate(everyone):
            share = dict(o["per_mb"][k])
            if r:  # the grad norms are the same on every rank: count them once
                share = {key: v for key, v in share.items() if not key.endswith("grad_norm")}
            _combine(mb, share)
        mb["actor/loss"] = mb.get("ppo/loss", 0.0) - cfg.entropy_coef * mb.get("actor/entropy", 0.0) \
            + lam * mb.get("opd/loss", 0.0)
        minibatches.append(mb)
    for k in sorted({k for mb in minibatches for k in mb}):
        vals = [mb[k] for mb in minibatches if k in mb]
        metrics[k] = sum(vals) / len(vals)
    metrics["ppo/first_ratio_err"] = max(o["first_ratio_err"] for o in everyone)
    metrics["tokens/packed"] = int(sum(o["packed"] for o in everyone))
    metrics["tokens/actions"] = int(sum(o["actions"] for o in everyone))
    metrics["reward/task"] = sum(o["reward"] for o in everyone) / n_total
    metrics["reward/kl_ref"] = sum(o["kl_ref"] for o in everyone) / max(1, metrics["tokens/actions"])
    return metrics
