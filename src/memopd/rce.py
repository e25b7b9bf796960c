"""RCE (rollout context equivalence): packed execution vs each call run alone.

For every sampled action token, compare the packed logits at gamma(t, k) with the logits of the
independent call: |d log p| of the sampled token (max, p99, mean), full-vocabulary max |d logit|,
and top-1 agreement; per call and overall. Pass/fail gates on BOTH max |d log p| <= tol["dlogp"] and
max |d logit| <= tol["dlogit"] (the OPD term reads every logit, not only the sampled token's), with
the tolerances chosen by compute dtype (`tolerances`) and stated in every report.

Memory is bounded by a chunk of action positions, not by the number N of action tokens: the final hidden
states of both sides are computed once ((N, h) is small: the reference call by call, the packed side one
pack at a time), and the LM head, log-softmax and comparison run on `CHUNK` positions at a time, keeping
only per-token values (|d log p|, the row's max |d logit|, top-1 agreement; N floats each) from which every
statistic is reduced. The statistics are the ones the unchunked comparison gives (the same per-token values;
max, quantile and mean of the same vectors), bitwise where the LM head computes a row the same whatever the
number of rows in the product (a CPU BLAS rounds products of 1-3 rows differently, by ~1 ulp of a logit; so did
the unchunked code, which ran the head per pack on one side and over all N rows on the other).
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from memopd.attention import (
    independent_hidden,
    lm_logits,
    packed_hidden,
    packed_logits,
    token_logprobs,
)
from memopd.packing import Packed, pack
from memopd.records import Episode

# The gated quantities: name -> (statistic in a `compare` dict, how messages and captions write it).
QUANTITIES = {"dlogp": ("max_abs_dlogp", "|d log p|"), "dlogit": ("max_abs_dlogit", "|d logit|")}

# Tolerances by compute dtype, on max |d log p| of the sampled token AND on the full-vocabulary max |d logit|
# (the one place they live; `tolerances` looks them up and applies overrides). Measured floors: packed
# (sdpa, eager, prefix_shared) vs calls run alone, random episodes of every rule, CPU.
#   fp32, logits up to |0.5-1.6| (random-init tiny Qwen2s: the tests' and hidden 256 / 4 layers / vocab 4096):
#     max |d logit| 6e-8 - 1.4e-6; max |d log p| 4.8e-7 - 9.5e-7 (1-2 fp32 ulps: `token_logprobs` rounds
#     log p to fp32). lm_head scaled so logits reach |20|, as a trained model's do: |d logit| 6.7e-6 - 1.9e-5,
#     |d log p| 6.7e-6 - 1.7e-5; at |40| 1.3e-5 - 1.5e-5. The floor (reduction order only) grows up to
#     ~1e-6 x max|logit|; a measurement on an SFT student gave up to 4e-5 |d log p| at |20|.
#   Structural errors, |d logit| / |d log p| (tiny Qwen2, sdpa): persistent history or a leaking mask
#     0.09-0.18 / 0.04-0.11 at |1|, 2.3-4.8 / 0.8-3.3 at |20|; running positions only 2.5e-3 - 4.7e-3 /
#     6e-4 - 3e-3 at |1|, 0.07-0.12 / 0.02-0.1 at |20|; position ids without a mask 0.17-0.36 at |1|,
#     4.5-9.5 at |20|. Logit errors exceed log-p errors: |d log p| <= 2 max|d logit| always, but a shift
#     common to all logits cancels in log p, and the max over the vocabulary is an extreme value.
#   fp32 |d log p| 1e-4: > 1000x below the smallest structural error on a trained model (~0.4 nats, a call
#     cut off from q), > 2x above the student's 4e-5. fp32 |d logit| 1e-3: 50x above the measured floor at
#     |20| (room for the extreme value over a 151,936-token vocabulary and other kernels), 2.5x - 2000x below
#     every structural logit error above (> 2000x below the persistent history at |20|).
#   bf16 / fp16: packed and independent logits differ by 1 ulp of the logit: bf16 3.9e-3 at |0.78|, 0.125 at
#     |20| (the ulp in [16, 32)), 0.25 at |40|; fp16 4.9e-4 at |0.7|, 1.6e-2 at |20| (measured pure and, for
#     bf16, under autocast as the training guard runs). |d logit| tolerance = 4 ulps of a logit in [16, 32)
#     (2 in [32, 64)): bf16 0.5, fp16 0.0625. |d log p| follows the same ulp: bf16 measured 0.12-0.14 at
#     |20| and up to 0.34 at |40| (a tolerance of 5e-2 would stop a trained bf16 model on noise), so bf16
#     |d log p| is 0.5 too (still below the persistent history's 0.8-3.3 at |20|; a positions-only error
#     of a trained model, 0.02-0.1, is under the bf16 floor and only fp32 can see it); fp16 1.6e-2 at |20|,
#     under its 2e-2.
#   SmolLM2-135M-Instruct (the packaged base model, vocab 49,152), 5 synthetic episodes of real-range ids,
#     one per rule, sdpa / prefix_shared: fp32 max |d logit| 9.6e-5 / 7.8e-5, |d log p| 2.3e-5 / 2.1e-5
#     (10x under 1e-3 / 4x under 1e-4); bf16 autocast |d logit| 0.5 (its logits reach the [64, 128) binade,
#     ulp 0.5), |d log p| 0.17-0.19. So bf16 |d logit| is 1.0 (2 ulps there).
RCE_TOLERANCES = {
    "float32": {"dlogp": 1e-4, "dlogit": 1e-3},
    "float16": {"dlogp": 2e-2, "dlogit": 6.25e-2},
    "bfloat16": {"dlogp": 0.5, "dlogit": 1.0},
}
# Half precision: the tolerances grow with the spacing (ulp) of the row's largest logit
# (docs/method.md "The bf16 RCE tolerance"): a token passes if each error is <= max(the tolerance above,
# RCE_ULPS[dtype][q] ulps of that logit). The error of a correct pack is a few ulps of the largest logit at any magnitude (bf16, hidden 2048, 2 or
# 8 layers: 2 ulps from |20| to |226|), so a fixed bound stops a model whose logits outgrow it, while a pack read
# one position off reads another position's logits, > 20x the allowed error at every magnitude from |20|. The
# ulp counts are the fixed tolerances' own in [16, 32) (bf16 |d logit| 1.0 = 8 ulps of 0.125, |d log p| 0.5 = 4;
# fp16 |d logit| 4 ulps of 2^-6, |d log p| 1), so nothing changes below |32|. fp32 keeps its fixed bounds.
RCE_ULPS = {"bfloat16": {"dlogp": 4, "dlogit": 8}, "float16": {"dlogp": 1, "dlogit": 4}}
MANTISSA_BITS = {"float32": 23, "bfloat16": 7, "float16": 10}


# Action positions per full-vocabulary chunk: at most (CHUNK, V) logits of each side are alive at a time
# (V = 151,936: 0.6 GB per side in fp32, plus the float64 copies of `token_stats`). memopd.plan mirrors it.
CHUNK = 1024
# Above this many logit elements (N x V) `chunked_token_logprobs` recomputes a chunk's logits in the backward
# instead of keeping them (as sft/loss.py does).
_KEEP_LOGITS = 1 << 26


class RCEError(AssertionError):
    """A packed representation is not equivalent to the rollout it came from."""


def tolerances(dtype: str = "float32", tolerance: float | dict | None = None) -> dict[str, float]:
    """{"dlogp": ..., "dlogit": ...} for `dtype`. `tolerance` overrides: a number applies to both
    quantities, a dict to the ones it names (the others keep the dtype's values)."""
    if tolerance is not None and not isinstance(tolerance, dict):
        tolerance = dict.fromkeys(QUANTITIES, tolerance)
    override = {q: float(v) for q, v in (tolerance or {}).items() if v is not None}
    unknown = set(override) - set(QUANTITIES)
    if unknown:
        raise ValueError(f"unknown RCE tolerance key(s) {sorted(unknown)}; known: {', '.join(QUANTITIES)}")
    if set(override) == set(QUANTITIES):
        tol = override  # complete: no dtype needed
    elif dtype in RCE_TOLERANCES:
        tol = {**RCE_TOLERANCES[dtype], **override}
    else:
        raise ValueError(f"no RCE tolerance for dtype {dtype!r}; known: {', '.join(RCE_TOLERANCES)} "
                         f"(or pass tolerance=)")
    if any(not v >= 0 for v in tol.values()):
        raise ValueError(f"RCE tolerances must be >= 0, got {tol}")
    return tol


def tolerance_fields(tol: dict[str, float]) -> dict[str, float]:
    """The tolerances as flat report / CSV fields: tolerance_dlogp, tolerance_dlogit."""
    return {f"tolerance_{q}": tol[q] for q in QUANTITIES}


def failed_quantities(stats: dict, tol: dict[str, float]) -> list[str]:
    """The quantities ("dlogp", "dlogit") whose max exceeds its tolerance (NaN fails): per token against its
    magnitude-scaled tolerance where `stats` has it (`{q}_over_tol`, the largest error / allowed ratio)."""
    return [q for q, (key, _) in QUANTITIES.items()
            if not (stats[f"{q}_over_tol"] <= 1.0 if f"{q}_over_tol" in stats else stats[key] <= tol[q])]


def ulp(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """The spacing of `dtype` numbers at |x| (float64): 2^(floor(log2 |x|) - mantissa bits)."""
    x = x.double().abs().clamp_min(torch.finfo(torch.float64).tiny)
    return torch.exp2(torch.floor(torch.log2(x)) - MANTISSA_BITS[dtype])


def allowed(scale: torch.Tensor, tol: dict[str, float], dtype: str) -> dict[str, torch.Tensor]:
    """Per-token tolerances: max(tol[q], RCE_ULPS[dtype][q] ulps of the row's largest |logit| `scale`)."""
    k = RCE_ULPS.get(dtype)
    step = ulp(scale, dtype) if k else torch.zeros_like(scale, dtype=torch.float64)
    return {q: (step * (k[q] if k else 0)).clamp_min(tol[q]) for q in QUANTITIES}


def gate(stats: dict, tol: dict[str, float]) -> dict:
    """`stats` (a `compare` dict) with the verdict: passed iff max |d log p| <= tol["dlogp"] and max |d logit|
    <= tol["dlogit"]; failed_on names the quantities that did not."""
    failed = failed_quantities(stats, tol)
    return {**stats, "passed": not failed, "failed_on": failed}


def spans(n: int, size: int = CHUNK) -> list[tuple[int, int]]:
    """[start, stop) of the fewest consecutive chunks of at most `size` covering range(n), of balanced lengths
    (no small tail chunk: a BLAS may round a matrix product of very few rows differently, ~1 ulp)."""
    if size < 1:
        raise ValueError(f"chunk size must be >= 1, got {size}")
    k = -(-n // size)
    return [(n * i // k, n * (i + 1) // k) for i in range(k)]


def token_stats(ref_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """(n, V), (n, V), (n,) -> per-token values: "dlogp" |d log p| of the target (fp32, as `token_logprobs`
    rounds), "dlogit" the row's full-vocabulary max |d logit| (float64), "top1" argmax agreement (bool), "scale"
    the reference row's largest |logit| (what the half-precision tolerances grow with: `allowed`)."""
    ref_logits, logits = ref_logits.double(), logits.double()
    dlp = (token_logprobs(logits, targets) - token_logprobs(ref_logits, targets)).abs()
    return {"dlogp": dlp, "dlogit": (logits - ref_logits).abs().amax(-1),
            "top1": logits.argmax(-1) == ref_logits.argmax(-1),
            "scale": torch.maximum(ref_logits.amax(-1), -ref_logits.amin(-1))}  # no (n, V) |logits| copy


def cat_stats(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def summarize(tok: dict[str, torch.Tensor], index: torch.Tensor | None = None,
              allow: dict[str, torch.Tensor] | None = None) -> dict:
    """The RCE statistics of per-token values (`token_stats`), over `index` (default: all tokens); with `allow`
    (per-token tolerances, `allowed`) also each quantity's largest error / tolerance ratio ({q}_over_tol)."""
    if index is not None:
        tok = {k: v[index.to(v.device)] for k, v in tok.items()}
        allow = {q: v[index.to(v.device)] for q, v in allow.items()} if allow is not None else None
    dlp = tok["dlogp"]
    out = {
        "max_abs_dlogp": dlp.max().item(),
        "p99_abs_dlogp": torch.quantile(dlp, 0.99).item(),
        "mean_abs_dlogp": dlp.mean().item(),
        "max_abs_dlogit": tok["dlogit"].max().item(),
        "top1_agreement": tok["top1"].double().mean().item(),
        "action_tokens": int(dlp.numel()),
    }
    if "scale" in tok:
        out["max_abs_logit"] = tok["scale"].max().item()
    if allow is not None:
        out.update({f"{q}_over_tol": (tok[q].double() / allow[q]).max().item() for q in QUANTITIES})
    return out


def compare(ref_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, chunk: int = CHUNK) -> dict:
    """(N, V), (N, V), (N,) -> the RCE statistics of one set of action tokens (compared `chunk` rows at a time)."""
    return summarize(cat_stats([token_stats(ref_logits[s:e], logits[s:e], targets[s:e])
                                for s, e in spans(targets.numel(), chunk)]))


def logit_chunks(model, hidden: torch.Tensor, chunk: int = CHUNK):
    """(start, stop, logits) of (N, H) hidden states, `chunk` rows at a time."""
    for s, e in spans(hidden.shape[0], chunk):
        yield s, e, lm_logits(model, hidden[s:e])


def packed_logit_chunks(model, packed: Packed, backend: str, chunk: int = CHUNK):
    """(start, stop, logits) at the packed action positions: the decoder runs once; the LM head `chunk` positions
    at a time (a pack with at most `chunk` actions is scored whole, by `packed_logits`)."""
    n = packed.targets.numel()
    if n <= chunk:
        if n:
            yield 0, n, packed_logits(model, packed, backend)
        return
    yield from logit_chunks(model, packed_hidden(model, packed, backend), chunk)


def chunked_token_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """(N, H), (N,) -> (N,) fp32 log p of each target, the LM head `chunk` rows at a time (= `token_logprobs` of
    `lm_logits(model, hidden)`). Under autograd a chunk's logits are recomputed in the backward once N x V
    exceeds _KEEP_LOGITS, so at most one chunk of logits is alive forward or backward."""
    if hidden.shape[0] == 0:
        return hidden.new_zeros(0, dtype=torch.float32)
    targets = targets.to(hidden.device)

    def lp(h, t):
        return token_logprobs(lm_logits(model, h), t)

    vocab = model.get_output_embeddings().weight.shape[0]
    recompute = torch.is_grad_enabled() and hidden.requires_grad and hidden.shape[0] * vocab > _KEEP_LOGITS
    return torch.cat([checkpoint(lp, hidden[s:e], targets[s:e], use_reentrant=False) if recompute
                      else lp(hidden[s:e], targets[s:e]) for s, e in spans(hidden.shape[0], chunk)])


@torch.no_grad()
def independent_token_logprobs(model, episodes, targets: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """`token_logprobs(independent_logits(model, episodes), targets)` without the (N, V) logits: every call run
    alone (hidden states), the LM head `chunk` positions at a time."""
    return chunked_token_logprobs(model, independent_hidden(model, episodes), targets, chunk)


def _per_call(packed: Packed) -> list[tuple[int, int, torch.Tensor]]:
    """(segment, call, mask over the action order) for every call."""
    a = packed.action_index
    seg, call = packed.segment[a], packed.call[a]
    keys = sorted(set(zip(seg.tolist(), call.tolist())))
    return [(s, t, (seg == s) & (call == t)) for s, t in keys]


@torch.no_grad()
def rce_backend(model, episodes: list[Episode], backend: str, tolerance: float | dict | None = None,
                layout: str = "exact", ref_logits: torch.Tensor | None = None, max_len: int | None = None,
                dtype: str = "float32", ref_hidden: torch.Tensor | None = None, chunk: int = CHUNK) -> dict:
    """RCE of one backend over `episodes` (packed together when they fit, one pack each otherwise), gated
    on both quantities; `tolerance` as in `tolerances(dtype, tolerance)`. The reference: `ref_hidden` (the
    independent calls' final hidden states, (N, H)), else `ref_logits` ((N, V)), else computed here call by
    call; the comparison runs `chunk` action positions at a time (see the module docstring)."""
    packs = [pack(ep, max_len=max_len, layout=layout) for ep in episodes]
    return rce_packs(model, episodes, packs, backend, tolerance, ref_logits, dtype, ref_hidden, chunk)


@torch.no_grad()
def rce_packs(model, episodes: list[Episode], packs: list[Packed], backend: str, tolerance: float | dict | None = None,
              ref_logits: torch.Tensor | None = None, dtype: str = "float32", ref_hidden: torch.Tensor | None = None,
              chunk: int = CHUNK) -> dict:
    """`rce_backend` of given packs (one per episode, in order): each token gated against `allowed`."""
    tol = tolerances(dtype, tolerance)
    if ref_logits is None and ref_hidden is None:
        ref_hidden = independent_hidden(model, episodes)
    parts, offset = [], 0
    for p in packs:
        for s, e, logits in packed_logit_chunks(model, p, backend, chunk):
            a, b = offset + s, offset + e
            ref = ref_logits[a:b] if ref_logits is not None else lm_logits(model, ref_hidden[a:b])
            parts.append(token_stats(ref, logits, p.targets[s:e]))
            del ref, logits
        offset += p.targets.numel()
    tok = cat_stats(parts)
    allow = allowed(tok["scale"], tol, dtype)
    out = {**gate(summarize(tok, allow=allow), tol), **tolerance_fields(tol)}
    calls, offset = [], 0
    for e, p in enumerate(packs):
        for _, t, m in _per_call(p):
            calls.append({"episode": e, "task_id": episodes[e].task_id, "call": t,
                          **gate(summarize(tok, m.nonzero().squeeze(-1) + offset, allow), tol)})
        offset += p.targets.numel()
    out["per_call"] = calls
    return out


def rce_report(model, episodes: list[Episode], backends, dtype: str = "float32",
               tolerance: float | dict | None = None, layout: str = "exact", chunk: int = CHUNK) -> dict:
    """The RCE report of several backends against one independent reference (its hidden states, computed once).
    States the dtype and both tolerances (tolerance_dlogp, tolerance_dlogit; `tolerance` repeats tolerance_dlogp
    for older readers)."""
    tol = tolerances(dtype, tolerance)
    with torch.no_grad():
        ref = independent_hidden(model, episodes)
    report = {"dtype": dtype, "tolerance": tol["dlogp"], **tolerance_fields(tol), "layout": layout,
              "episodes": len(episodes), "backends": {}}
    for b in backends:
        report["backends"][b] = rce_backend(model, episodes, b, tol, layout=layout, ref_hidden=ref, dtype=dtype,
                                            chunk=chunk)
    report["passed"] = all(r["passed"] for r in report["backends"].values())
    return report


def report_rows(report: dict) -> list[dict]:
    """Flatten a report to CSV rows: one per (backend, episode, call) plus one overall row per backend; every
    row states the dtype and both tolerances its `passed` was judged against."""
    rows = []
    keys = ["max_abs_dlogp", "p99_abs_dlogp", "mean_abs_dlogp", "max_abs_dlogit", "top1_agreement", "action_tokens"]
    tol = {q: report[f"tolerance_{q}"] for q in QUANTITIES}
    judged = {"dtype": report["dtype"], **tolerance_fields(tol)}
    for name, r in report["backends"].items():
        rows.append({"backend": name, "episode": "all", "call": "all", **{k: r[k] for k in keys}, "passed": r["passed"],
                     **judged})
        for c in r["per_call"]:
            rows.append({"backend": name, "episode": c["episode"], "call": c["call"], **{k: c[k] for k in keys},
                         "passed": not failed_quantities(c, tol), **judged})
    return rows


def failure_message(r: dict, backend: str, tol: dict[str, float], dtype: str | None = None) -> str:
    """Which quantity failed (|d log p| and/or |d logit|), its max, its tolerance, and the worst episode /
    task / call for each, from an `rce_backend` result."""
    parts = []
    for q in failed_quantities(r, tol):
        key, label = QUANTITIES[q]
        rank = f"{q}_over_tol" if f"{q}_over_tol" in r else key
        worst = max(r["per_call"], key=lambda c: c[rank] if c[rank] == c[rank] else float("inf"))  # NaN is worst
        grown = f" or {RCE_ULPS[dtype][q]} ulps of the row's largest logit (|logit| up to {r['max_abs_logit']:.3g}; " \
                f"{r[rank]:.3g}x its tolerance)" if RCE_ULPS.get(dtype) and "max_abs_logit" in r else ""
        parts.append(f"max {label} {r[key]:.3g} > {tol[q]:g}{grown} (worst: episode {worst['episode']} task "
                     f"{worst['task_id']!r} call {worst['call']})")
    where = f"backend {backend}" + (f" ({dtype})" if dtype else "")
    return f"RCE failed for {where}: " + "; ".join(parts)


def guard(model, episodes: list[Episode], backend: str, dtype: str = "float32",
          tolerance: float | dict | None = None, chunk: int = CHUNK) -> dict:
    """Raise RCEError naming the failed quantity and the worst episode and call if packed scoring is not
    exact (max |d log p| or full-vocabulary max |d logit| above the dtype's tolerance)."""
    tol = tolerances(dtype, tolerance)
    r = rce_backend(model, episodes, backend, tol, dtype=dtype, chunk=chunk)
    if not r["passed"]:
        raise RCEError(failure_message(r, backend, tol, dtype))
    return r
