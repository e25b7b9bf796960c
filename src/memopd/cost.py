"""Which exact path runs a pack fastest: a cost model over the pack's shape, calibrated by `memopd bench packing`.

`auto` (memopd.attention) runs every pack on the candidate path with the lowest predicted time
    t = w_lin * linear FLOPs + w_attn * score FLOPs + w_inv * attention calls (per layer, summed)
        + w_copy * prefix key/value elements copied per call + w_dec * decoder invocations
where each path counts what it really computes, padding and masked-out score pairs included:
  calls          every call alone as [q, x_t, a_t], all calls as one right-padded batch (the batched reference)
  segmented      the pack once through the linear layers, attention per block: each prefix on itself, each
                 call on its prefix and itself. On a CPU a call block is two fused kernels (its prefix, then
                 causally itself) merged by log-sum-exp; elsewhere one kernel over its prefix's keys and values
                 concatenated with its own (copies) under a mask
  prefix_shared  per episode: q once, then its calls as one right-padded batch over q's cached keys and values
                 (a second decoder invocation, and the cache repeated once per call: copies)
  sdpa, eager    the whole pack as one sequence under a dense L x L mask
  flex           the whole pack, visible score pairs only (its own weight w_sparse: a different kernel)
A path is a candidate only where every one of its FLOP terms has a weight. WEIGHTS are seconds per FLOP (per
invocation) for (device, dtype, pass), fit by `memopd bench packing` as non-negative least squares on the
relative error of every timed path (`fit`); they only rank paths, so a machine's absolute speed cancels.
Pure Python over shapes: the resource plan (memopd.plan) uses it without a model.
"""
from __future__ import annotations

from dataclasses import dataclass

PATHS = ("calls", "prefix_shared", "segmented", "sdpa", "eager", "flex")
TERMS = ("lin", "attn", "sparse", "inv", "copy", "dec")
OVERHEADS = ("inv", "copy", "dec")  # not FLOPs: free where a weight set does not price them


@dataclass(frozen=True)
class Dims:
    """What a forward's cost depends on: linear FLOPs per token = 2 x layer_params, score FLOPs per pair =
    4 x heads x head_dim per layer (QK^T and AV), key + value elements per token = 2 x kv_width per layer."""
    layers: int
    layer_params: int  # parameters of one decoder layer's linear maps
    attn_width: int  # heads x head_dim
    kv_width: int = 0  # key/value heads x head_dim (0: attn_width, no grouped-query attention)

    def __post_init__(self):
        if not self.kv_width:
            object.__setattr__(self, "kv_width", self.attn_width)

    @classmethod
    def of_config(cls, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                  head_dim: int | None = None) -> Dims:
        d = head_dim or hidden // heads
        per_layer = hidden * heads * d * 2 + hidden * kv_heads * d * 2 + 3 * hidden * intermediate  # q, o, k, v, MLP
        return cls(layers, per_layer, heads * d, kv_heads * d)


# per episode of the pack: (prefix tokens q, own tokens of each call)
Shape = list[tuple[int, list[int]]]


def features(shape: Shape, dims: Dims, path: str, device: str = "cpu") -> dict[str, float]:
    """The terms of one forward of a pack on `path`: linear FLOPs, score FLOPs (dense or, for flex, sparse),
    attention calls (each a kernel launch and its Python around it, per layer), key/value elements copied
    (all layers) and decoder invocations (embedding, rotary, mask set-up and the layer loop's Python). `device`
    (a torch device type) decides how segmented runs a call block (memopd.attention.fused_prefix_blocks)."""
    lin_tok, pair = 2 * dims.layers * dims.layer_params, 4 * dims.layers * dims.attn_width
    kv, kv_full = 2 * dims.layers * dims.kv_width, 2 * dims.layers * dims.attn_width  # per token: k and v, all layers
    if not shape or any(not ns for _, ns in shape):
        raise ValueError("cost.features: every episode of a pack needs at least one call")
    if path == "calls":
        lens = [q + n for q, ns in shape for n in ns]
        B, Lm = len(lens), max(lens)
        return {"lin": B * Lm * lin_tok, "attn": B * Lm * Lm * pair, "inv": dims.layers, "copy": 0, "dec": 1}
    if path == "prefix_shared":
        out = {"lin": 0.0, "attn": 0.0, "inv": 0.0, "copy": 0.0, "dec": 0.0}
        for q, ns in shape:
            B, Nm = len(ns), max(ns)
            out["lin"] += (q + B * Nm) * lin_tok
            out["attn"] += (q * q + B * Nm * (q + Nm)) * pair
            out["inv"] += dims.layers * (2 if q else 1)
            out["copy"] += B * q * kv  # the prefix's cache repeated for every call of the batch
            out["dec"] += 2 if q else 1
        return out
    L = sum(q + sum(ns) for q, ns in shape)
    if path == "segmented":  # a one-call episode is one causal block over q + its call
        one = [(q, ns) for q, ns in shape if len(ns) == 1]
        many = [(q, ns) for q, ns in shape if len(ns) > 1]
        pairs = sum((q + ns[0]) ** 2 for q, ns in one) + sum(q * q + sum(n * (q + n) for n in ns) for q, ns in many)
        fused = device == "cpu"  # a call block over a prefix: two kernels, or one over concatenated keys
        blocks = len(one) + sum((1 if q else 0) + len(ns) * (2 if fused and q else 1) for q, ns in many)
        # unfused, each call's keys and values are its prefix's concatenated with its own (all heads: grouped-query
        # keys are repeated first)
        copies = 0 if fused else sum((q + n) * kv_full for q, ns in many if q for n in ns)
        return {"lin": L * lin_tok, "attn": pairs * pair, "inv": dims.layers * blocks, "copy": copies, "dec": 1}
    if path in ("sdpa", "eager"):
        return {"lin": L * lin_tok, "attn": L * L * pair, "inv": dims.layers, "copy": 0, "dec": 1}
    if path == "flex":
        visible = sum(q * (q + 1) // 2 + sum(n * q + n * (n + 1) // 2 for n in ns) for q, ns in shape)
        return {"lin": L * lin_tok, "sparse": visible * pair, "inv": dims.layers, "copy": 0, "dec": 1}
    raise ValueError(f"cost.features: unknown path {path!r}; choose from {PATHS}")


def candidates(blocked: bool, checkpointed: bool, device: str) -> list[str]:
    """The exact paths `auto` may run a pack on (in tie-break order): segmented, prefix sharing and calls need
    blocked calls; prefix sharing reads a KV cache that checkpointed layers drop; flex only on a GPU (on a CPU it
    compiles per length and has no backward)."""
    out = ["segmented", "prefix_shared", "calls", "flex", "sdpa"] if blocked else ["flex", "sdpa"]
    return [c for c in out if not (c == "prefix_shared" and checkpointed) and not (c == "flex" and device != "cuda")]


def predict(shape: Shape, dims: Dims, path: str, weights: dict[str, float], device: str = "cpu") -> float | None:
    """Predicted seconds, or None where a FLOP term of the path has no weight (not a candidate); an overhead term
    without a weight (a weight set fit before it existed) is free."""
    f = features(shape, dims, path, device)
    if any(k not in weights for k in f if k not in OVERHEADS):
        return None
    return sum(weights.get(k, 0.0) * v for k, v in f.items())


def choose(shape: Shape, dims: Dims, candidates, weights: dict[str, float], device: str = "cpu") -> str:
    """The candidate with the lowest predicted time on `device` (the first one listed on a tie)."""
    costs = [(c, predict(shape, dims, c, weights, device)) for c in candidates]
    costs = [(c, t) for c, t in costs if t is not None]
    if not costs:
        raise ValueError(f"cost.choose: no weights for any of {list(candidates)} (terms {sorted(weights)})")
    return min(costs, key=lambda ct: ct[1])[0]


# Without a calibration for a (device, dtype, pass), `weights` falls back to the same device's other pass or
# dtype, then to FLOP counting (all FLOP terms 1, the overheads free). cuda: not calibrated: FLOP
# counting with flex's visible pairs at the dense rate, so flex wins wherever masked-out pairs dominate; run the
# benchmark on the GPU (`memopd bench packing --weights-out`) to replace it.
WEIGHTS: dict[tuple[str, str, str], dict[str, float]] = {
    # `memopd bench packing --repeats 12 --threads 2` on 2 Intel cores without AMX, tiny Qwen2 h256 x 4, fp32, all
    # nine configurations, timed with segmented's unfused call blocks; the fused blocks' run is out of sample for
    # them (docs/results.md "Packing benchmark")
    ("cpu", "float32", "forward"): {"lin": 8.139e-12, "attn": 9.810e-12, "inv": 0.0, "copy": 3.398e-09, "dec": 3.487e-03},
    ("cpu", "float32", "forward_backward"): {"lin": 2.606e-11, "attn": 2.857e-11, "inv": 0.0, "copy": 6.242e-09,
                                             "dec": 1.175e-02},
    ("cuda", "bfloat16", "forward"): {"lin": 1.0, "attn": 1.0, "sparse": 1.0},
    ("cuda", "bfloat16", "forward_backward"): {"lin": 1.0, "attn": 1.0, "sparse": 1.0},
}
FLOPS_ONLY = {"lin": 1.0, "attn": 1.0}


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
