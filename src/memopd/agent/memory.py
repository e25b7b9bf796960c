"""Memory-rewrite rules: how the next call's context is built from the recorded calls.

Every rule is a token-level operation on recorded ids. The next input is always
    prefix q + rewritten context x_t
never the accumulated transcript. Tokens copied from an earlier sampled response are recorded as
`Retained(src_call, src_start, dst_start, length)` spans, so that the packing compiler knows they are
context copies of an action (never by matching ids). Observations are fresh context.

Rules (history = finished calls 0..t-1, each with its response, the length of its leading <think>
block in tokens, and the observation shown after it):
  full_retention       whole last response + newest observation
  suffix_retention     last K tokens of the last response + newest observation
  summary_replacement  the <think> block of the last response only + newest observation (MEM1; default)
  sliding_window       the last W (response, observation) pairs
  retrieval_refresh    the latest <think> block written (kept across calls that wrote none, so it may
                       come from an older call) + an observation that the rollout re-retrieves for the
                       latest query at every call (`REFRESH_OBSERVATION`)
"""
from __future__ import annotations

from dataclasses import dataclass

from memopd.config import MemoryConfig
from memopd.records import Retained


@dataclass
class Turn:
    """A finished call as the rules see it."""

    output_ids: list[int]  # the sampled response, exactly as recorded
    think_len: int  # output_ids[:think_len] ends with the </think> of the <think> block (0: no block)
    observation: list[int]  # fresh observation ids shown after this call


class _Context:
    """Accumulates x_t and the provenance of the response tokens copied into it."""

    def __init__(self, prefix: list[int], history: list[Turn]):
        self.ids = list(prefix)
        self.retained: list[Retained] = []
        self.history = history

    def keep(self, call: int, start: int, length: int):
        if length > 0:
            self.retained.append(Retained(call, start, len(self.ids), length))
            self.ids += self.history[call].output_ids[start : start + length]

    def add(self, ids: list[int]):
        self.ids += ids


def build_input(prefix: list[int], history: list[Turn], cfg: MemoryConfig) -> tuple[list[int], list[Retained]]:
    """Input ids of the next call (prefix + rewritten context) and the retained spans in it."""
    ctx = _Context(prefix, history)
    if not history:
        return ctx.ids, ctx.retained
    t = len(history)
    last = history[-1]
    n = len(last.output_ids)
    if cfg.rule == "full_retention":
        ctx.keep(t - 1, 0, n)
        ctx.add(last.observation)
    elif cfg.rule == "suffix_retention":
        k = min(cfg.suffix_tokens, n)
        ctx.keep(t - 1, n - k, k)
        ctx.add(last.observation)
    elif cfg.rule == "summary_replacement":
        ctx.keep(t - 1, 0, last.think_len)
        ctx.add(last.observation)
    elif cfg.rule == "sliding_window":
        for s in range(max(0, t - cfg.window), t):
            ctx.keep(s, 0, len(history[s].output_ids))
            ctx.add(history[s].observation)
    elif cfg.rule == "retrieval_refresh":
        src = next((s for s in range(t - 1, -1, -1) if history[s].think_len > 0), None)
        if src is not None:
            ctx.keep(src, 0, history[src].think_len)
        ctx.add(last.observation)
    else:  # guarded by MemoryConfig, kept for direct callers
        raise ValueError(f"unknown memory rule {cfg.rule!r}")
    return ctx.ids, ctx.retained
