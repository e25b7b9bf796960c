"""Segmented execution of packed SFT examples: attention computed example by example.

A pack of turn-level examples is a sequence of independent segments, each a single call whose tokens
see the earlier tokens of the same segment only (plain causal attention, positions from 0). A dense
L x L mask (backend "sdpa") gives exactly that, but computes every masked pair too: at L = 2048 with
~9 examples of ~230 tokens, ~90% of the attention work is on blocked pairs, which on a CPU costs more
than the padding that packing removes. Here the linear layers run once over the whole pack (no
padding) and attention runs per segment with is_causal (no masked pairs): the same numbers as the
dense mask (checked in tests/test_sft.py), the cost of neither padding nor blocked pairs.

Only one-call segments qualify (SFT examples); multi-call episodes need the call-blocked mask of
`memopd.attention`. Registered with transformers' attention and mask interfaces under NAME.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from memopd.attention import attn_impl
from memopd.packing import Packed

NAME = "memopd_segmented"


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
               memopd_segments=None, **kwargs):
    """query (1, H, L, D), key/value (1, H_kv, L, D) -> ((1, L, H, D), None); causal per segment."""
    if memopd_segments is None:
        raise ValueError(f"{NAME} attention needs memopd_segments (use segmented_hidden)")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: kv head j serves query heads j*groups ... (j+1)*groups-1
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    outs = []
    for start, end in memopd_segments:
        outs.append(F.scaled_dot_product_attention(query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
                                                   is_causal=True, scale=scaling, dropout_p=dropout))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    return None  # segment boundaries travel as memopd_segments; no L x L mask is ever built


def _register():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, _no_mask)


_register()


def segments(packed: Packed) -> list[tuple[int, int]]:
    """[(start, end)] of the pack's segments, after checking each is a single call."""
    if not packed.block_calls or int(packed.call.max()) > 0:
        raise ValueError("segmented execution needs one-call segments in the exact layout (SFT examples)")
    _, counts = torch.unique_consecutive(packed.segment, return_counts=True)
    ends = counts.cumsum(0).tolist()
    return list(zip([0] + ends[:-1], ends))


def segmented_hidden(model, packed: Packed, index: torch.Tensor | None = None) -> torch.Tensor:
    """(N, H) final hidden states at `index` (default: packed.pred_index), attention per segment."""
    index = packed.pred_index if index is None else index
    bounds = segments(packed)
    dev = next(model.parameters()).device
    with attn_impl(model, NAME):
        h = model.get_decoder()(input_ids=packed.input_ids[None].to(dev), position_ids=packed.position_ids[None].to(dev),
                                attention_mask=None, use_cache=False, memopd_segments=bounds).last_hidden_state
    return h[0, index.to(dev)]
