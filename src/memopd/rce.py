"""RCE (rollout context equivalence): packed execution vs each call run alone.

For every sampled action token, compare the packed logits at gamma(t, k) with the logits of the
independent call: |d log p| of the sampled token (max, p99, mean), full-vocabulary max |d logit|,
and top-1 agreement; per call and overall; pass/fail against a tolerance chosen by dtype.
"""
from __future__ import annotations

import torch

from memopd.attention import independent_logits, packed_logits, token_logprobs
from memopd.packing import Packed, pack
from memopd.records import Episode

# Tolerance on max |d log p| of the sampled token, by compute dtype (fp32 floor ~1e-6; bf16 ~1e-2).
# fp32: the floor grows with the logit scale (9.5e-7 on random-init tiny models, up to 4e-5 on the SFT student
# whose logits reach |20|: reduction order only); 1e-4 keeps > 1000x below the smallest structural error
# (~0.4 nats: a call cut off from q), so noise never stops a run and a broken state always does
TOLERANCES = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}


class RCEError(AssertionError):
    """A packed representation is not equivalent to the rollout it came from."""


def compare(ref_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> dict:
    """(N, V), (N, V), (N,) -> the RCE statistics of one set of action tokens."""
    ref_logits, logits = ref_logits.double(), logits.double()
    dlp = (token_logprobs(logits, targets) - token_logprobs(ref_logits, targets)).abs()
    return {
        "max_abs_dlogp": dlp.max().item(),
        "p99_abs_dlogp": torch.quantile(dlp, 0.99).item(),
        "mean_abs_dlogp": dlp.mean().item(),
        "max_abs_dlogit": (logits - ref_logits).abs().max().item(),
        "top1_agreement": (logits.argmax(-1) == ref_logits.argmax(-1)).double().mean().item(),
        "action_tokens": int(targets.numel()),
    }


def _per_call(packed: Packed) -> list[tuple[int, int, torch.Tensor]]:
    """(segment, call, mask over the action order) for every call."""
    a = packed.action_index
    seg, call = packed.segment[a], packed.call[a]
    keys = sorted(set(zip(seg.tolist(), call.tolist())))
    return [(s, t, (seg == s) & (call == t)) for s, t in keys]


@torch.no_grad()
def rce_backend(model, episodes: list[Episode], backend: str, tolerance: float, layout: str = "exact",
                ref_logits: torch.Tensor | None = None, max_len: int | None = None) -> dict:
    """RCE of one backend over `episodes` (packed together when they fit, one pack each otherwise)."""
    packs = [pack(ep, max_len=max_len, layout=layout) for ep in episodes]
    logits = torch.cat([packed_logits(model, p, backend) for p in packs])
    targets = torch.cat([p.targets for p in packs])
    if ref_logits is None:
        ref_logits = independent_logits(model, episodes)
    out = compare(ref_logits, logits, targets)
    out["passed"] = out["max_abs_dlogp"] <= tolerance
    calls, offset = [], 0
    for e, p in enumerate(packs):
        n = p.targets.numel()
        for _, t, m in _per_call(p):
            sel = m.nonzero().squeeze(-1) + offset
            calls.append({"episode": e, "task_id": episodes[e].task_id, "call": t,
                          **compare(ref_logits[sel], logits[sel], targets[sel])})
        offset += n
    out["per_call"] = calls
    return out


def rce_report(model, episodes: list[Episode], backends, dtype: str = "float32", tolerance: float | None = None,
               layout: str = "exact") -> dict:
    """The RCE report of several backends against one independent reference."""
    tol = TOLERANCES[dtype] if tolerance is None else tolerance
    with torch.no_grad():
        ref = independent_logits(model, episodes)
    report = {"dtype": dtype, "tolerance": tol, "layout": layout, "episodes": len(episodes), "backends": {}}
    for b in backends:
        report["backends"][b] = rce_backend(model, episodes, b, tol, layout=layout, ref_logits=ref)
    report["passed"] = all(r["passed"] for r in report["backends"].values())
    return report


def report_rows(report: dict) -> list[dict]:
    """Flatten a report to CSV rows: one per (backend, episode, call) plus one overall row per backend."""
    rows = []
    keys = ["max_abs_dlogp", "p99_abs_dlogp", "mean_abs_dlogp", "max_abs_dlogit", "top1_agreement", "action_tokens"]
    for name, r in report["backends"].items():
        rows.append({"backend": name, "episode": "all", "call": "all", **{k: r[k] for k in keys}, "passed": r["passed"]})
        for c in r["per_call"]:
            rows.append({"backend": name, "episode": c["episode"], "call": c["call"], **{k: c[k] for k in keys},
                         "passed": c["max_abs_dlogp"] <= report["tolerance"]})
    return rows


def guard(model, episodes: list[Episode], backend: str, dtype: str = "float32", tolerance: float | None = None) -> dict:
    """Raise RCEError naming the worst episode and call if packed scoring is not exact."""
    tol = TOLERANCES[dtype] if tolerance is None else tolerance
    r = rce_backend(model, episodes, backend, tol)
    if not r["passed"]:
        worst = max(r["per_call"], key=lambda c: c["max_abs_dlogp"])
        raise RCEError(f"RCE failed for backend {backend}: max |d log p| {r['max_abs_dlogp']:.3g} > {tol:g} "
                       f"(worst: episode {worst['episode']} task {worst['task_id']!r} call {worst['call']})")
    return r
