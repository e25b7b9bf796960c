"""Memory-rewrite rules: how the next call's context is built from the recorded calls.

Every rule is a token-level operation on recorded ids. The next input is always
    prefix q + rewritten context x_t
never the accumulated transcript. Tokens copied from an earlier sampled response are recorded as
`Retained(src_call, src_start, dst_start, length)` spans, so that the packing compiler knows they are
context copies of an action (never by matching ids). Observations are fresh context.

A rule is a function `rule(prefix, history, cfg) -> (ids, retained)`: the next call's input ids (starting with
`prefix`, unchanged) and the retained spans in it. `history` holds the finished calls 0..t-1 (t >= 1), each with
its response, the length of its leading <think> block in tokens, and the observation shown after it; `cfg` is the
`MemoryConfig`. `agent.rule` names a built-in rule or a user's function by import path (`mypkg.rules:keep_last`);
a rule whose observation the rollout re-retrieves at every call sets `refresh_observation = True` on the function.
`build_input` checks every result against this contract (`MemoryRuleError` names the rule, the call and the span).

Built-in rules:
  full_retention       whole last response + newest observation
  suffix_retention     last K tokens of the last response + newest observation
  summary_replacement  the <think> block of the last response only + newest observation (MEM1; default)
  sliding_window       the last W (response, observation) pairs
  retrieval_refresh    the latest <think> block written (kept across calls that wrote none, so it may
                       come from an older call) + an observation that the rollout re-retrieves for the
                       latest query at every call
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from typing import Callable

from memopd.config import RULES, MemoryConfig
from memopd.inputs import ConfigError
from memopd.records import Retained, span_error


class MemoryRuleError(ConfigError):
    """A memory rule that cannot be found, or whose result breaks the contract."""


@dataclass
class Turn:
    """A finished call as the rules see it."""

    output_ids: list[int]  # the sampled response, exactly as recorded
    think_len: int  # output_ids[:think_len] ends with the </think> of the <think> block (0: no block)
    observation: list[int]  # fresh observation ids shown after this call


class Context:
    """Accumulates x_t and the provenance of the response tokens copied into it (a helper for rules)."""

    def __init__(self, prefix: list[int], history: list[Turn]):
        self.ids = list(prefix)
        self.retained: list[Retained] = []
        self.history = history

    def keep(self, call: int, start: int, length: int):
        """Copy history[call].output_ids[start:start + length] into the context, recorded as retained."""
        if length > 0:
            self.retained.append(Retained(call, start, len(self.ids), length))
            self.ids += self.history[call].output_ids[start : start + length]

    def add(self, ids: list[int]):
        """Fresh context (an observation)."""
        self.ids += ids

    def result(self) -> tuple[list[int], list[Retained]]:
        return self.ids, self.retained


Rule = Callable[[list[int], list[Turn], MemoryConfig], tuple[list[int], list[Retained]]]


def full_retention(prefix, history, cfg):
    c, t = Context(prefix, history), len(history)
    c.keep(t - 1, 0, len(history[-1].output_ids))
    c.add(history[-1].observation)
    return c.result()


def suffix_retention(prefix, history, cfg):
    c, t, n = Context(prefix, history), len(history), len(history[-1].output_ids)
    k = min(cfg.suffix_tokens, n)
    c.keep(t - 1, n - k, k)
    c.add(history[-1].observation)
    return c.result()


def summary_replacement(prefix, history, cfg):
    c, t = Context(prefix, history), len(history)
    c.keep(t - 1, 0, history[-1].think_len)
    c.add(history[-1].observation)
    return c.result()


def sliding_window(prefix, history, cfg):
    c, t = Context(prefix, history), len(history)
    for s in range(max(0, t - cfg.window), t):
        c.keep(s, 0, len(history[s].output_ids))
        c.add(history[s].observation)
    return c.result()


def retrieval_refresh(prefix, history, cfg):
    c, t = Context(prefix, history), len(history)
    src = next((s for s in range(t - 1, -1, -1) if history[s].think_len > 0), None)
    if src is not None:
        c.keep(src, 0, history[src].think_len)
    c.add(history[-1].observation)
    return c.result()


retrieval_refresh.refresh_observation = True
BUILTIN: dict[str, Rule] = {f.__name__: f for f in (full_retention, suffix_retention, summary_replacement,
                                                     sliding_window, retrieval_refresh)}
assert tuple(BUILTIN) == RULES


@cache
def resolve(name: str) -> Rule:
    """The rule `agent.rule` names: a built-in one, or `module:function` imported."""
    if name in BUILTIN:
        return BUILTIN[name]
    module, _, attr = name.partition(":")
    if not module or not attr:
        raise MemoryRuleError(f"agent.rule {name!r}: neither a built-in rule {RULES} nor an import path "
                              "module:function")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise MemoryRuleError(f"agent.rule {name!r}: cannot import it ({type(e).__name__}: {e})") from None
    if not callable(fn):
        raise MemoryRuleError(f"agent.rule {name!r}: {type(fn).__name__} is not a function")
    return fn


def refreshes_observation(name: str) -> bool:
    """Whether the rollout re-retrieves the latest query's passages at every call under this rule."""
    return bool(getattr(resolve(name), "refresh_observation", False))


def build_input(prefix: list[int], history: list[Turn], cfg: MemoryConfig) -> tuple[list[int], list[Retained]]:
    """Input ids of the next call (prefix + rewritten context) and the retained spans in it; the first call's
    input is the prefix alone, whatever the rule."""
    if not history:
        return list(prefix), []
    ids, retained = resolve(cfg.rule)(list(prefix), history, cfg)
    check(cfg.rule, prefix, history, ids, retained)
    return ids, retained


def check(name: str, prefix: list[int], history: list[Turn], ids, retained) -> None:
    """A rule's result against the contract: the prefix unchanged, every retained span inside the context after
    the prefix and copying tokens of an earlier response exactly (records.span_error, as Episode.validate)."""
    where = f"memory rule {name!r}, call {len(history)}"
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids) or not isinstance(retained, list) \
            or not all(isinstance(r, Retained) for r in retained):
        raise MemoryRuleError(f"{where}: must return (a list of token ids, a list of Retained)")
    if ids[:len(prefix)] != list(prefix):
        raise MemoryRuleError(f"{where}: the context changes the prefix (its first {len(prefix)} ids)")
    outputs = [turn.output_ids for turn in history]
    for r in retained:
        bad = span_error(r, len(history), outputs, ids, len(prefix))
        if bad:
            raise MemoryRuleError(f"{where}: {bad}")
