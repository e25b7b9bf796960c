"""`memopd bench decode`: HFBackend's KV cache (backends.growing_cache) against transformers' DynamicCache.

Both generate from the same model and prompts (lengths spread like the agent's, left-padded into one batch),
greedy, with stops off so that every row decodes `new_tokens` tokens; they run interleaved within every
repeat (the order alternating), and the speedup is the median over repeats of (DynamicCache time / growing
time) in the same repeat with a 95% bootstrap interval (memopd.stats.ratio_interval). The prefill is timed
apart (the same forward for both), so the figures are the whole call and its decode steps. The outputs must
be the same tokens and log-probs, bit for bit: a row says so.
"""
from __future__ import annotations

import functools
import time

import torch

from memopd.generation.backends import HFBackend, Sampling, growing_cache, left_padded
from memopd.stats import ratio_interval


def _prompts(vocab: int, batch: int, tokens: int, seed: int) -> list[list[int]]:
    """`batch` random prompts of 0.5-1x `tokens` tokens (ids >= 100: clear of the special tokens)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(tokens // 2, tokens + 1, (batch,), generator=g)
    return [torch.randint(100, vocab, (int(n),), generator=g).tolist() for n in lens]


def run(model, tokenizer, batch: int = 32, tokens: int = 450, new_tokens: int = 48, repeats: int = 5,
        seed: int = 0, log=functools.partial(print, flush=True)) -> list[dict]:
    """One row: median seconds of a call with each cache and of the prefill, the speedups with their intervals."""
    from transformers import DynamicCache

    be = HFBackend(model, tokenizer, Sampling(temperature=0.0, max_new_tokens=new_tokens), stop_strings=())
    be.eos, be.stop_ids = set(), set()  # every row decodes new_tokens tokens: the same work in every repeat
    prompts = _prompts(len(tokenizer), batch, tokens, seed)
    caches = {"growing": growing_cache, "dynamic": lambda config, reserve: DynamicCache(config=config)}
    ids, mask, pos = left_padded(prompts, be.pad)  # the prefill alone (what both share), as the backend lays it out
    times = {k: [] for k in caches}
    outs, prefill, last = {}, [], {}
    for r in range(repeats + 1):  # the first round warms up and is not timed
        for name in (list(caches) if r % 2 else list(caches)[::-1]):
            be.make_cache = caches[name]
            t0 = time.perf_counter()
            outs[name] = be.generate(prompts, list(range(batch)))
            last[name] = time.perf_counter() - t0
            if r:
                times[name].append(last[name])
        t0 = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=1)
        if r:
            prefill.append(time.perf_counter() - t0)
        log(f"repeat {r}{' (warm-up)' if not r else ''}: growing {last['growing']:.1f} s, dynamic {last['dynamic']:.1f} s, "
            f"prefill {time.perf_counter() - t0:.1f} s")
    same = all(a.output_ids == b.output_ids and a.logprobs == b.logprobs
               for a, b in zip(outs["growing"], outs["dynamic"]))
    call = ratio_interval(times["dynamic"], times["growing"])
    pre = sorted(prefill)[len(prefill) // 2]
    dec = ratio_interval([t - p for t, p in zip(times["dynamic"], prefill)],
                         [t - p for t, p in zip(times["growing"], prefill)])
    row = {"batch": batch, "prompt_tokens_max": tokens, "new_tokens": new_tokens, "repeats": repeats,
           "threads": torch.get_num_threads(), "growing_s": sorted(times["growing"])[repeats // 2],
           "dynamic_s": sorted(times["dynamic"])[repeats // 2], "prefill_s": pre,
           "speedup": call[0], "speedup_lo": call[1], "speedup_hi": call[2],
           "decode_speedup": dec[0], "decode_speedup_lo": dec[1], "decode_speedup_hi": dec[2],
           "identical_outputs": same}
    log(f"bench decode: {batch} rows x {tokens // 2}-{tokens} prompt tokens + {new_tokens} new, {repeats} repeats, "
        f"{row['threads']} thread(s): call {row['dynamic_s']:.1f} s -> {row['growing_s']:.1f} s, speedup "
        f"{call[0]:.2f}x [{call[1]:.2f}, {call[2]:.2f}]; decode steps alone (prefill {pre:.1f} s subtracted) "
        f"{dec[0]:.2f}x [{dec[1]:.2f}, {dec[2]:.2f}]; outputs identical: {same}")
    return [row]
