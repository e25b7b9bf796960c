"""Alignment audits (the paper's Table 3 and its companions) on recorded episodes.

Every comparison is against the reference of running each call alone, at the sampled action tokens:
  state_rows         persistent history, batched independent calls, packed backends, corruptions
  teacher_divergence teacher on the flattened vs the exact state, by invocation index
  action_domain      the exact action mask vs the trajectory (info-masked) and response masks
  context_updates    RCE per memory-rewrite rule

The full-vocabulary comparisons are chunked (memopd.rce.CHUNK action positions at a time): final hidden states
of every state and of the reference are computed once, the LM head and log-softmax run on a chunk of
positions, and only per-token values are kept; the statistics are those of the unchunked computation.
"""
from __future__ import annotations

import torch

from memopd.attention import AUTO, independent_hidden, lm_logits, packed_hidden
from memopd.packing import CONTEXT, corrupt, flatten_persistent, pack
from memopd.rce import CHUNK, spans, tolerances
from memopd.records import Episode

STATES = {
    "persistent_history": lambda ep: flatten_persistent(ep),
    "corrupt_visibility": lambda ep: corrupt(pack(ep), visibility=True, positions=False),
    "corrupt_positions": lambda ep: corrupt(pack(ep), visibility=False, positions=True),
    "corrupt_both": lambda ep: corrupt(pack(ep), visibility=True, positions=True),
}


@torch.no_grad()
def _state_hidden(model, episodes: list[Episode], state: str) -> torch.Tensor:
    """(N, H) final hidden states predicting every sampled action token under a named state."""
    if state == "independent_batched":
        return independent_hidden(model, episodes, batched=True)
    if state.startswith("packed_"):
        return torch.cat([packed_hidden(model, pack(ep), state[len("packed_"):]) for ep in episodes])
    return torch.cat([packed_hidden(model, STATES[state](ep), AUTO) for ep in episodes])


def _targets(episodes):
    return torch.tensor([t for ep in episodes for inv in ep.invocations for t in inv.output_ids])


def _chunks(episodes, size):
    return [episodes[i : i + size] for i in range(0, len(episodes), size)]


@torch.no_grad()
def state_rows(model, episodes: list[Episode], states: list[str], clip: float = 0.2, dtype: str = "float32",
               chunk: int = 8, logit_chunk: int = CHUNK) -> list[dict]:
    """One row per state: |d log p| of sampled tokens vs independent calls (p99, max, mean), top-1 changes,
    and the false PPO clip rate (share of actions whose ratio exp(l_state - l_independent) leaves
    [1-clip, 1+clip] although the weights are identical). Episodes go `chunk` at a time (the batched
    reference pads each chunk's calls together), so memory stays bounded on many trajectories; full-vocabulary
    logits exist `logit_chunk` action positions at a time."""
    dlp = {s: [] for s in states}
    top1 = {s: 0 for s in states}
    for eps in _chunks(episodes, chunk):
        ref_h = independent_hidden(model, eps)
        targets = _targets(eps).to(ref_h.device)
        cuts = spans(targets.numel(), logit_chunk)
        ref_lp, ref_top = [], []
        for s, e in cuts:  # the reference's per-token values, one chunk of (chunk, V) logits at a time
            ref = lm_logits(model, ref_h[s:e]).double()
            ref_lp.append(torch.log_softmax(ref, -1).gather(-1, targets[s:e, None]).squeeze(-1))
            ref_top.append(ref.argmax(-1))
            del ref
        for state in states:
            h = _state_hidden(model, eps, state)
            for (s, e), rlp, rtop in zip(cuts, ref_lp, ref_top):
                logits = lm_logits(model, h[s:e]).double()
                lp = torch.log_softmax(logits, -1).gather(-1, targets[s:e, None]).squeeze(-1)
                dlp[state].append((lp - rlp).cpu())
                top1[state] += int((logits.argmax(-1) != rtop).sum())
                del logits
    rows = []
    for state in states:
        d = torch.cat(dlp[state])
        a = d.abs()
        ratio = torch.exp(d)
        rows.append({
            "state": state,
            "p99_abs_dlogp": torch.quantile(a, 0.99).item(),
            "max_abs_dlogp": a.max().item(),
            "mean_abs_dlogp": a.mean().item(),
            "top1_changes": top1[state],
            "false_clip_rate": ((ratio < 1 - clip) | (ratio > 1 + clip)).double().mean().item(),
            "at_floor": a.max().item() <= tolerances(dtype)["dlogp"],
            "trajectories": len(episodes),
            "invocations": sum(len(ep.invocations) for ep in episodes),
            "action_tokens": int(a.numel()),
        })
    return rows


def first_update_call(ep: Episode) -> int | None:
    """Index of the first call after a memory update (None: a single-call episode). Every call t >= 1
    runs on a rewritten context (prefix + memory + newest observation, never the accumulated transcript),
    whether or not the memory kept tokens of an earlier response, so the persistent flattening and the
    exact state coincide at call 0 only."""
    return 1 if len(ep.invocations) > 1 else None


@torch.no_grad()
def teacher_divergence(teacher, episodes: list[Episode], logit_chunk: int = CHUNK) -> list[dict]:
    """Teacher distributions on the persistent flattening vs the exact state, at the sampled action
    tokens: one row per invocation index, then before / after the first memory update (calls before
    the first rewrite see the same tokens in both layouts, so they differ only by numerical noise).
    mean_kl is KL(teacher on the exact state || teacher on the flattening), per action token, in nats.
    Full-vocabulary logits exist `logit_chunk` action positions at a time."""
    recs = []  # (episode, call index, after first update?, top1 same, |dlogp|, KL) per action token
    for e, ep in enumerate(episodes):
        exact, flat = pack(ep), flatten_persistent(ep)
        he, hf = packed_hidden(teacher, exact, AUTO), packed_hidden(teacher, flat, AUTO)
        targets = exact.targets.to(he.device)
        kl, dlp, same = [], [], []
        for s, t in spans(targets.numel(), logit_chunk):
            le, lf = lm_logits(teacher, he[s:t]).double(), lm_logits(teacher, hf[s:t]).double()
            lpe, lpf = torch.log_softmax(le, -1), torch.log_softmax(lf, -1)
            kl.append((lpe.exp() * (lpe - lpf)).sum(-1))
            tg = targets[s:t, None]
            dlp.append((lpe.gather(-1, tg) - lpf.gather(-1, tg)).abs().squeeze(-1))
            same.append(le.argmax(-1) == lf.argmax(-1))
            del le, lf, lpe, lpf
        if not same:
            continue
        kl, dlp, same = torch.cat(kl), torch.cat(dlp), torch.cat(same)
        calls = exact.call[exact.action_index]
        fu = first_update_call(ep)
        for j in range(targets.numel()):
            t = int(calls[j])
            recs.append((e, t, fu is not None and t >= fu, bool(same[j]), float(dlp[j]), float(kl[j])))

    def row(name, sel):
        if not sel:
            return None
        d = torch.tensor([r[4] for r in sel], dtype=torch.float64)
        return {"invocation": name, "calls": len({(r[0], r[1]) for r in sel}), "action_tokens": len(sel),
                "top1_agreement": sum(r[3] for r in sel) / len(sel),
                "top1_changes": sum(not r[3] for r in sel),
                "p99_abs_dlogp": torch.quantile(d, 0.99).item(),
                "mean_kl": sum(r[5] for r in sel) / len(sel)}

    rows = [row(str(t), [r for r in recs if r[1] == t]) for t in sorted({r[1] for r in recs})]
    rows += [row("before_first_update", [r for r in recs if not r[2]]),
             row("after_first_update", [r for r in recs if r[2]])]
    return [r for r in rows if r is not None]


MASKS = ("exact_action_mask", "trajectory_mask", "response_mask")


def domain_masks(ep: Episode) -> dict[str, torch.Tensor]:
    """Boolean masks over the flattened transcript y = [q, x_0, a_0, x_1, a_1, ...] of one episode, each
    built the way a training framework builds it. z_0 = [q, x_0] (the first call's whole input) is the
    prompt. Every token of x_t (t >= 1) is either a retained copy of an earlier response (recorded
    `Retained` provenance, never matched by ids) or fresh context the environment inserted (observations:
    <information> blocks, hints).
      exact_action_mask  the sampled occurrence of every a_t (what MemOPD trains on)
      trajectory_mask    the info-masked trajectory (Search-R1, arXiv:2503.09516; MEM1, arXiv:2506.15841):
                         every token after z_0 except the observations, i.e. the sampled actions and the
                         retained copies (model-generated text, so the info mask keeps them)
      response_mask      everything after z_0, observations included (all turns after the prompt trained as
                         one response with no tool-output mask, e.g. verl's response_mask = the attention
                         mask of the response part)
    exact <= trajectory <= response position by position, by construction."""
    flat = flatten_persistent(ep)
    copies = torch.zeros(len(flat), dtype=torch.bool)
    start = ep.prefix_len  # index in y where x_t starts
    for inv in ep.invocations:
        for r in inv.retained:
            j = start + r.dst_start - ep.prefix_len
            copies[j : j + r.length] = True
        start += len(inv.input_ids) - ep.prefix_len + len(inv.output_ids)
    assert start == len(flat)
    act = flat.act_mask
    after_prompt = act | ((flat.role == CONTEXT) & (flat.call >= 1))  # x_0 belongs to the prompt z_0
    assert not (copies & ~after_prompt).any()  # a call retains from earlier calls only, so never into x_0
    return {"exact_action_mask": act.clone(), "trajectory_mask": act | copies, "response_mask": after_prompt}


def action_domain(episodes: list[Episode]) -> list[dict]:
    """Which positions of the flattened transcripts each mask selects, and how many are spurious
    (selected but not a sampled action occurrence: a gradient there trains a token the policy did not
    sample in that state). `contains_exact` checks position by position that the mask selects every
    sampled action occurrence."""
    sel = dict.fromkeys(MASKS, 0)
    spur = dict.fromkeys(MASKS, 0)
    contains = dict.fromkeys(MASKS, True)
    n_act = 0
    for ep in episodes:
        m = domain_masks(ep)
        exact = m["exact_action_mask"]
        n_act += int(exact.sum())
        for k in MASKS:
            sel[k] += int(m[k].sum())
            spur[k] += int((m[k] & ~exact).sum())
            contains[k] &= bool((m[k] | ~exact).all())
    return [{"mask": k, "selected_positions": sel[k], "sampled_action_positions": n_act,
             "spurious_positions": spur[k], "spurious_share": spur[k] / sel[k] if sel[k] else 0.0,
             "x_exact": sel[k] / n_act if n_act else 0.0, "contains_exact": contains[k],
             "trajectories": len(episodes)} for k in MASKS]


def context_update_rows(model, episodes_by_rule: dict[str, list[Episode]], backends: list[str],
                        dtype: str = "float32", logit_chunk: int = CHUNK) -> list[dict]:
    """RCE per memory-rewrite rule and backend (rce_report: chunked)."""
    from memopd.rce import rce_report

    rows = []
    for rule, eps in episodes_by_rule.items():
        rep = rce_report(model, eps, backends, dtype=dtype, chunk=logit_chunk)
        for b, r in rep["backends"].items():
            rows.append({"rule": rule, "backend": b, "episodes": len(eps),
                         "memory_updates": sum(1 for ep in eps for inv in ep.invocations if inv.retained),
                         **{k: r[k] for k in ("max_abs_dlogp", "p99_abs_dlogp", "mean_abs_dlogp",
                                              "max_abs_dlogit", "top1_agreement", "action_tokens", "passed")}})
    return rows
