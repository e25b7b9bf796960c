"""Losses of PPO and MemOPD as pure functions over tensors and masks, each returning (loss, metrics).

Shapes: N = number of sampled action tokens (in the packed action order: episode by episode, call by
call, token by token), H = hidden size, V = vocabulary size, L = packed sequence length.

Full-vocabulary quantities (log-prob of the sampled token, entropy, reverse KL to the teacher) are
computed from hidden states in chunks of rows, each chunk under activation checkpointing, so that at
most one chunk of (chunk, V) logits per model is alive at a time, forward or backward: full logits for
8k tokens at V = 151,936 would be ~5 GB per model in fp32.

Every loss term is a token mean over the minibatch (`aggregate`): PPO, entropy and value over its
sampled action tokens, OPD over its teacher-mask tokens (the paper's 1 / sum m_T). A long episode
therefore weighs by its tokens, as in verl's "token-mean", and the OPD mean is over the minibatch's
teacher tokens, not a mean of per-episode means.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(hidden, weight, bias).float()


def _logp_entropy_chunk(hidden, weight, bias, targets):
    logp_all = torch.log_softmax(_logits(hidden, weight, bias), dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def action_logprobs_entropy(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor,
                            chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, H) hidden states predicting the sampled tokens, (N,) targets -> (N,) log p, (N,) entropy."""
    logps, ents = [], []
    for s in range(0, hidden.shape[0], chunk_size):
        args = (hidden[s : s + chunk_size], head.weight, head.bias, targets[s : s + chunk_size])
        lp, en = checkpoint(_logp_entropy_chunk, *args, use_reentrant=False) if hidden.requires_grad \
            else _logp_entropy_chunk(*args)
        logps.append(lp)
        ents.append(en)
    return torch.cat(logps), torch.cat(ents)


def _reverse_kl_chunk(h_s, w_s, b_s, h_t, w_t, b_t):
    logp_s = torch.log_softmax(_logits(h_s, w_s, b_s), dim=-1)
    logp_t = torch.log_softmax(_logits(h_t, w_t, b_t), dim=-1)
    return (logp_s.exp() * (logp_s - logp_t)).sum(-1)


def shared_vocab(student_rows: int, teacher_rows: int, vocab: int | None = None) -> int:
    """The number of leading logit rows the KL runs over: `vocab` (the tokenizer's real ids, len(tokenizer))
    or, when None, the rows both heads have. Heads of one tokenizer are padded to different sizes
    (Qwen2.5-3B: 151,936 rows, Qwen2.5-7B: 152,064, for 151,665 real ids); the rows past the tokenizer
    are never tokens."""
    rows = min(student_rows, teacher_rows)
    if vocab is None:
        return rows
    if not 0 < vocab <= rows:
        raise ValueError(f"shared vocabulary {vocab} outside 1..{rows} (student head {student_rows} rows, "
                         f"teacher head {teacher_rows})")
    return vocab


def _rows(head: torch.nn.Linear, n: int, detach: bool = False):
    """The first n rows of a head's weight and bias (views: the student's gradient reaches only them)."""
    w, b = head.weight[:n], None if head.bias is None else head.bias[:n]
    return (w.detach(), None if b is None else b.detach()) if detach else (w, b)


def reverse_kl(student_hidden: torch.Tensor, student_head: torch.nn.Linear, teacher_hidden: torch.Tensor,
               teacher_head: torch.nn.Linear, chunk_size: int = 512, vocab: int | None = None) -> torch.Tensor:
    """(N, Hs), (N, Ht) -> (N,) reverse KL sum_v p_s(v) log(p_s(v) / p_T(v)) per row, over the shared
    vocabulary v < V, V = `shared_vocab(student rows, teacher rows, vocab)`.

    Exactly: p_s and p_T are each model's softmax over its logits of the ids v < V, i.e. each model's
    full-head distribution conditioned on a real token, p(v | v < V) = p(v) / (1 - eps), eps = the mass
    on its padded rows. When the heads have equal sizes and `vocab` is None this is the full-vocabulary
    KL of the policy itself. Otherwise the padded rows are masked out of both sides: they get
    no gradient and no weight in the KL, and KL(p_s(.|real) || p_T(.|real)) >= 0 stays a divergence that
    is 0 iff the two agree on the real ids. It equals the policy's own KL up to a factor (1 - eps_s) and
    a term log(1 - eps_s): eps_s ~ 0 for a trained model, whose padded rows are never targets.
    Why not the student's unrenormalised p_s(v) over v < V against the renormalised teacher: that sum is
    (1 - eps_s) (KL + log(1 - eps_s)), which *decreases* as eps_s grows (slope -(1 + KL) at 0), so the
    loss would reward moving probability onto padded rows, which are never tokens.
    The teacher is frozen: its hidden states and head carry no gradient."""
    v = shared_vocab(student_head.weight.shape[0], teacher_head.weight.shape[0], vocab)
    teacher_hidden = teacher_hidden.detach()
    w_s, b_s = _rows(student_head, v)
    w_t, b_t = _rows(teacher_head, v, detach=True)
    out = []
    for s in range(0, student_hidden.shape[0], chunk_size):
        args = (student_hidden[s : s + chunk_size], w_s, b_s, teacher_hidden[s : s + chunk_size], w_t, b_t)
        out.append(checkpoint(_reverse_kl_chunk, *args, use_reentrant=False) if student_hidden.requires_grad
                   else _reverse_kl_chunk(*args))
    return torch.cat(out)


def aggregate(x: torch.Tensor, denom: float | None = None) -> torch.Tensor:
    """The one aggregation of every loss term: sum of the (N,) per-token values / denom.

    The trainer passes denom = the number of tokens of the term's mask in the whole *minibatch*
    (sampled actions for PPO, entropy and value; teacher-mask rows for OPD), so that summing the
    per-episode contributions gives the minibatch token mean, e.g. the paper's
    L_OPD = (1 / sum_j m_T[j]) sum_j m_T[j] KL_j over the minibatch. denom None: the mean over x."""
    if denom is None:
        return x.mean() if x.numel() else x.sum()
    return x.sum() / denom


def opd_loss(student_hidden, student_head, teacher_hidden, teacher_head, chunk_size: int = 512,
             denom: float | None = None, vocab: int | None = None):
    """L_OPD = (1 / sum m_T) sum_j m_T[j] KL(p_theta,j || p_T,j), over the rows given (the teacher-mask
    positions; `denom` = sum m_T over the minibatch, see `aggregate`). Student and teacher hidden
    states must come from the same tokens, positions and visibility (the packed exact state for
    `memopd`). The KL runs over the shared vocabulary (`reverse_kl`: `vocab` = len(tokenizer), or
    None = the rows both heads have)."""
    kl = reverse_kl(student_hidden, student_head, teacher_hidden, teacher_head, chunk_size, vocab)
    loss = aggregate(kl, denom) if kl.numel() else student_hidden.sum() * 0.0
    return loss, {"opd/loss": loss.item(), "opd/kl_max": kl.max().item() if kl.numel() else 0.0,
                  "opd/positions": kl.numel()}


def ppo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip: float = 0.2,
                    denom: float | None = None):
    """Clipped PPO surrogate. (N,) each -> loss = agg_j max(-A r, -A clip(r, 1-c, 1+c)),
    r = exp(logp - old_logp); the behaviour snapshot old_logp is the rollout policy."""
    ratio = torch.exp(logp - old_logp)
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - clip, 1.0 + clip)
    loss = aggregate(torch.maximum(pg1, pg2), denom)
    clipped = (pg2 > pg1).float()
    return loss, {"ppo/loss": loss.item(), "ppo/clipfrac": aggregate(clipped, denom).item(),
                  "ppo/approx_kl": aggregate((old_logp - logp).detach(), denom).item(),
                  "ppo/ratio_max": ratio.max().item()}


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float = 0.2,
               denom: float | None = None):
    """Clipped value loss 0.5 * agg max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2). (N,) each."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    loss = 0.5 * aggregate(torch.maximum((values - returns) ** 2, (clipped - returns) ** 2), denom)
    return loss, {"value/loss": loss.item(), "value/clipfrac": aggregate(
        ((values - returns) ** 2 < (clipped - returns) ** 2).float(), denom).item()}


def entropy_bonus(entropy: torch.Tensor, denom: float | None = None):
    h = aggregate(entropy, denom)
    return h, {"actor/entropy": h.item()}


def reference_penalty(old_logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """KLref_j = [l_old,j - l_ref,j]_+ (positive part), (N,). The reference is frozen at the SFT
    initialisation, separate from the teacher and from pi_old."""
    return (old_logp - ref_logp).clamp_min(0.0)


def token_rewards(task_score: torch.Tensor, last_action: torch.Tensor, old_logp: torch.Tensor,
                  ref_logp: torch.Tensor, beta: float) -> torch.Tensor:
    """r'_j = r_j - beta KLref_j, with r_j = the task score on the last action token of each episode.
    task_score: (E,) per episode; last_action: (E,) index (into the N actions) of each episode's last
    action token; -> (N,)."""
    r = -beta * reference_penalty(old_logp, ref_logp)
    return r.index_add(0, last_action, task_score.to(r.dtype))


def gae(rewards: torch.Tensor, values: torch.Tensor, episode: torch.Tensor, gamma: float = 1.0,
        gae_lambda: float = 1.0):
    """Generalised advantage estimation over the ordered sampled actions.

    rewards, values, episode: (N,) over sampled action tokens only, in rollout order (context-only
    positions are not in these tensors, so they cannot influence the recursion); episode[j] says
    which episode token j belongs to (the recursion restarts at each episode's last action).
    Returns (advantages, returns), each (N,).
    """
    n = rewards.shape[0]
    adv = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(())
    next_adv = rewards.new_zeros(())
    for j in range(n - 1, -1, -1):
        if j == n - 1 or episode[j + 1] != episode[j]:  # last action of an episode: terminal
            next_value, next_adv = rewards.new_zeros(()), rewards.new_zeros(())
        delta = rewards[j] + gamma * next_value - values[j]
        next_adv = delta + gamma * gae_lambda * next_adv
        adv[j] = next_adv
        next_value = values[j]
    return adv, adv + values


def actor_loss(logp, old_logp, advantages, entropy, opd: torch.Tensor | None, clip: float, entropy_coef: float,
               opd_lambda: float, denom: float | None = None):
    """L_actor = L_PPO - alpha H + lambda L_OPD (lambda = 0: plain PPO). `opd` is already aggregated
    over its own (teacher-mask) denominator; `denom` is the action-token count of PPO and entropy."""
    pg, metrics = ppo_policy_loss(logp, old_logp, advantages, clip, denom)
    h, m_h = entropy_bonus(entropy, denom)
    loss = pg - entropy_coef * h
    if opd is not None and opd_lambda:
        loss = loss + opd_lambda * opd
    return loss, {**metrics, **m_h, "actor/loss": loss.item()}
