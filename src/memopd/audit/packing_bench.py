"""Packing benchmark: independent calls vs every exact packed path, side by side in one run.

For each configuration (calls T x prefix tokens) it times, on the same episodes and model:
  independent_sequential  every call run alone, one after the other
  independent_batched     all calls as one right-padded batch
  packed_<backend>        the packed sequence under each exact backend
forward (log-probs of the sampled tokens) and forward+backward (gradient of their sum), median of
`repeats`, and each path's RCE error against the sequential reference (max |d log p| of the sampled
tokens and full-vocabulary max |d logit|; `rce_exact` gates on both, at the fp32 tolerances), plus the
token ratio R = independent tokens / packed tokens and the FLOP ratio (linear layers + attention pairs).
Every path yields final hidden states at the sampled tokens; the LM head and log-softmax run on memopd.rce.CHUNK
positions at a time (rce.chunked_token_logprobs, timed identically for every path), and so does the RCE error.
"""
from __future__ import annotations

import random
import statistics
import time

import torch

from memopd.attention import (
    independent_hidden,
    lm_logits,
    packed_hidden,
    token_logprobs,
)
from memopd.packing import pack
from memopd.rce import CHUNK, chunked_token_logprobs, spans, tolerances
from memopd.records import Episode
from memopd.synthetic import random_episode

# The sweep of the foundation issue: T in {4, 8, 16} x prefix in {128, 256, 512}; context ~200 and
# response ~64 tokens per call; a tiny Qwen2 of hidden 256, 4 layers, vocab 4096, fp32.
DEFAULTS = {
    "calls": [4, 8, 16],
    "prefix_tokens": [128, 256, 512],
    "response_tokens": 64,
    "observation_tokens": 136,  # + the retained 64-token response = ~200 context tokens per call
    "episodes": 1,
    "model": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 4096},
    "backends": ["sdpa", "eager", "flex", "prefix_shared"],
    "dtype": "float32",
}


def _model(spec: dict, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(**spec, max_position_embeddings=8192, tie_word_embeddings=False, use_sliding_window=False)
    return Qwen2ForCausalLM(cfg).eval()


def flop_ratio(episodes: list[Episode], model) -> float:
    """(independent FLOPs) / (packed FLOPs), counting linear layers per token and attention pairs."""
    cfg = model.config
    per_token = 2 * sum(p.numel() for n, p in model.named_parameters() if "layers." in n)
    per_pair = 4 * cfg.hidden_size * cfg.num_hidden_layers  # QK^T and AV
    ind = pk = 0
    for ep in episodes:
        P = ep.prefix_len
        pk += P * per_token + P * (P + 1) // 2 * per_pair
        for inv in ep.invocations:
            L = len(inv.input_ids) + len(inv.output_ids)
            n = L - P
            ind += L * per_token + L * (L + 1) // 2 * per_pair
            pk += n * per_token + (n * P + n * (n + 1) // 2) * per_pair
    return ind / pk


def _run(fn, repeats: int) -> float:
    fn()  # warm-up (and compilation for flex)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _paths(model, episodes, backends):
    """(path name -> function returning the (N, H) final hidden states at the sampled action tokens, targets (N,))."""
    packs = [pack(ep) for ep in episodes]
    targets = torch.cat([p.targets for p in packs])

    def independent(batched):
        return lambda: independent_hidden(model, episodes, batched=batched)

    paths = {"independent_sequential": independent(False), "independent_batched": independent(True)}
    for b in backends:
        paths[f"packed_{b}"] = lambda b=b: torch.cat([packed_hidden(model, p, b) for p in packs])
    return paths, targets


def rce_error(model, ref_hidden: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor,
              chunk: int = CHUNK) -> tuple[float, float]:
    """(max |d log p| of the sampled tokens, full-vocabulary max |d logit|) of a path's hidden states against the
    reference's, `chunk` positions of (chunk, V) logits at a time."""
    dlogp, dlogit = [], []  # per-chunk maxima (tensors: a NaN propagates to the result)
    targets = targets.to(hidden.device)
    for s, e in spans(targets.numel(), chunk):
        ref, logits = lm_logits(model, ref_hidden[s:e]), lm_logits(model, hidden[s:e])
        dlogp.append((token_logprobs(logits, targets[s:e]) - token_logprobs(ref, targets[s:e])).abs().max())
        dlogit.append((logits - ref).abs().max().float())
        del ref, logits
    if not dlogp:
        return 0.0, 0.0
    return torch.stack(dlogp).max().item(), torch.stack(dlogit).max().item()


def rce_exact(row: dict, dtype: str = "float32") -> bool:
    """A row's path passes RCE: max |d log p| and max |d logit| both within the dtype's tolerances."""
    tol = tolerances(dtype)
    return row["rce_max_abs_dlogp"] <= tol["dlogp"] and row["rce_max_abs_dlogit"] <= tol["dlogit"]


HEADER = (f"{'episodes':<9} {'T':>3} {'prefix':>6} {'R':>5} {'FLOPx':>5}  {'path':<24} {'fwd s':>8} {'fwd x':>6} "
          f"{'f+b s':>8} {'f+b x':>6}  {'RCE max|dlogp|':>14} {'max|dlogit|':>11}")


def measure(model, episodes: list[Episode], backends, repeats: int, kind: str = "synthetic", log=print) -> list[dict]:
    """Time every path on one set of episodes (forward and forward+backward) with its RCE error; one row
    per (path, pass). T and prefix_tokens are the episodes' means (equal on synthetic episodes)."""
    T = sum(len(ep.invocations) for ep in episodes) / len(episodes)
    P = sum(ep.prefix_len for ep in episodes) / len(episodes)
    T, P = (int(T) if T == int(T) else round(T, 2)), (int(P) if P == int(P) else round(P, 1))
    n_ind = sum(len(i.input_ids) + len(i.output_ids) for ep in episodes for i in ep.invocations)
    R = n_ind / sum(len(pack(ep)) for ep in episodes)
    fr = flop_ratio(episodes, model)
    hidden_fns, targets = _paths(model, episodes, backends)
    with torch.no_grad():
        ref = hidden_fns["independent_sequential"]()
    results = {}
    for name, hidden_fn in hidden_fns.items():

        def fn(hidden_fn=hidden_fn):  # what is timed: the sampled tokens' log-probs
            return chunked_token_logprobs(model, hidden_fn(), targets)

        with torch.no_grad():
            err = rce_error(model, ref, hidden_fn(), targets)
            t_fwd = _run(fn, repeats)
        t_fb = None
        if not (name == "packed_flex" and not torch.cuda.is_available()):  # flex backward: GPU only

            def fwd_bwd(fn=fn):
                model.zero_grad(set_to_none=True)
                fn().sum().backward()

            t_fb = _run(fwd_bwd, repeats)
        results[name] = (t_fwd, t_fb, err)
    del ref
    model.zero_grad(set_to_none=True)
    base_f, base_b, _ = results["independent_batched"]
    rows = []
    for name, (t_fwd, t_fb, err) in results.items():
        for pass_name, t, base in (("forward", t_fwd, base_f), ("forward_backward", t_fb, base_b)):
            if t is None:
                continue
            rows.append({"episodes": kind, "n_episodes": len(episodes), "calls": T, "prefix_tokens": P,
                         "token_ratio": round(R, 4), "flop_ratio": round(fr, 4), "path": name, "pass": pass_name,
                         "seconds": t, "speedup_vs_batched": base / t, "rce_max_abs_dlogp": err[0],
                         "rce_max_abs_dlogit": err[1]})
        fb = f"{t_fb:8.4f} {base_b / t_fb:5.2f}x" if t_fb else f"{'n/a':>8} {'':>6}"
        log(f"{kind:<9} {T:>3} {P:>6} {R:5.2f} {fr:5.2f}  {name:<24} {t_fwd:8.4f} {base_f / t_fwd:5.2f}x {fb}  "
            f"{err[0]:14.2e} {err[1]:11.2e}")
    return rows


def run_sweep(cfg: dict | None = None, seed: int = 0, repeats: int = 3, log=print) -> list[dict]:
    """The synthetic sweep: calls x prefix_tokens configurations on the benchmark's own tiny model."""
    cfg = {**DEFAULTS, **(cfg or {})}
    model = _model(cfg["model"], seed)
    vocab = cfg["model"]["vocab_size"]
    rows = []
    log(HEADER)
    for T in cfg["calls"]:
        for P in cfg["prefix_tokens"]:
            rng = random.Random(seed * 1000 + T * 7 + P)
            pool = [rng.randrange(vocab) for _ in range(8192)]
            episodes = [random_episode(rng, pool, "full_retention", T, P, cfg["observation_tokens"],
                                       cfg["response_tokens"], task_id=f"bench{e}") for e in range(cfg["episodes"])]
            rows += measure(model, episodes, cfg["backends"], repeats, "synthetic", log)
    return rows


def truncate(ep: Episode, calls: int) -> Episode:
    """The first `calls` calls of an episode: still a real trajectory prefix (retained spans only point
    backwards, so every kept call's state is unchanged)."""
    return Episode(ep.task_id, ep.prefix_len, ep.invocations[:calls], ep.reward, ep.metrics).validate()


def run_real(model, episodes: list[Episode], calls=(2, 4, 6), n_episodes: int = 4, backends=DEFAULTS["backends"],
             repeats: int = 3, log=print) -> list[dict]:
    """The sweep on recorded rollouts: for each T in `calls`, the first `n_episodes` episodes with at least
    T calls, cut to their first T calls (T = None: the episodes as recorded), timed under `model`."""
    rows = []
    log(HEADER)
    for T in calls:
        eps = [ep if T is None else truncate(ep, T) for ep in episodes if T is None or len(ep.invocations) >= T]
        eps = eps[:n_episodes]
        if not eps:
            log(f"real: no episode with >= {T} calls; configuration skipped")
            continue
        rows += measure(model, eps, backends, repeats, "real", log)
    return rows


def summarize(rows: list[dict]) -> list[str]:
    """Per configuration: the fastest exact packed path (`rce_exact`: both fp32 RCE tolerances) vs the targets
    (fwd >= 0.85 R, f+b >= 0.9 R, and > 1.63x wherever R >= 2)."""
    lines = []
    for kind, T, P in sorted({(r.get("episodes", "synthetic"), r["calls"], r["prefix_tokens"]) for r in rows}):
        cfg_rows = [r for r in rows if (r.get("episodes", "synthetic"), r["calls"], r["prefix_tokens"]) == (kind, T, P)
                    and r["path"].startswith("packed_") and rce_exact(r)]
        if not cfg_rows:
            tol = tolerances("float32")
            lines.append(f"{kind:<9} T={T:>2} prefix={P:>3}: no packed path within the fp32 RCE tolerances "
                         f"(max |d log p| <= {tol['dlogp']:g}, max |d logit| <= {tol['dlogit']:g})")
            continue
        R = cfg_rows[0]["token_ratio"]
        best = {p: max((r for r in cfg_rows if r["pass"] == p), key=lambda r: r["speedup_vs_batched"])
                for p in ("forward", "forward_backward")}
        f, b = best["forward"]["speedup_vs_batched"], best["forward_backward"]["speedup_vs_batched"]
        ok = f >= 0.85 * R and b >= 0.9 * R and (R < 2 or min(f, b) > 1.63)
        lines.append(f"{kind:<9} T={T:>2} prefix={P:>3} R={R:4.2f}: best fwd {f:4.2f}x ({best['forward']['path']}), "
                     f"best f+b {b:4.2f}x ({best['forward_backward']['path']}) -> {'meets' if ok else 'misses'} target")
    return lines
