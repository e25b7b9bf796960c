"""Which exact path runs a pack fastest: a cost model over the pack's shape, calibrated by `memopd bench packing`.

`auto` (memopd.attention) runs every pack on the candidate path with the lowest predicted time
    t = w_lin * linear FLOPs + w_attn * score FLOPs + w_inv * attention calls (per layer, summed)
where each path counts what it really computes, padding and masked-out score pairs included:
  calls          every call alone as [q, x_t, a_t], all calls as one right-padded batch (the batched reference)
  segmented      the pack once through the linear layers, attention per block: each prefix on itself, each
                 call on its prefix and itself (one attention call per block and layer)
  prefix_shared  per episode: q once, then its calls as one right-padded batch over q's cached keys and values
  sdpa, eager    the whole pack as one sequence under a dense L x L mask
  flex           the whole pack, visible score pairs only (its own weight w_sparse: a different kernel)
A path is a candidate only where every one of its terms has a weight. WEIGHTS are seconds per FLOP (per
invocation) for (device, dtype, pass), fit by `memopd bench packing` as non-negative least squares on the
relative error of every timed path (`fit`); they only rank paths, so a machine's absolute speed cancels.
Pure Python over shapes: the resource plan (memopd.plan) uses it without a model.
"""
from __future__ import annotations

from dataclasses import dataclass

PATHS = ("calls", "prefix_shared", "segmented", "sdpa", "eager", "flex")
TERMS = ("lin", "attn", "sparse", "inv")


@dataclass(frozen=True)
class Dims:
    """What a forward's cost depends on: linear FLOPs per token = 2 x layer_params, score FLOPs per pair =
    4 x heads x head_dim per layer (QK^T and AV)."""
    layers: int
    layer_params: int  # parameters of one decoder layer's linear maps
    attn_width: int  # heads x head_dim

    @classmethod
    def of_config(cls, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                  head_dim: int | None = None) -> Dims:
        d = head_dim or hidden // heads
        per_layer = hidden * heads * d * 2 + hidden * kv_heads * d * 2 + 3 * hidden * intermediate  # q, o, k, v, MLP
        return cls(layers, per_layer, heads * d)


# per episode of the pack: (prefix tokens q, own tokens of each call)
Shape = list[tuple[int, list[int]]]


def features(shape: Shape, dims: Dims, path: str) -> dict[str, float]:
    """The terms of one forward of a pack on `path`: linear FLOPs, score FLOPs (dense or, for flex, sparse)
    and attention calls (each a kernel launch and its Python around it, per layer)."""
    lin_tok, pair = 2 * dims.layers * dims.layer_params, 4 * dims.layers * dims.attn_width
    if not shape or any(not ns for _, ns in shape):
        raise ValueError("cost.features: every episode of a pack needs at least one call")
    if path == "calls":
        lens = [q + n for q, ns in shape for n in ns]
        B, Lm = len(lens), max(lens)
        return {"lin": B * Lm * lin_tok, "attn": B * Lm * Lm * pair, "inv": dims.layers}
    if path == "prefix_shared":
        out = {"lin": 0.0, "attn": 0.0, "inv": 0.0}
        for q, ns in shape:
            B, Nm = len(ns), max(ns)
            out["lin"] += (q + B * Nm) * lin_tok
            out["attn"] += (q * q + B * Nm * (q + Nm)) * pair
            out["inv"] += dims.layers * (2 if q else 1)
        return out
    L = sum(q + sum(ns) for q, ns in shape)
    if path == "segmented":  # a one-call episode is one causal block over q + its call
        one = [(q, ns) for q, ns in shape if len(ns) == 1]
        many = [(q, ns) for q, ns in shape if len(ns) > 1]
        pairs = sum((q + ns[0]) ** 2 for q, ns in one) + sum(q * q + sum(n * (q + n) for n in ns) for q, ns in many)
        blocks = len(one) + sum((1 if q else 0) + len(ns) for q, ns in many)
        return {"lin": L * lin_tok, "attn": pairs * pair, "inv": dims.layers * blocks}
    if path in ("sdpa", "eager"):
        return {"lin": L * lin_tok, "attn": L * L * pair, "inv": dims.layers}
    if path == "flex":
        visible = sum(q * (q + 1) // 2 + sum(n * q + n * (n + 1) // 2 for n in ns) for q, ns in shape)
        return {"lin": L * lin_tok, "sparse": visible * pair, "inv": dims.layers}
    raise ValueError(f"cost.features: unknown path {path!r}; choose from {PATHS}")


def candidates(blocked: bool, checkpointed: bool, device: str) -> list[str]:
    """The exact paths `auto` may run a pack on (in tie-break order): segmented, prefix sharing and calls need
    blocked calls; prefix sharing reads a KV cache that checkpointed layers drop; flex only on a GPU (on a CPU it
    compiles per length and has no backward)."""
    out = ["segmented", "prefix_shared", "calls", "flex", "sdpa"] if blocked else ["flex", "sdpa"]
    return [c for c in out if not (c == "prefix_shared" and checkpointed) and not (c == "flex" and device != "cuda")]


def predict(shape: Shape, dims: Dims, path: str, weights: dict[str, float]) -> float | None:
    """Predicted seconds, or None where a term of the path has no weight (not a candidate)."""
    f = features(shape, dims, path)
    if any(k not in weights for k in f):
        return None
    return sum(weights[k] * v for k, v in f.items())


def choose(shape: Shape, dims: Dims, candidates, weights: dict[str, float]) -> str:
    """The candidate with the lowest predicted time (the first one listed on a tie)."""
    costs = [(c, predict(shape, dims, c, weights)) for c in candidates]
    costs = [(c, t) for c, t in costs if t is not None]
    if not costs:
        raise ValueError(f"cost.choose: no weights for any of {list(candidates)} (terms {sorted(weights)})")
    return min(costs, key=lambda ct: ct[1])[0]


# Without a calibration for a (device, dtype, pass), `weights` falls back to the same device's other pass or
# dtype, then to FLOP counting (all terms 1, attention calls free). cuda: not calibrated (no GPU here): FLOP
# counting with flex's visible pairs at the dense rate, so flex wins wherever masked-out pairs dominate; run
# the benchmark on the GPU (`memopd bench packing --weights-out`) to replace it.
WEIGHTS: dict[tuple[str, str, str], dict[str, float]] = {
    # `memopd bench packing --threads 2` (all nine configurations, 10 interleaved repeats) on 2 Intel cores
    # without AMX, tiny Qwen2 h256 x 4, fp32 (README "Packing benchmark")
    ("cpu", "float32", "forward"): {"lin": 8.694e-12, "attn": 9.618e-12, "inv": 7.836e-04},
    ("cpu", "float32", "forward_backward"): {"lin": 2.733e-11, "attn": 2.514e-11, "inv": 1.234e-03},
    ("cuda", "bfloat16", "forward"): {"lin": 1.0, "attn": 1.0, "sparse": 1.0, "inv": 0.0},
    ("cuda", "bfloat16", "forward_backward"): {"lin": 1.0, "attn": 1.0, "sparse": 1.0, "inv": 0.0},
}
FLOPS_ONLY = {"lin": 1.0, "attn": 1.0, "inv": 0.0}


def weights(device: str, dtype: str, pass_: str) -> dict[str, float]:
    """The calibrated weights for (device type, dtype name, 'forward' | 'forward_backward'), else the nearest."""
    for key in ((device, dtype, pass_), *((d, t, p) for (d, t, p) in WEIGHTS if d == device and t == dtype),
                *((d, t, p) for (d, t, p) in WEIGHTS if d == device and p == pass_)):
        if key in WEIGHTS:
            return WEIGHTS[key]
    return FLOPS_ONLY


def fit(rows: list[dict]) -> dict[str, float]:
    """Non-negative weights minimising the relative error sum((predicted - seconds) / seconds)^2 over rows of
    {'features': {term: value}, 'seconds': s}. A term no row has gets no weight."""
    import numpy as np
    from scipy.optimize import nnls

    terms = [t for t in TERMS if any(t in r["features"] for r in rows)]
    A = np.array([[r["features"].get(t, 0.0) / r["seconds"] for t in terms] for r in rows])
    scale = A.max(axis=0)
    scale[scale == 0] = 1.0
    w, _ = nnls(A / scale, np.ones(len(rows)))
    return {t: float(x / s) for t, x, s in zip(terms, w, scale)}
