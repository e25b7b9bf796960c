"""The SFT loss: cross-entropy on target tokens only, over a packed sequence or a padded batch.

Both paths return the *sum* of the target tokens' negative log-likelihoods and their count; the
trainer divides by the optimizer step's target-token count (see `memopd.sft.trainer`). Context
tokens are inputs only: no logit that predicts a context token enters the loss.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from memopd.attention import attn_impl, packed_hidden
from memopd.packing import pack
from memopd.records import Episode

# Above this many logit elements (N x V) the logits of a chunk are recomputed in the backward pass
# instead of kept: full-vocabulary fp32 logits of 2k targets at V=151,936 are 1.2 GB.
_KEEP_LOGITS = 1 << 26
_CHUNK = 2048


def ce_sum(model, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(N, H) final hidden states, (N,) target ids -> scalar fp32 sum of -log p(target), in chunks."""
    head = model.get_output_embeddings()
    targets = targets.to(hidden.device)

    def nll(h, t):
        return F.cross_entropy(head(h).float(), t, reduction="sum")

    big = torch.is_grad_enabled() and hidden.shape[0] * head.weight.shape[0] > _KEEP_LOGITS
    total = hidden.new_zeros((), dtype=torch.float32)
    for i in range(0, hidden.shape[0], _CHUNK):
        h, t = hidden[i : i + _CHUNK], targets[i : i + _CHUNK]
        total = total + (checkpoint(nll, h, t, use_reentrant=False) if big else nll(h, t))
    return total


def packed_target_loss(model, examples: list[Episode], max_len: int | None = None,
                       backend: str = "sdpa") -> tuple[torch.Tensor, int]:
    """Examples packed into one sequence (positions restart per example, no cross-example attention)
    -> (sum of target NLL, number of target tokens). backend: one of memopd.attention's; "segmented" runs
    attention example by example (no padding, no masked pairs: on a CPU at L = 2,048 with ~9 examples of
    ~230 tokens, ~90% of a dense mask's attention work is on blocked pairs)."""
    p = pack(examples, max_len=max_len)
    hidden = packed_hidden(model, p, backend)
    return ce_sum(model, hidden, p.targets), int(p.act_mask.sum())


def padded_target_loss(model, examples: list[Episode], pad_id: int = 0) -> tuple[torch.Tensor, int]:
    """Each example its own row, right padding, default causal attention and positions 0..n-1
    -> (sum of target NLL, number of target tokens). The reference (and benchmark baseline) for
    the packed path: the same numbers up to floating-point reassociation."""
    dev = next(model.parameters()).device
    seqs = [(x.invocations[0].input_ids, x.invocations[0].output_ids) for x in examples]
    L = max(len(i) + len(o) for i, o in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    att = torch.zeros(len(seqs), L, dtype=torch.long)
    rows, cols, targets = [], [], []
    for b, (i, o) in enumerate(seqs):
        n = len(i) + len(o)
        ids[b, :n] = torch.tensor(i + o)
        att[b, :n] = 1
        rows += [b] * len(o)
        cols += range(len(i) - 1, n - 1)  # the logit at j predicts token j+1
        targets += o
    with attn_impl(model, "sdpa"):
        h = model.get_decoder()(input_ids=ids.to(dev), attention_mask=att.to(dev), use_cache=False).last_hidden_state
    hidden = h[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)]
    return ce_sum(model, hidden, torch.tensor(targets)), len(targets)


def target_loss(model, examples: list[Episode], mode: str, max_len: int | None = None,
                backend: str = "sdpa") -> tuple[torch.Tensor, int]:
    if mode == "packed":
        return packed_target_loss(model, examples, max_len, backend)
    if mode == "padded":
        return padded_target_loss(model, examples)
    raise ValueError(f"unknown SFT batch mode {mode!r}; choose packed or padded")


class TargetLoss(torch.nn.Module):
    """The model plus the loss as one module, so that DistributedDataParallel sees the forward pass
    (its gradient hooks need the wrapped module's forward to be the one that runs)."""

    def __init__(self, model, mode: str, max_len: int, backend: str):
        super().__init__()
        self.model, self.mode, self.max_len, self.backend = model, mode, max_len, backend

    def forward(self, examples: list[Episode]) -> torch.Tensor:
        return target_loss(self.model, examples, self.mode, self.max_len, self.backend)[0]
