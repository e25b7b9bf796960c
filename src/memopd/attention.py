"""Executing a packed sequence: one semantics, several backends, each checked by RCE.

Backends (`BACKENDS`):
  sdpa           dense 4-D bool mask (True = attend) under scaled_dot_product_attention
  eager          dense 4-D additive float mask (0 / dtype-min). A bool or {0,1} mask under eager
                 is added to the scores and is silently *not* a mask, hence its own builder.
  flex           FlexAttention BlockMask (GPU fast path; on CPU forward only)
  prefix_shared  run q once, reuse its keys/values for all calls of the episode run as one batch
  calls          every call alone as [q, x_t, a_t], all calls as one right-padded batch (the batched
                 reference, run from the pack: what packing has to beat)
  segmented      the pack as one sequence through the linear layers (no padding, one decoder call, no KV
                 copies), attention block by block: each prefix causally on itself, each call on its
                 episode's prefix and causally on itself (no masked-out pairs computed, no L x L mask; on a
                 CPU a call block is two fused kernels merged by log-sum-exp, no concatenated keys)
`auto` picks one of them per pack by the cost model of memopd.cost (`choose_backend`).
Negative control (never exact): `posids_no_mask` passes restarting position ids without a mask, and
transformers then guesses packed boundaries from the restarts and cuts q off from later calls.

Everything returns hidden states or logits only at requested positions (by default the positions
that predict sampled actions), never the full (L, V) logits.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from memopd import cost
from memopd.packing import Packed
from memopd.records import Episode

BACKENDS = ("sdpa", "eager", "flex", "prefix_shared", "calls", "segmented")
AUTO = "auto"
NEGATIVE_CONTROLS = ("posids_no_mask",)
SEGMENTED = "memopd_segmented"  # the attention implementation of `segmented`, registered with transformers
_IMPL = {"sdpa": "sdpa", "eager": "eager", "flex": "flex_attention", "prefix_shared": "sdpa", "calls": "sdpa",
         "segmented": SEGMENTED, "posids_no_mask": "sdpa"}


def _cache_kw() -> str:
    # transformers 5.2x renamed `past_key_values` to `cache` (the old name warns, then goes away)
    from transformers.modeling_outputs import BaseModelOutputWithPast

    return "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


_CACHE_KW = _cache_kw()


@contextmanager
def attn_impl(model, name: str):
    """Temporarily switch a transformers model's attention implementation."""
    old = model.config._attn_implementation
    if old != name:
        model.set_attn_implementation(name)
    try:
        yield model
    finally:
        if old != name:
            model.set_attn_implementation(old)


def dense_mask(packed: Packed, additive: bool = False, dtype=torch.float32) -> torch.Tensor:
    """(1, 1, L, L) mask: bool (True = attend) or additive float (0 = attend, dtype-min = blocked)."""
    idx = torch.arange(len(packed))
    allowed = packed.visible(idx[:, None], idx[None, :])
    if not additive:
        return allowed[None, None]
    m = torch.zeros(allowed.shape, dtype=dtype)
    m.masked_fill_(~allowed, torch.finfo(dtype).min)
    return m[None, None]


def flex_block_mask(packed: Packed, device="cpu"):
    from torch.nn.attention.flex_attention import create_block_mask

    seg, call, block = packed.segment.to(device), packed.call.to(device), packed.block_calls

    def mask_mod(b, h, q_idx, kv_idx):
        ok = (seg[q_idx] == seg[kv_idx]) & (kv_idx <= q_idx)
        if block:
            ok = ok & ((call[kv_idx] == -1) | (call[kv_idx] == call[q_idx]))
        return ok

    L = len(packed)
    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=L, KV_LEN=L, device=device)


def _prepare_flex_cpu():
    # On CPU, dynamic shapes make inductor recompile flex attention for every new length and fail.
    import torch._dynamo

    torch._dynamo.config.automatic_dynamic_shapes = False


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def fused_prefix_blocks(device_type: str, dropout: float = 0.0) -> bool:
    """Whether segmented attention runs a call block as two fused CPU kernels merged by log-sum-exp
    (`_PrefixThenOwn`: no copied keys, no mask) rather than one kernel over concatenated keys under a mask."""
    return device_type == "cpu" and not dropout and _FLASH_CPU is not None


class _PrefixThenOwn(torch.autograd.Function):
    """Attention of queries (1, H, n, D) to all of a prefix's keys and causally to their own, as two fused CPU
    flash-attention calls (prefix: no mask; own: causal) merged by their log-sum-exp. The backward runs each part's
    flash backward with the merged output and log-sum-exp, as ring attention does, and sums the query gradients:
    the kernel's own backward ignores a gradient of its log-sum-exp output, so autograd through the merge is wrong."""

    @staticmethod
    def forward(ctx, q, kp, vp, ki, vi, scale):
        o1, l1 = _FLASH_CPU(q, kp, vp, 0.0, False, scale=scale)[:2]
        o2, l2 = _FLASH_CPU(q, ki, vi, 0.0, True, scale=scale)[:2]
        lse = torch.logaddexp(l1, l2)
        out = (o1 * (l1 - lse).exp().unsqueeze(-1) + o2 * (l2 - lse).exp().unsqueeze(-1)).to(q.dtype)
        ctx.save_for_backward(q, kp, vp, ki, vi, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, kp, vp, ki, vi, out, lse = ctx.saved_tensors
        bwd, grad = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward, grad.contiguous()
        dq1, dkp, dvp = bwd(grad, q, kp, vp, out, lse, 0.0, False, scale=ctx.scale)
        dq2, dki, dvi = bwd(grad, q, ki, vi, out, lse, 0.0, True, scale=ctx.scale)
        return dq1 + dq2, dkp, dvp, dki, dvi, None


def _segmented_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                         memopd_blocks=None, **kwargs):
    """query (1, H, L, D), key/value (1, H_kv, L, D) -> ((1, L, H, D), None). `memopd_blocks`: (q0, q1, k0, k1)
    per block, in order and covering 0..L: queries q0:q1 see keys k0:k1 (their episode's prefix; k0 == k1:
    none) and causally themselves."""
    if memopd_blocks is None:
        raise ValueError(f"{SEGMENTED} attention needs memopd_blocks (packed_hidden(..., 'segmented'))")
    fused = fused_prefix_blocks(query.device.type, dropout)
    if fused and torch.is_autocast_enabled("cpu"):  # the kernel is not autocast; cast as autocast casts SDPA's inputs
        dt = torch.get_autocast_dtype("cpu")
        query, key, value = query.to(dt), key.to(dt), value.to(dt)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: kv head j serves query heads j*groups ... (j+1)*groups-1
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    # split once: the backward of a split is one concatenation, of a slice a zero tensor of the whole length
    sizes = [q1 - q0 for q0, q1, _, _ in memopd_blocks]
    qs, ks, vs = query.split(sizes, 2), key.split(sizes, 2), value.split(sizes, 2)
    at = {q0: i for i, (q0, *_) in enumerate(memopd_blocks)}  # block start -> chunk (a prefix is a block too)
    outs = []
    for i, (q0, q1, k0, k1) in enumerate(memopd_blocks):
        if k0 == k1:
            outs.append(F.scaled_dot_product_attention(qs[i], ks[i], vs[i], is_causal=True, scale=scaling,
                                                       dropout_p=dropout))
            continue
        j, n, p = at[k0], q1 - q0, k1 - k0
        if fused:
            outs.append(_PrefixThenOwn.apply(qs[i], ks[j], vs[j], ks[i], vs[i], scaling))  # None: 1/sqrt(D)
            continue
        mask = torch.ones(n, p + n, dtype=torch.bool, device=query.device).tril_(p)  # the prefix, then causal
        outs.append(F.scaled_dot_product_attention(qs[i], torch.cat([ks[j], ks[i]], 2), torch.cat([vs[j], vs[i]], 2),
                                                   attn_mask=mask, scale=scaling, dropout_p=dropout))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def _register_segmented():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(SEGMENTED, _segmented_attention)
    AttentionMaskInterface.register(SEGMENTED, lambda *a, **k: None)  # blocks travel as memopd_blocks, no mask


_register_segmented()


def segment_blocks(packed: Packed) -> list[tuple[int, int, int, int]]:
    """The (q0, q1, k0, k1) attention blocks of an exact pack, as `pack` lays it out (each episode's prefix, then
    its calls, each contiguous). An episode with one call (an SFT example) is one causal block."""
    if not packed.block_calls:
        raise ValueError("segmented execution only exists for blocked (exact) visibility")
    runs = _runs(packed)
    blocks = []
    for seg in dict.fromkeys(r[0] for r in runs):
        mine = [r for r in runs if r[0] == seg]
        prefix = [r for r in mine if r[1] == -1]
        calls = [r for r in mine if r[1] != -1]
        if prefix and (mine[0] is not prefix[0]):
            raise ValueError("segmented execution needs each episode's prefix before its calls")
        if len(calls) == 1 or not prefix:
            if not prefix:
                blocks += [(a, b, a, a) for _, _, a, b in calls]
            else:
                blocks.append((prefix[0][2], calls[0][3], prefix[0][2], prefix[0][2]))
            continue
        p0, p1 = prefix[0][2], prefix[0][3]
        blocks.append((p0, p1, p0, p0))
        blocks += [(a, b, p0, p1) for _, _, a, b in calls]
    return blocks


def lm_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    return model.get_output_embeddings()(hidden)


def recomputes_activations(model) -> bool:
    """Whether some layer of `model` recomputes its activations in the backward (activation checkpointing)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _runs(packed: Packed) -> list[tuple[int, int, int, int]]:
    """(segment, call, start, end) of every contiguous run of one (segment, call) in the pack, in order; call -1
    is an episode's prefix. Refuses a pack where a call's tokens are not contiguous (`pack` never makes one)."""
    base = int(packed.call.max()) + 2
    run_id = packed.segment * base + packed.call + 1
    ids, counts = torch.unique_consecutive(run_id, return_counts=True)
    if ids.numel() != run_id.unique().numel():
        raise ValueError("a call's tokens are not contiguous in the pack")
    ends = counts.cumsum(0).tolist()
    return [(i // base, i % base - 1, a, b) for i, a, b in zip(ids.tolist(), [0] + ends[:-1], ends)]


def _episodes(packed: Packed) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Per episode of the pack, in order: (indices of its prefix, [indices of each call's own tokens])."""
    out: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
    for s, c, a, b in _runs(packed):
        _, calls = out.setdefault(s, (torch.arange(0), []))
        if c == -1:
            out[s] = (torch.arange(a, b), calls)
        else:
            calls.append(torch.arange(a, b))
    return list(out.values())


def pack_shape(packed: Packed) -> cost.Shape:
    """Per episode of the pack: (prefix tokens, own tokens of each call), the input of memopd.cost."""
    return [(prefix.numel(), [t.numel() for t in calls]) for prefix, calls in _episodes(packed)]


def model_dims(model) -> cost.Dims:
    c = model.config
    return cost.Dims.of_config(c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
                               getattr(c, "num_key_value_heads", None) or c.num_attention_heads, c.intermediate_size,
                               getattr(c, "head_dim", None))


# flex compiles a kernel per pack length (torch.compile, static shapes). Past Dynamo's recompile limit (8 by
# default) transformers' compiled flex falls back to eager, which materialises L x L scores (~8.5 GB a layer call
# at 16k tokens x 16 heads in bf16): `auto` takes flex only for lengths it has compiled or while fewer than
# FLEX_SHAPES are, and otherwise a path without L x L scores.
FLEX_SHAPES = 8
_flex_lengths: set[int] = set()  # pack lengths flex has run on in this process (each a compiled kernel)


def bounded(paths: list[str], length: int) -> list[str]:
    """`paths` less flex when a pack of `length` tokens would compile a shape beyond FLEX_SHAPES."""
    if length in _flex_lengths or len(_flex_lengths) < FLEX_SHAPES:
        return paths
    return [p for p in paths if p != "flex"]


def candidates(model, packed: Packed) -> list[str]:
    """The exact paths `auto` may run `packed` on with `model` (memopd.cost.candidates, flex bounded)."""
    paths = cost.candidates(packed.block_calls, recomputes_activations(model), next(model.parameters()).device.type)
    return bounded(paths, len(packed))


def choose_backend(model, packed: Packed) -> str:
    """`auto`: the candidate path memopd.cost predicts fastest for this pack on this model, device, compute
    dtype (autocast's where on) and pass (forward + backward when grad is on)."""
    dev = next(model.parameters()).device
    dtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else model.dtype
    w = cost.weights(dev.type, str(dtype).removeprefix("torch."),
                     "forward_backward" if torch.is_grad_enabled() else "forward")
    return cost.choose(pack_shape(packed), model_dims(model), candidates(model, packed), w, dev.type)


def packed_hidden(model, packed: Packed, backend: str, index: torch.Tensor | None = None) -> torch.Tensor:
    """(N, H) final hidden states at `index` (default: packed.pred_index) of the packed sequence."""
    index = packed.pred_index if index is None else index
    dev = next(model.parameters()).device
    if backend == AUTO:
        backend = choose_backend(model, packed)
    if backend == "prefix_shared":
        return _prefix_shared_hidden(model, packed, index)
    if backend == "calls":
        return _calls_hidden(model, packed, index)
    if backend == "segmented":
        with attn_impl(model, SEGMENTED):
            h = model.get_decoder()(input_ids=packed.input_ids[None].to(dev), position_ids=packed.position_ids[None].to(dev),
                                    attention_mask=None, use_cache=False,
                                    memopd_blocks=segment_blocks(packed)).last_hidden_state
        return h[0, index.to(dev)]
    if backend not in _IMPL:
        raise ValueError(f"unknown backend {backend!r}; choose from {BACKENDS + (AUTO,) + NEGATIVE_CONTROLS}")
    ids = packed.input_ids[None].to(dev)
    pos = packed.position_ids[None].to(dev)
    if backend == "sdpa":
        mask = dense_mask(packed).to(dev)
    elif backend == "eager":
        mask = dense_mask(packed, additive=True, dtype=model.dtype).to(dev)
    elif backend == "flex":
        if dev.type == "cpu":
            _prepare_flex_cpu()
        mask = flex_block_mask(packed, device=dev)
        _flex_lengths.add(len(packed))
    else:  # posids_no_mask: the documented trap, kept as a negative control
        mask = None
    with attn_impl(model, _IMPL[backend]):
        h = model.get_decoder()(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False).last_hidden_state
    return h[0, index.to(dev)]


def _prefix_shared_hidden(model, packed: Packed, index: torch.Tensor) -> torch.Tensor:
    """Run each segment's prefix once, then all of its calls as one right-padded batch that attends
    to the prefix's cached keys/values. Needs blocked calls (exact layout)."""
    if not packed.block_calls:
        raise ValueError("prefix_shared execution only exists for blocked (exact) visibility")
    dev = next(model.parameters()).device
    dec = model.get_decoder()
    parts, loc, offset = [], torch.full((len(packed),), -1, dtype=torch.long), 0  # packed index -> row of cat(parts)
    with attn_impl(model, "sdpa"):
        for pidx, calls in _episodes(packed):
            if not calls:
                continue
            plen = pidx.numel()
            cache = None
            if plen:
                res = dec(input_ids=packed.input_ids[pidx][None].to(dev),
                          position_ids=packed.position_ids[pidx][None].to(dev), use_cache=True)
                cache = getattr(res, _CACHE_KW)
                cache.batch_repeat_interleave(len(calls))
                parts.append(res.last_hidden_state[0])
                loc[pidx], offset = torch.arange(offset, offset + plen), offset + plen
            B, Lmax = len(calls), max(tok.numel() for tok in calls)
            ids = torch.zeros(B, Lmax, dtype=torch.long)
            pos = torch.zeros(B, Lmax, dtype=torch.long)
            valid = torch.zeros(B, Lmax, dtype=torch.bool)
            for b, tok in enumerate(calls):
                n = tok.numel()
                ids[b, :n], pos[b, :n], valid[b, :n] = packed.input_ids[tok], packed.position_ids[tok], True
                loc[tok] = torch.arange(offset + b * Lmax, offset + b * Lmax + n)
            own = torch.tril(torch.ones(Lmax, Lmax, dtype=torch.bool))[None] & valid[:, None, :]
            own = own | torch.eye(Lmax, dtype=torch.bool)[None]  # padded rows attend to themselves (no NaN)
            mask = torch.cat([torch.ones(B, Lmax, plen, dtype=torch.bool), own], dim=-1)[:, None]
            h = dec(input_ids=ids.to(dev), position_ids=pos.to(dev), attention_mask=mask.to(dev),
                    use_cache=plen > 0, **{_CACHE_KW: cache}).last_hidden_state
            parts.append(h.reshape(B * Lmax, -1))
            offset += B * Lmax
    return _gather(parts, loc, index, dev)


def _gather(parts: list[torch.Tensor], loc: torch.Tensor, index: torch.Tensor, dev) -> torch.Tensor:
    """Rows `loc[index]` of the concatenated hidden states (differentiable); every index must be computed."""
    sel = loc[index.cpu()]
    if (sel < 0).any():
        raise ValueError(f"packed positions {index.cpu()[sel < 0][:5].tolist()} belong to no call of the pack")
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out[sel.to(dev)]


def _calls_hidden(model, packed: Packed, index: torch.Tensor) -> torch.Tensor:
    """Every call alone as [q, x_t, a_t] at its packed positions, all calls of the pack as one right-padded batch
    (causal + padding mask): the batched reference computation, driven by the pack. A prefix position is read
    from its episode's first call. Needs blocked calls (exact layout)."""
    if not packed.block_calls:
        raise ValueError("calls execution only exists for blocked (exact) visibility")
    dev = next(model.parameters()).device
    rows = [torch.cat([pidx, tok]) for pidx, calls in _episodes(packed) for tok in calls]
    B, Lmax = len(rows), max(r.numel() for r in rows)
    ids = torch.zeros(B, Lmax, dtype=torch.long)
    pos = torch.zeros(B, Lmax, dtype=torch.long)
    att = torch.zeros(B, Lmax, dtype=torch.long)
    loc = torch.full((len(packed),), -1, dtype=torch.long)
    for b in reversed(range(B)):  # reversed: the first call of an episode writes its prefix's rows last
        r, n = rows[b], rows[b].numel()
        ids[b, :n], pos[b, :n], att[b, :n] = packed.input_ids[r], packed.position_ids[r], 1
        loc[r] = torch.arange(b * Lmax, b * Lmax + n)
    with attn_impl(model, "sdpa"):
        h = model.get_decoder()(input_ids=ids.to(dev), position_ids=pos.to(dev), attention_mask=att.to(dev),
                                use_cache=False).last_hidden_state
    return _gather([h.reshape(B * Lmax, -1)], loc, index, dev)


def packed_logits(model, packed: Packed, backend: str, index: torch.Tensor | None = None) -> torch.Tensor:
    """(N, V) logits at `index` (default: the positions predicting sampled actions)."""
    return lm_logits(model, packed_hidden(model, packed, backend, index))


def independent_hidden(model, episodes: Episode | list[Episode], batched: bool = False) -> torch.Tensor:
    """Reference: every call run alone as [z_t, a_t] with default causal attention and positions 0..;
    (N, H) hidden states predicting each sampled action token, in the packed action order.
    batched=True runs all calls as one right-padded batch (the numerical floor of batching)."""
    if isinstance(episodes, Episode):
        episodes = [episodes]
    dev = next(model.parameters()).device
    seqs = [(inv.input_ids + inv.output_ids, len(inv.input_ids), len(inv.output_ids))
            for ep in episodes for inv in ep.invocations]
    with attn_impl(model, "sdpa"):
        if not batched:
            outs = []
            for ids, n_in, n_out in seqs:
                h = model.get_decoder()(input_ids=torch.tensor([ids], device=dev), use_cache=False).last_hidden_state
                outs.append(h[0, n_in - 1 : n_in - 1 + n_out])
            return torch.cat(outs)
        Lmax = max(len(s[0]) for s in seqs)
        ids = torch.zeros(len(seqs), Lmax, dtype=torch.long)
        att = torch.zeros(len(seqs), Lmax, dtype=torch.long)
        for b, (s, _, _) in enumerate(seqs):
            ids[b, : len(s)], att[b, : len(s)] = torch.tensor(s), 1
        h = model.get_decoder()(input_ids=ids.to(dev), attention_mask=att.to(dev), use_cache=False).last_hidden_state
        return torch.cat([h[b, n_in - 1 : n_in - 1 + n_out] for b, (_, n_in, n_out) in enumerate(seqs)])


def independent_logits(model, episodes, batched: bool = False) -> torch.Tensor:
    return lm_logits(model, independent_hidden(model, episodes, batched))


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(N, V), (N,) -> (N,) log-probability of each target token."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None].to(logits.device)).squeeze(-1)


def action_targets(episodes) -> torch.Tensor:
    if isinstance(episodes, Episode):
        episodes = [episodes]
    return torch.tensor([t for ep in episodes for inv in ep.invocations for t in inv.output_ids], dtype=torch.long)


__all__ = [
    "AUTO", "BACKENDS", "NEGATIVE_CONTROLS", "action_targets", "attn_impl", "choose_backend", "dense_mask",
    "flex_block_mask", "independent_hidden", "independent_logits", "lm_logits", "packed_hidden", "packed_logits",
    "recomputes_activations", "segment_blocks", "token_logprobs",
]
