"""Alignment audits (the paper's Table 3 and its companions) on recorded episodes.

Every comparison is against the reference of running each call alone, at the sampled action tokens:
  state_rows         persistent history, batched independent calls, packed backends, corruptions
  teacher_divergence teacher on the flattened vs the exact state, by invocation index
  action_domain      the exact action mask vs a trajectory mask and a response mask
  context_updates    RCE per memory-rewrite rule
"""
from __future__ import annotations

import torch

from memopd.attention import independent_logits, packed_logits, token_logprobs
from memopd.packing import corrupt, flatten_persistent, pack
from memopd.rce import TOLERANCES, compare
from memopd.records import Episode

STATES = {
    "persistent_history": lambda ep: flatten_persistent(ep),
    "corrupt_visibility": lambda ep: corrupt(pack(ep), visibility=True, positions=False),
    "corrupt_positions": lambda ep: corrupt(pack(ep), visibility=False, positions=True),
    "corrupt_both": lambda ep: corrupt(pack(ep), visibility=True, positions=True),
}


@torch.no_grad()
def _state_logits(model, episodes: list[Episode], state: str) -> torch.Tensor:
    """(N, V) logits predicting every sampled action token under a named state."""
    if state == "independent_batched":
        return independent_logits(model, episodes, batched=True)
    if state.startswith("packed_"):
        return torch.cat([packed_logits(model, pack(ep), state[len("packed_"):]) for ep in episodes])
    return torch.cat([packed_logits(model, STATES[state](ep), "sdpa") for ep in episodes])


def _targets(episodes):
    return torch.tensor([t for ep in episodes for inv in ep.invocations for t in inv.output_ids])


@torch.no_grad()
def state_rows(model, episodes: list[Episode], states: list[str], clip: float = 0.2, dtype: str = "float32") -> list[dict]:
    """One row per state: |d log p| of sampled tokens vs independent calls, top-1 changes, and the false
    PPO clip rate (share of actions whose ratio exp(l_state - l_independent) leaves [1-clip, 1+clip]
    although the weights are identical)."""
    ref = independent_logits(model, episodes)
    targets = _targets(episodes)
    ref_lp = token_logprobs(ref, targets)
    rows = []
    for state in states:
        logits = _state_logits(model, episodes, state)
        c = compare(ref, logits, targets)
        ratio = torch.exp(token_logprobs(logits, targets).double() - ref_lp.double())
        rows.append({
            "state": state,
            "p99_abs_dlogp": c["p99_abs_dlogp"],
            "max_abs_dlogp": c["max_abs_dlogp"],
            "top1_changes": int(round((1 - c["top1_agreement"]) * c["action_tokens"])),
            "false_clip_rate": ((ratio < 1 - clip) | (ratio > 1 + clip)).double().mean().item(),
            "at_floor": c["max_abs_dlogp"] <= TOLERANCES[dtype],
            "trajectories": len(episodes),
            "invocations": sum(len(ep.invocations) for ep in episodes),
            "action_tokens": c["action_tokens"],
        })
    return rows


def first_update_call(ep: Episode) -> int | None:
    """Index of the first call whose context was rewritten from an earlier response (None: never)."""
    return next((t for t, inv in enumerate(ep.invocations) if inv.retained), None)


@torch.no_grad()
def teacher_divergence(teacher, episodes: list[Episode]) -> list[dict]:
    """Teacher distributions on the persistent flattening vs the exact state, at the sampled action
    tokens, by invocation index, plus before/after the first memory update."""
    recs = []  # (call index, after first update?, top1 same, |dlogp|, KL) per action token
    for ep in episodes:
        exact, flat = pack(ep), flatten_persistent(ep)
        le, lf = packed_logits(teacher, exact, "sdpa").double(), packed_logits(teacher, flat, "sdpa").double()
        targets = exact.targets
        lpe, lpf = torch.log_softmax(le, -1), torch.log_softmax(lf, -1)
        kl = (lpe.exp() * (lpe - lpf)).sum(-1)
        dlp = (lpe.gather(-1, targets[:, None]) - lpf.gather(-1, targets[:, None])).abs().squeeze(-1)
        same = le.argmax(-1) == lf.argmax(-1)
        calls = exact.call[exact.action_index]
        fu = first_update_call(ep)
        for j in range(targets.numel()):
            t = int(calls[j])
            recs.append((t, fu is not None and t >= fu, bool(same[j]), float(dlp[j]), float(kl[j])))

    def row(name, sel):
        if not sel:
            return None
        d = torch.tensor([r[3] for r in sel], dtype=torch.float64)
        return {"invocation": name, "action_tokens": len(sel),
                "top1_agreement": sum(r[2] for r in sel) / len(sel),
                "top1_changes": sum(not r[2] for r in sel),
                "p99_abs_dlogp": torch.quantile(d, 0.99).item(),
                "mean_kl": sum(r[4] for r in sel) / len(sel)}

    rows = [row(str(t), [r for r in recs if r[0] == t]) for t in sorted({r[0] for r in recs})]
    rows += [row("before_first_update", [r for r in recs if not r[1]]),
             row("after_first_update", [r for r in recs if r[1]])]
    return [r for r in rows if r is not None]


def action_domain(episodes: list[Episode]) -> list[dict]:
    """Which positions each mask selects on the flattened transcript, and how many are spurious
    (selected but not a sampled action occurrence)."""
    n_sel = {"exact_action_mask": 0, "trajectory_mask": 0, "response_mask": 0}
    n_act = 0
    for ep in episodes:
        acts = sum(len(inv.output_ids) for inv in ep.invocations)
        copies = sum(r.length for inv in ep.invocations for r in inv.retained)
        ctx = sum(len(inv.input_ids) - ep.prefix_len for inv in ep.invocations)
        n_act += acts
        n_sel["exact_action_mask"] += acts
        n_sel["trajectory_mask"] += acts + ctx  # every non-prefix token of the transcript
        n_sel["response_mask"] += acts + copies  # every response occurrence, retained copies included
    return [{"mask": m, "selected_positions": s, "sampled_action_positions": n_act,
             "spurious_positions": s - n_act, "spurious_share": (s - n_act) / s if s else 0.0}
            for m, s in n_sel.items()]


def context_update_rows(model, episodes_by_rule: dict[str, list[Episode]], backends: list[str],
                        dtype: str = "float32") -> list[dict]:
    """RCE per memory-rewrite rule and backend."""
    from memopd.rce import rce_report

    rows = []
    for rule, eps in episodes_by_rule.items():
        rep = rce_report(model, eps, backends, dtype=dtype)
        for b, r in rep["backends"].items():
            rows.append({"rule": rule, "backend": b, "episodes": len(eps),
                         "memory_updates": sum(1 for ep in eps for inv in ep.invocations if inv.retained),
                         **{k: r[k] for k in ("max_abs_dlogp", "p99_abs_dlogp", "mean_abs_dlogp",
                                              "max_abs_dlogit", "top1_agreement", "action_tokens", "passed")}})
    return rows
