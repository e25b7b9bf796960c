"""A deliberately naive reference of one PPO / MemOPD update, to pin the trainer (`memopd.train.update`).

It shares no code with the trainer: no packing, no memopd attention or loss functions. Every call is
run alone with plain transformers, exactly as it ran during the rollout ([z_t, a_t], positions 0..,
causal attention), and every quantity is a per-token Python loop over plain floats or scalar tensors.
Read top to bottom, it is the algorithm:

  1. score (no gradient), per episode, call by call, token by token:
       l_old[j]  log pi_old(a_j | state)       the policy before the update (the behaviour snapshot)
       l_ref[j]  log pi_ref(a_j | state)       the frozen reference (the SFT initialisation)
       V_old[j]  critic value at the position that predicts a_j (the state before the token)
  2. rewards: r[j] = -beta * max(l_old[j] - l_ref[j], 0); the task score is added on the episode's
     last sampled token
  3. GAE over the ordered sampled tokens of the episode (context copies are not in the list, so they
     cannot enter the recursion): delta = r[j] + gamma V[j+1] - V[j], A[j] = delta + gamma gae_lambda A[j+1],
     terminal after the last token; returns R = A + V_old
  4. advantages normalised over every sampled token of the batch: (A - mean) / std (unbiased std)
  5. PPO epochs; each epoch shuffles the episodes (random.Random(seed), one generator for all epochs)
     and cuts minibatches of `minibatch_episodes`. On each minibatch, with the current weights:
       PPO      (1/n) sum_j max(-A r, -A clip(r, 1-c, 1+c)),  r = exp(l - l_old)
       entropy  (1/n) sum_j H(pi(. | state_j))
       OPD      (1/n_T) sum_{j in teacher mask} sum_v p(v) (log p(v) - log p_T(v))   (full vocabulary)
       value    (1/n) sum_j 0.5 max((v - R)^2, (V_old + clip(v - V_old, -c_v, c_v) - R)^2)
     n = sampled tokens of the minibatch, n_T = its teacher-mask tokens (the paper's 1 / sum m_T).
     actor = PPO - alpha * entropy + lambda * OPD (lambda = 0 for ppo); critic = value.
     Each model's gradient is clipped to max_grad_norm, then the optimizer steps.
  The teacher scores the exact state of each call (memopd), or the persistent-history transcript
  [q, x_0, a_0, x_1, a_1, ...] with running positions and plain causal attention (memopd_persistent),
  on the calls chosen by teacher_select.
"""
from __future__ import annotations

import math
import random

import torch


def teacher_calls(n_calls: int, spec, seed: int) -> set[int]:
    """Which calls the teacher scores: all, first, last, or each call with probability `spec`
    (drawn in call order from random.Random(seed), seed = config seed + the episode's batch position)."""
    if spec == "all":
        return set(range(n_calls))
    if spec == "first":
        return {0}
    if spec == "last":
        return {n_calls - 1}
    rng = random.Random(seed)
    return {t for t in range(n_calls) if rng.random() < spec}


def call_rows(model, inv) -> torch.Tensor:
    """Logits predicting each sampled token of one call, the call run alone: (len(a_t), V)."""
    ids = inv.input_ids + inv.output_ids
    logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    n_in = len(inv.input_ids)
    return logits[n_in - 1 : n_in - 1 + len(inv.output_ids)]


def call_values(critic, inv) -> torch.Tensor:
    """Critic values at the positions predicting each sampled token of one call: (len(a_t),)."""
    ids = inv.input_ids + inv.output_ids
    hidden = critic.lm.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    n_in = len(inv.input_ids)
    return critic.head(hidden[n_in - 1 : n_in - 1 + len(inv.output_ids)]).squeeze(-1).float()


def persistent_rows(teacher, ep) -> list[torch.Tensor]:
    """The teacher on the flattened transcript: per call, (len(a_t), V) logits predicting its tokens."""
    transcript = list(ep.invocations[0].input_ids[: ep.prefix_len])
    starts = []
    for inv in ep.invocations:
        transcript += inv.input_ids[ep.prefix_len :]
        starts.append(len(transcript))
        transcript += inv.output_ids
    logits = teacher(input_ids=torch.tensor([transcript])).logits[0].float()
    return [logits[s - 1 : s - 1 + len(inv.output_ids)] for s, inv in zip(starts, ep.invocations)]


def log_softmax(row: torch.Tensor) -> torch.Tensor:
    return row - torch.logsumexp(row, dim=0)


@torch.no_grad()
def score(episodes, policy, ref, critic, teacher, cfg) -> list[dict]:
    """Step 1, per episode: per-token l_old, l_ref, V_old, and the teacher's log-probs (or None) for
    each token, with the token's call index."""
    out = []
    for e, ep in enumerate(episodes):
        chosen = teacher_calls(len(ep.invocations), cfg.teacher_select, cfg.seed + e)
        if cfg.method == "memopd_persistent":
            t_rows = persistent_rows(teacher, ep)
        elif cfg.method == "memopd":
            t_rows = [call_rows(teacher, inv) for inv in ep.invocations]
        tokens = []
        for t, inv in enumerate(ep.invocations):
            old, reference, values = call_rows(policy, inv), call_rows(ref, inv), call_values(critic, inv)
            for k, a in enumerate(inv.output_ids):
                teach = None
                if cfg.method != "ppo" and t in chosen:
                    teach = log_softmax(t_rows[t][k])
                tokens.append({"call": t, "k": k, "token": a, "l_old": log_softmax(old[k])[a].item(),
                               "l_ref": log_softmax(reference[k])[a].item(), "v_old": values[k].item(),
                               "teacher_logp": teach})
        out.append({"episode": ep, "tokens": tokens})
    return out


def rewards_and_advantages(scored, cfg) -> None:
    """Steps 2-4, in place: r, A, R per token, then A normalised over the batch."""
    for s in scored:
        toks = s["tokens"]
        for tok in toks:
            tok["r"] = -cfg.beta * max(tok["l_old"] - tok["l_ref"], 0.0)
        toks[-1]["r"] += float(s["episode"].reward)
        next_value, next_adv = 0.0, 0.0
        for tok in reversed(toks):
            delta = tok["r"] + cfg.gamma * next_value - tok["v_old"]
            next_adv = delta + cfg.gamma * cfg.gae_lambda * next_adv
            tok["A"] = next_adv
            tok["R"] = next_adv + tok["v_old"]
            next_value = tok["v_old"]
    all_a = [tok["A"] for s in scored for tok in s["tokens"]]
    mean = sum(all_a) / len(all_a)
    std = max(math.sqrt(sum((a - mean) ** 2 for a in all_a) / (len(all_a) - 1)), 1e-6)
    for s in scored:
        for tok in s["tokens"]:
            tok["A_norm"] = (tok["A"] - mean) / std


def minibatch_losses(batch, policy, critic, cfg, opd_lambda: float) -> dict:
    """Step 5 on one minibatch with the current weights: the four terms as scalar tensors."""
    n = sum(len(s["tokens"]) for s in batch)
    n_teach = sum(tok["teacher_logp"] is not None for s in batch for tok in s["tokens"])
    pg, entropy, opd, value = 0.0, 0.0, 0.0, 0.0
    for s in batch:
        ep = s["episode"]
        rows = [call_rows(policy, inv) for inv in ep.invocations]
        values = [call_values(critic, inv) for inv in ep.invocations]
        for tok in s["tokens"]:
            logp_all = log_softmax(rows[tok["call"]][tok["k"]])
            v = values[tok["call"]][tok["k"]]
            ratio = torch.exp(logp_all[tok["token"]] - tok["l_old"])
            a = tok["A_norm"]
            pg = pg + torch.maximum(-a * ratio, -a * ratio.clamp(1 - cfg.clip, 1 + cfg.clip)) / n
            entropy = entropy - (logp_all.exp() * logp_all).sum() / n
            if opd_lambda and tok["teacher_logp"] is not None:
                opd = opd + (logp_all.exp() * (logp_all - tok["teacher_logp"])).sum() / n_teach
            v_clipped = tok["v_old"] + (v - tok["v_old"]).clamp(-cfg.value_clip, cfg.value_clip)
            value = value + 0.5 * torch.maximum((v - tok["R"]) ** 2, (v_clipped - tok["R"]) ** 2) / n
    return {"ppo": pg, "entropy": entropy, "opd": opd if (opd_lambda and n_teach) else None, "value": value}


def update(episodes, policy, ref, critic, teacher, actor_opt, critic_opt, cfg) -> dict:
    """The whole update; returns the per-minibatch loss terms and the clipped gradients of each step."""
    scored = score(episodes, policy, ref, critic, teacher, cfg)
    rewards_and_advantages(scored, cfg)
    opd_lambda = 0.0 if cfg.method == "ppo" else cfg.opd_lambda
    steps = []
    order = list(range(len(episodes)))
    rng = random.Random(cfg.seed)
    for _ in range(cfg.ppo_epochs):
        rng.shuffle(order)
        for m in range(0, len(order), cfg.minibatch_episodes):
            batch = [scored[i] for i in order[m : m + cfg.minibatch_episodes]]
            actor_opt.zero_grad(set_to_none=True)
            critic_opt.zero_grad(set_to_none=True)
            terms = minibatch_losses(batch, policy, critic, cfg, opd_lambda)
            actor = terms["ppo"] - cfg.entropy_coef * terms["entropy"]
            if terms["opd"] is not None:
                actor = actor + opd_lambda * terms["opd"]
            actor.backward()
            terms["value"].backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
            torch.nn.utils.clip_grad_norm_(critic.parameters(), cfg.max_grad_norm)
            actor_opt.step()
            critic_opt.step()
            steps.append({k: None if v is None else v.item() for k, v in terms.items()})
    return {"steps": steps, "scored": scored}
