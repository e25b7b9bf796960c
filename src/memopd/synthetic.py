"""Synthetic episodes with exact provenance, in the five shapes of memory rewrite.

Used by the RCE smoke target, the property tests and the packing benchmark. Token ids are drawn from
a pool (e.g. real text through the real tokenizer) or uniformly from a vocabulary. Observation and
hint tokens are fresh context; response tokens carried into a later context are recorded as
`Retained` spans, exactly as the rollout's memory rules record them.
"""
from __future__ import annotations

import random
from typing import Sequence

from memopd.config import RULES
from memopd.records import Episode, Invocation, Retained

def token_pool(tokenizer_dir: str, data_dir: str, n_texts: int = 200) -> list[int]:
    """Real token ids: the first texts of the committed corpus through the real tokenizer."""
    from itertools import islice

    from memopd.data import corpus_texts
    from memopd.models import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    return [i for text in islice(corpus_texts(data_dir), n_texts) for i in tok(text)["input_ids"]]


def _draw(rng: random.Random, pool: Sequence[int], n: int) -> list[int]:
    if n <= 0:
        return []
    start = rng.randrange(max(1, len(pool) - n))
    out = list(pool[start : start + n])
    while len(out) < n:
        out.append(pool[rng.randrange(len(pool))])
    return out


def random_episode(
    rng: random.Random,
    pool: Sequence[int],
    rule: str,
    n_calls: int,
    prefix_len: int,
    obs_len: int | tuple[int, int],
    resp_len: int | tuple[int, int],
    window: int = 2,
    suffix: int = 8,
    task_id: str = "synthetic",
) -> Episode:
    """An episode whose call t input is prefix + rewritten memory + a fresh observation."""
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; choose from {RULES}")

    def n(spec):
        return rng.randint(*spec) if isinstance(spec, tuple) else spec

    q = _draw(rng, pool, prefix_len)
    invs: list[Invocation] = []
    observations: list[list[int]] = []
    memory: tuple[int, int, int] | None = None  # (call, start, length) kept by retrieval_refresh
    for t in range(n_calls):
        obs = _draw(rng, pool, max(1, n(obs_len)))
        ctx: list[int] = []
        retained: list[Retained] = []

        def keep(src: int, start: int, length: int):
            if length > 0:
                retained.append(Retained(src, start, prefix_len + len(ctx), length))
                ctx.extend(invs[src].output_ids[start : start + length])

        if t > 0:
            last = invs[t - 1].output_ids
            if rule == "full_retention":
                keep(t - 1, 0, len(last))
            elif rule == "suffix_retention":
                k = min(suffix, len(last))
                keep(t - 1, len(last) - k, k)
            elif rule == "summary_replacement":  # only the <think> block: a leading span of the response
                keep(t - 1, 0, rng.randint(1, len(last)))
            elif rule == "sliding_window":  # last W (response, observation) pairs
                for s in range(max(0, t - window), t):
                    keep(s, 0, len(invs[s].output_ids))
                    ctx.extend(observations[s])
            elif rule == "retrieval_refresh":  # memory kept across calls, observation re-retrieved
                if memory is None or rng.random() < 0.5:
                    memory = (t - 1, 0, rng.randint(1, len(last)))
                keep(*memory)
        ctx.extend(obs)
        observations.append(obs)
        invs.append(Invocation(q + ctx, _draw(rng, pool, max(1, n(resp_len))), stop_reason="stop", retained=retained))
    return Episode(task_id=task_id, prefix_len=prefix_len, invocations=invs).validate()
