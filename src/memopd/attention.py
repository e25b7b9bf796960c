"""Executing a packed sequence: one semantics, several backends, each checked by RCE.

Backends (`BACKENDS`):
  sdpa           dense 4-D bool mask (True = attend) under scaled_dot_product_attention
  eager          dense 4-D additive float mask (0 / dtype-min). A bool or {0,1} mask under eager
                 is added to the scores and is silently *not* a mask, hence its own builder.
  flex           FlexAttention BlockMask (GPU fast path; on CPU forward only)
  prefix_shared  run q once, reuse its keys/values for all calls of the episode run as one batch
Negative control (never exact): `posids_no_mask` passes restarting position ids without a mask, and
transformers then guesses packed boundaries from the restarts and cuts q off from later calls.

Everything returns hidden states or logits only at requested positions (by default the positions
that predict sampled actions), never the full (L, V) logits.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from memopd.packing import Packed, call_token_ranges
from memopd.records import Episode

BACKENDS = ("sdpa", "eager", "flex", "prefix_shared")
NEGATIVE_CONTROLS = ("posids_no_mask",)
_IMPL = {"sdpa": "sdpa", "eager": "eager", "flex": "flex_attention", "prefix_shared": "sdpa", "posids_no_mask": "sdpa"}


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


def lm_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    return model.get_output_embeddings()(hidden)


def packed_hidden(model, packed: Packed, backend: str, index: torch.Tensor | None = None) -> torch.Tensor:
    """(N, H) final hidden states at `index` (default: packed.pred_index) of the packed sequence."""
    index = packed.pred_index if index is None else index
    dev = next(model.parameters()).device
    if backend == "prefix_shared":
        return _prefix_shared_hidden(model, packed, index)
    if backend not in _IMPL:
        raise ValueError(f"unknown backend {backend!r}; choose from {BACKENDS + NEGATIVE_CONTROLS}")
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
    else:  # posids_no_mask: the documented trap, kept as a negative control
        mask = None
    with attn_impl(model, _IMPL[backend]):
        h = model.get_decoder()(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False).last_hidden_state
    return h[0, index.to(dev)]


def _prefix_shared_hidden(model, packed: Packed, index: torch.Tensor) -> torch.Tensor:
    """Run each segment's prefix once, then all of its calls as one right-padded batch that attends
    to the prefix's cached keys/values. Needs restarting positions and blocked calls (exact layout)."""
    if not packed.block_calls:
        raise ValueError("prefix_shared execution only exists for blocked (exact) visibility")
    dev = next(model.parameters()).device
    dec = model.get_decoder()
    L = len(packed)
    out = None
    ranges = call_token_ranges(packed)
    with attn_impl(model, "sdpa"):
        for s in sorted({r[0] for r in ranges}):
            calls = [r for r in ranges if r[0] == s]
            plen = calls[0][2]
            pidx = ((packed.segment == s) & (packed.call == -1)).nonzero().squeeze(-1)
            cache = None
            if plen:
                res = dec(input_ids=packed.input_ids[pidx][None].to(dev),
                          position_ids=packed.position_ids[pidx][None].to(dev), use_cache=True)
                cache, hp = getattr(res, _CACHE_KW), res.last_hidden_state[0]
                cache.batch_repeat_interleave(len(calls))
            B, Lmax = len(calls), max(r[3].numel() for r in calls)
            ids = torch.zeros(B, Lmax, dtype=torch.long)
            pos = torch.zeros(B, Lmax, dtype=torch.long)
            valid = torch.zeros(B, Lmax, dtype=torch.bool)
            for b, (_, _, _, tok) in enumerate(calls):
                n = tok.numel()
                ids[b, :n], pos[b, :n], valid[b, :n] = packed.input_ids[tok], packed.position_ids[tok], True
            own = torch.tril(torch.ones(Lmax, Lmax, dtype=torch.bool))[None] & valid[:, None, :]
            own = own | torch.eye(Lmax, dtype=torch.bool)[None]  # padded rows attend to themselves (no NaN)
            mask = torch.cat([torch.ones(B, Lmax, plen, dtype=torch.bool), own], dim=-1)[:, None]
            h = dec(input_ids=ids.to(dev), position_ids=pos.to(dev), attention_mask=mask.to(dev),
                    use_cache=plen > 0, **{_CACHE_KW: cache}).last_hidden_state
            if out is None:
                out = h.new_zeros(L, h.shape[-1])
            # scatter back to packed coordinates (differentiable: index_put on a fresh tensor)
            flat_idx = torch.cat([tok for (_, _, _, tok) in calls]).to(dev)
            flat_h = torch.cat([h[b, : tok.numel()] for b, (_, _, _, tok) in enumerate(calls)])
            out = out.index_put((flat_idx,), flat_h)
            if plen:
                out = out.index_put((pidx.to(dev),), hp)
    return out[index.to(dev)]


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
    "BACKENDS", "NEGATIVE_CONTROLS", "attn_impl", "dense_mask", "flex_block_mask", "packed_hidden",
    "packed_logits", "independent_hidden", "independent_logits", "token_logprobs", "action_targets",
    "lm_logits",
]
