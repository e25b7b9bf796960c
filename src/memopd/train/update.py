"""One PPO / MemOPD update on a batch of recorded episodes, all scoring on exact packed states.

    episodes -> pack -> (no grad, one pass per model, at action positions only)
        pi_old log-probs, reference log-probs, critic values, teacher hidden states
    -> rewards: task score on each episode's last action token - beta [l_old - l_ref]_+ on every action
    -> GAE over the ordered sampled actions (context-only positions skipped), normalised over the batch
    -> PPO epochs over minibatches of episodes:
         actor  = clipped PPO - alpha * entropy + lambda * OPD(teacher-mask positions)
         critic = clipped value loss
    -> metrics: each minibatch's shares summed over episodes and ranks, then averaged over minibatches

`ppo_update` is that pipeline: `score_batch` -> `episode_targets`, `normalised` -> `train_epochs` over
`batching.minibatch_schedule` (`minibatch_step`, `episode_backward`) -> `batching.reduce_metrics`.

Methods (everything else identical): `ppo` (lambda = 0), `memopd` (teacher scored on the exact
packed state), `memopd_persistent` (matched control: the teacher's distribution comes from the
persistent-history flattening at the same action tokens; the student side is unchanged).

Several ranks (torchrun, `memopd.dist.setup_distributed`): each rank holds a replica of every
model and its own share of the batch's episodes (`ids`: their positions in the batch). The minibatch
order is drawn over the whole batch from the seed, so every rank knows every minibatch; a rank
backpropagates the episodes of the minibatch it holds (possibly none), each divided by the *global*
minibatch size, and the gradients are summed over ranks before clipping. Advantages are normalised
with the batch's global mean and std. So world size W gives the update of one process on the same
episodes, up to the order of floating-point sums.

Precision and sharding (`memopd.parallel`): policy and critic are fp32 parameters with fp32
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
from dataclasses import dataclass, replace

import torch

from memopd.attention import packed_hidden
from memopd.dist import allreduce_grads, gather, global_mean_std
from memopd.losses import (action_logprobs_entropy, actor_loss, gae, opd_loss, reference_penalty, token_rewards,
                           value_loss)
from memopd.methods import method as method_spec
from memopd.packing import Packed, pack
from memopd.parallel import autocast, call, check_backend, clip_grad_norm, gathered, is_checkpointed, is_sharded
from memopd.rce import RCEError, guard
from memopd.records import Episode
from memopd.train.batching import (BatchLayout, Minibatch, RankShare, combine, minibatch_plan, minibatch_schedule,
                                   reduce_metrics, token_counts)



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
    # lambda of the OPD term (config key train.ppo.opd_coef; paper: 0.02); 0 for a method without a teacher
    opd_lambda: float = 0.02
    clip: float = 0.2
    value_clip: float = 0.2
    entropy_coef: float = 0.0
    beta: float = 0.001  # reference penalty weight
    gamma: float = 1.0
    gae_lambda: float = 1.0  # config key train.ppo.lam
    ppo_epochs: int = 1
    minibatch_episodes: int = 4
    max_grad_norm: float = 1.0
    teacher_select: object = "all"  # which calls the teacher scores (packing.select_teacher_calls)
    attention: str = "auto"  # the attention path (config key train.ppo.backend): auto picks each pack's fastest exact one
    chunk_size: int = 512
    rce_sample: int = 2  # episodes checked by the RCE guard before each update (0: off)
    dtype: str = "float32"
    seed: int = 0
    vocab: int | None = None  # ids of the OPD KL: len(tokenizer); None: the rows both heads have (losses.shared_vocab)

    def __post_init__(self):
        method_spec(self.method)  # refuses an unknown method, naming the known ones
        autocast(torch.device("cpu"), self.dtype)  # refuses a dtype training does not support
        if not method_spec(self.method).needs_teacher:  # the config's lambda is shared by the run list's methods
            self.opd_lambda = 0.0


def _head(model):
    return model.get_output_embeddings()


def actor_forward(lm, packed: Packed, backend: str, chunk_size: int, teach_rows: torch.Tensor | None = None,
                  teacher_hidden: torch.Tensor | None = None, teacher_head=None, opd_denom: float | None = None,
                  vocab: int | None = None):
    """The policy on one packed episode: (N,) log-probs and (N,) entropies of the sampled actions, and
    (OPD loss, metrics) at `teach_rows` (the teacher-mask rows of the N actions) when a teacher is
    given, else None; the OPD sum is divided by `opd_denom` (the minibatch's teacher tokens). pi_old,
    the reference and the update all score through this function (under the caller's autocast), so
    their precision paths are the same."""
    dev = next(lm.parameters()).device
    hidden = packed_hidden(lm, packed, backend)  # (N, H) at the positions predicting the sampled tokens
    logp, entropy = action_logprobs_entropy(hidden, _head(lm), packed.targets.to(dev), chunk_size)
    opd = None
    if teacher_hidden is not None:
        opd = opd_loss(hidden[teach_rows.to(dev)], _head(lm), teacher_hidden, teacher_head, chunk_size, opd_denom,
                       vocab)
    return logp, entropy, opd


@dataclass(frozen=True)
class ScoredEpisode:
    """What scoring measured on one episode's N sampled action tokens, without gradient."""
    packed: Packed
    old_logp: torch.Tensor  # (N,) log pi_old (the behaviour policy)
    ref_logp: torch.Tensor  # (N,) log pi_ref (the frozen reference)
    values: torch.Tensor  # (N,) critic values at the positions that predict the tokens
    teach_rows: torch.Tensor  # (N,) bool: the tokens the teacher scores
    teacher_hidden: torch.Tensor | None  # (T, H_T) teacher hidden states at those T tokens; None: no teacher

    @property
    def actions(self) -> int:
        return self.old_logp.numel()

    @property
    def teacher_tokens(self) -> int:
        return int(self.teach_rows.sum()) if self.teacher_hidden is not None else 0


@dataclass(frozen=True)
class Targets:
    """An episode's advantages, value targets and reference penalties, (N,) each, on the CPU."""
    advantages: torch.Tensor  # GAE; `normalised` standardises them over the batch
    returns: torch.Tensor  # GAE advantages + V_old
    kl_ref: torch.Tensor  # [l_old - l_ref]_+


@torch.no_grad()
def score_episode(episode: Episode, pos: int, policy, ref, critic, teacher, cfg: PPOConfig) -> ScoredEpisode:
    """Behaviour, reference, value and teacher quantities at the sampled action tokens of the episode at
    batch position `pos` (which seeds its teacher-call selection)."""
    dev = next(policy.parameters()).device
    packed = pack(episode, teacher=cfg.teacher_select, seed=cfg.seed + pos)
    with autocast(dev, cfg.dtype):  # the update's precision path
        old_logp = call(policy, lambda m: actor_forward(m, packed, cfg.attention, cfg.chunk_size)[0])
        ref_logp = call(ref, lambda m: actor_forward(m, packed, cfg.attention, cfg.chunk_size)[0])
        values = call(critic, lambda m: m.values(packed, cfg.attention))
    teach_rows = packed.teacher_mask[packed.action_index]
    teacher_hidden = None
    if method_spec(cfg.method).needs_teacher and teach_rows.any():
        teacher_hidden = teacher_states(teacher, episode, packed, teach_rows, pos, cfg)
    return ScoredEpisode(packed, old_logp, ref_logp, values, teach_rows, teacher_hidden)


def teacher_states(teacher, episode: Episode, packed: Packed, teach_rows: torch.Tensor, pos: int,
                   cfg: PPOConfig) -> torch.Tensor:
    """(T, H_T) teacher hidden states predicting the T action tokens of `teach_rows`: on the exact packed
    state (memopd, memopd_self), or on the persistent-history flattening at the same tokens (memopd_persistent)."""
    exact = method_spec(cfg.method).teacher_state == "exact"
    teacher_pack = packed if exact else pack(episode, layout="persistent", teacher=cfg.teacher_select, seed=cfg.seed + pos)
    # prefix sharing and calls need blocked calls; auto picks among the paths the layout allows
    backend = cfg.attention if teacher_pack.block_calls or cfg.attention not in ("prefix_shared", "calls") else "sdpa"
    return packed_hidden(teacher, teacher_pack, backend, index=teacher_pack.pred_index[teach_rows])


def score_batch(episodes: list[Episode], policy, ref, critic, teacher, cfg: PPOConfig,
                ids: list[int] | None = None) -> list[ScoredEpisode]:
    """`score_episode` of every episode; `ids[e]`: episode e's position in the batch (default e).
    Policy, reference and critic: replicas or sharded (`parallel.Root`, then call it inside
    `parallel.gathered`)."""
    ids = list(range(len(episodes))) if ids is None else ids
    return [score_episode(ep, pos, policy, ref, critic, teacher, cfg) for pos, ep in zip(ids, episodes)]


def episode_targets(scored: ScoredEpisode, reward: float, cfg: PPOConfig) -> Targets:
    """Rewards (the task score on the last action token, - beta [l_old - l_ref]_+ on every one), GAE
    advantages and returns of one episode, on the CPU: GAE is a sequential scan over single elements,
    one device sync each on a GPU."""
    old, ref, values = scored.old_logp.cpu(), scored.ref_logp.cpu(), scored.values.cpu()
    n_actions = old.numel()
    score = torch.tensor([reward])
    rewards = token_rewards(score, torch.tensor([n_actions - 1]), old, ref, cfg.beta)
    advantages, returns = gae(rewards, values, torch.zeros(n_actions, dtype=torch.long), cfg.gamma, cfg.gae_lambda)
    return Targets(advantages, returns, reference_penalty(old, ref))


def normalised(targets: list[Targets]) -> list[Targets]:
    """Advantages standardised with the mean and std of the whole batch (every rank's episodes)."""
    mean, std = global_mean_std(torch.cat([target.advantages for target in targets]))
    return [replace(target, advantages=(target.advantages - mean) / std) for target in targets]


def _rce_check(policy, episodes: list[Episode], cfg: PPOConfig) -> float:
    """The RCE guard on a seeded sample of this rank's episodes; every rank stops if any rank fails
    (a rank raising alone would leave the others waiting in the next collective)."""
    sample = random.Random(cfg.seed).sample(episodes, min(cfg.rce_sample, len(episodes)))
    err, value = None, 0.0
    try:
        with autocast(next(policy.parameters()).device, cfg.dtype):  # the precision the update computes in
            value = call(policy, lambda m: guard(m, sample, cfg.attention, dtype=cfg.dtype))["max_abs_dlogp"]
    except RCEError as e:
        err = e
    reports = gather((value, None if err is None else str(err)))
    if err is not None:
        raise err
    failed = [m for _, m in reports if m is not None]
    if failed:
        raise RCEError(f"RCE failed on another rank: {failed[0]}")
    return max(v for v, _ in reports)


@dataclass(frozen=True)
class Models:
    """The update's models: policy and critic train with their optimizers; the teacher is frozen (None: ppo)."""
    policy: torch.nn.Module
    critic: torch.nn.Module
    teacher: torch.nn.Module | None
    actor_opt: torch.optim.Optimizer
    critic_opt: torch.optim.Optimizer


def episode_backward(scored: ScoredEpisode, target: Targets, mb: Minibatch, real: bool, models: Models,
                     cfg: PPOConfig) -> tuple[torch.Tensor, dict]:
    """Backpropagate one episode's share of the minibatch's actor and critic losses; its (N,) log-probs and
    metrics. `real` False: an FSDP padding pass, run for its collectives with a zero loss."""
    dev = next(models.policy.parameters()).device
    packed = scored.packed
    teach = bool(cfg.opd_lambda) and scored.teacher_hidden is not None and mb.teacher_tokens > 0
    with autocast(dev, cfg.dtype):
        logp, entropy, opd = call(models.policy, lambda m: actor_forward(
            m, packed, cfg.attention, cfg.chunk_size, scored.teach_rows, scored.teacher_hidden if teach else None,
            _head(models.teacher) if teach else None, mb.teacher_tokens, cfg.vocab))
        values = call(models.critic, lambda m: m.values(packed, cfg.attention))
    opd, opd_metrics = opd if opd is not None else (None, {})
    # each term is this episode's token sum over the minibatch's token count (a padding pass contributes a
    # zero loss): the shares of all episodes and ranks sum to the minibatch token mean, and the gradient
    # sum over ranks is its gradient
    denom = mb.actions if real else float("inf")
    a_loss, a_metrics = actor_loss(logp, scored.old_logp, target.advantages.to(dev), entropy, opd if real else None,
                                   cfg.clip, cfg.entropy_coef, cfg.opd_lambda, denom)
    v_loss, v_metrics = value_loss(values, scored.values, target.returns.to(dev), cfg.value_clip, denom)
    (a_loss + v_loss).backward()  # separate models: each gets its own loss's gradient
    return logp.detach(), {**a_metrics, **v_metrics, **opd_metrics}


def minibatch_step(mb: Minibatch, scored: list[ScoredEpisode], targets: list[Targets], layout: BatchLayout,
                   models: Models, cfg: PPOConfig) -> tuple[dict, float]:
    """One optimizer step of policy and critic on `mb`: this rank's episodes accumulate gradients, which are
    summed over ranks and clipped. This rank's share of the metrics, and max |ratio - 1| of its episodes."""
    metrics: dict[str, float] = {}
    ratio_err = 0.0
    sharded = is_sharded(models.policy)
    models.actor_opt.zero_grad(set_to_none=True)
    models.critic_opt.zero_grad(set_to_none=True)
    for i, real in minibatch_plan(mb.episodes, layout.local, layout.owners, pad=sharded):
        logp, episode_metrics = episode_backward(scored[i], targets[i], mb, real, models, cfg)
        if real:
            ratio_err = max(ratio_err, (logp - scored[i].old_logp).exp().sub(1).abs().max().item())
            combine(metrics, episode_metrics)
    if not sharded:
        allreduce_grads(models.policy.parameters())
        allreduce_grads(models.critic.parameters())
    # the norms are of the summed gradients: identical on every rank, so are the steps
    metrics["actor/grad_norm"] = clip_grad_norm(models.policy.parameters(), cfg.max_grad_norm)
    metrics["critic/grad_norm"] = clip_grad_norm(models.critic.parameters(), cfg.max_grad_norm)
    models.actor_opt.step()
    models.critic_opt.step()
    return metrics, ratio_err


def train_epochs(schedule: list[list[Minibatch]], scored: list[ScoredEpisode], targets: list[Targets],
                 layout: BatchLayout, models: Models, cfg: PPOConfig) -> tuple[list[dict], float]:
    """Every minibatch step of the schedule: this rank's share of each minibatch's metrics, and max |ratio - 1|
    over the first minibatch (0 when scoring and update compute the same)."""
    per_mb, first_ratio_err = [], 0.0
    models.policy.train()
    models.critic.train()
    for epoch, minibatches in enumerate(schedule):
        for k, mb in enumerate(minibatches):
            metrics, ratio_err = minibatch_step(mb, scored, targets, layout, models, cfg)
            if epoch == 0 and k == 0:
                first_ratio_err = ratio_err
            per_mb.append(metrics)
    models.policy.eval()
    models.critic.eval()
    return per_mb, first_ratio_err


def ppo_update(episodes: list[Episode], policy, ref, critic, teacher, actor_opt, critic_opt,
               cfg: PPOConfig, ids: list[int] | None = None) -> dict:
    """One training step on recorded episodes; returns metrics averaged over the minibatches of the
    whole batch (every rank). With several ranks, `episodes` are this rank's share and `ids` their
    positions in the batch (default: the whole batch, in order). Policy, reference and critic are all
    replicas (fp32, the gradients summed by `dist.allreduce_grads`) or all FSDP-sharded `parallel.Root`s.

    Every loss term is a token mean over the minibatch (`losses.aggregate`): PPO, entropy and value
    over its sampled action tokens, OPD over its teacher-mask tokens (1 / sum m_T)."""
    check_backend(cfg.attention, is_checkpointed(policy) or is_checkpointed(critic))
    layout = BatchLayout.gathered(list(range(len(episodes))) if ids is None else list(ids))
    metrics: dict[str, float] = {}
    with gathered(policy, ref, critic):  # sharded: ranks may score different numbers of episodes
        if cfg.rce_sample:
            metrics["rce/max_abs_dlogp"] = _rce_check(policy, episodes, cfg)
        t0 = time.perf_counter()
        scored = score_batch(episodes, policy, ref, critic, teacher, cfg, ids=layout.ids)
    targets = [episode_targets(s, float(ep.reward or 0.0), cfg) for s, ep in zip(scored, episodes)]
    metrics["time/score_s"] = time.perf_counter() - t0
    targets = normalised(targets)
    actions, teacher_tokens = token_counts([(pos, s.actions, s.teacher_tokens) for pos, s in zip(layout.ids, scored)])
    schedule = minibatch_schedule(actions, teacher_tokens, cfg.ppo_epochs, cfg.minibatch_episodes, cfg.seed)
    models = Models(policy, critic, teacher, actor_opt, critic_opt)
    per_mb, first_ratio_err = train_epochs(schedule, scored, targets, layout, models, cfg)
    metrics["time/update_s"] = time.perf_counter() - t0 - metrics["time/score_s"]
    share = RankShare(per_mb, sum(len(s.packed) for s in scored), sum(s.actions for s in scored),
                      sum(float(ep.reward or 0.0) for ep in episodes),
                      float(torch.cat([t.kl_ref for t in targets]).double().sum()), first_ratio_err)
    return {**metrics, **reduce_metrics(share, layout.size)}
