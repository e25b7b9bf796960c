"""Packing benchmark: independent calls vs every exact packed path, side by side in one run.

For each configuration (calls T x prefix tokens) it times, on the same episodes and model:
  independent_sequential  every call run alone, one after the other
  independent_batched     each episode's calls as one right-padded batch
  packed_<backend>        the packed sequence under each exact backend, and under `auto` (memopd.cost's pick)
forward (log-probs of the sampled tokens) and forward+backward (gradient of their sum), one episode at a
time: a path runs each episode's pack (or its calls) and, in forward+backward, that episode's backward
before the next episode starts, as a trainer's micro-batches do, so the peak memory is one episode's
activations whatever the number of episodes (memopd.plan: the timed forward+backward). The paths run
interleaved in every repeat; a path's speedup is the median over repeats of batched time / path time in
the same repeat, with a 95% bootstrap interval, so a noisy shared machine widens the interval instead of
moving the figure. Each path's RCE error against the sequential reference (max |d log p| of the sampled
tokens and full-vocabulary max |d logit|; `rce_exact` gates on both, at the fp32 tolerances), the token
ratio R = independent tokens / packed tokens and the FLOP ratio (linear layers + attention pairs) come
with it, and `calibrate` fits memopd.cost's weights to the timings.
Every path yields final hidden states at the sampled tokens; the LM head and log-softmax run on memopd.rce.CHUNK
positions at a time (rce.chunked_token_logprobs, timed identically for every path), and so does the RCE error.
"""
from __future__ import annotations

import math
import random
import statistics
import time

import torch

from memopd import cost
from memopd.attention import (
    AUTO,
    choose_backend,
    independent_hidden,
    lm_logits,
    model_dims,
    pack_shape,
    packed_hidden,
    recomputes_activations,
    token_logprobs,
)
from memopd.packing import pack
from memopd.rce import CHUNK, chunked_token_logprobs, spans, tolerances
from memopd.records import Episode
from memopd.stats import ratio_interval
from memopd.synthetic import random_episode

# The nine-configuration sweep: T in {4, 8, 16} x prefix in {128, 256, 512}; context ~200 and
# response ~64 tokens per call; a tiny Qwen2 of hidden 256, 4 layers, vocab 4096, fp32.
DEFAULTS = {
    "calls": [4, 8, 16],
    "prefix_tokens": [128, 256, 512],
    "response_tokens": 64,
    "observation_tokens": 136,  # + the retained 64-token response = ~200 context tokens per call
    "episodes": 1,
    "model": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 4096},
    "backends": ["sdpa", "eager", "flex", "prefix_shared", "calls", "segmented", "auto"],
    "dtype": "float32",
    # paths whose RCE is measured but not their time: the one-by-one reference, eager (a dense mask, slower than
    # sdpa's) and flex (on a CPU: forward only, compiled per length; set [] on a GPU)
    "untimed": ["independent_sequential", "packed_eager", "packed_flex"],
    "device": "cpu",  # where the sweep's model runs ("cuda": tests/gpu/check.sh)
}


def _model(spec: dict, seed: int, device: str = "cpu"):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(**spec, max_position_embeddings=8192, tie_word_embeddings=False, use_sliding_window=False)
    with torch.device(device):  # initialised where it runs: a 3B-sized layer stack is slow to initialise on a CPU
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


def interleaved_times(fns: dict, repeats: int, warmup: int = 1, progress=None) -> dict[str, list[float]]:
    """Seconds of every function per repeat, the functions interleaved within each repeat (their order rotated
    from one repeat to the next), so that a slow spell of a shared machine hits every path alike and a ratio
    of two paths' times in the same repeat cancels it. `warmup` untimed rounds first (flex compiles).
    `progress` (a memopd.progress.Progress over (warmup + repeats) x len(fns) runs): a line after each run."""
    names = list(fns)
    times = {n: [] for n in names}
    for r in range(warmup + repeats):
        for n in names[r % len(names):] + names[: r % len(names)]:
            t0 = time.perf_counter()
            fns[n]()
            if r >= warmup:
                times[n].append(time.perf_counter() - t0)
            if progress is not None:
                progress.update(1, f"{n}, {'warm-up' if r < warmup else f'repeat {r - warmup + 1}'}")
    return times


def _paths(model, episodes, backends):
    """(path name -> function of an episode's index returning its (N_e, H) final hidden states at the sampled
    action tokens, in the packed action order; each episode's targets (N_e,)). independent_batched runs one
    episode's calls as one right-padded batch."""
    packs = [pack(ep) for ep in episodes]
    paths = {"independent_sequential": lambda e: independent_hidden(model, episodes[e], batched=False),
             "independent_batched": lambda e: independent_hidden(model, episodes[e], batched=True)}
    for b in backends:
        paths[f"packed_{b}"] = lambda e, b=b: packed_hidden(model, packs[e], b)
    return paths, [p.targets for p in packs]


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


def path_features(model, episodes: list[Episode], name: str) -> dict[str, float] | None:
    """memopd.cost terms of a timed path (None: independent_sequential, which the cost model does not price):
    independent_batched is `calls` over every call of the episodes; a packed path sums its packs (one per
    episode), `auto` at the path it chose for each."""
    dims, dev = model_dims(model), next(model.parameters()).device.type
    if name == "independent_batched":
        return cost.features([pack_shape(pack(ep))[0] for ep in episodes], dims, "calls", dev)
    if not name.startswith("packed_"):
        return None
    out: dict[str, float] = {}
    for ep in episodes:
        p = pack(ep)
        b = name[len("packed_"):]
        for k, v in cost.features(pack_shape(p), dims, choose_backend(model, p) if b == AUTO else b, dev).items():
            out[k] = out.get(k, 0.0) + v
    return out


HEADER = (f"{'episodes':<9} {'T':>3} {'prefix':>6} {'R':>5} {'FLOPx':>5}  {'path':<24} {'fwd x [95% CI]':>19} "
          f"{'f+b x [95% CI]':>19}  {'RCE max|dlogp|':>14} {'max|dlogit|':>11}")


def _x(m, lo, hi) -> str:
    return f"{m:5.2f} [{lo:4.2f}, {hi:4.2f}]" if not math.isnan(lo) else f"{m:5.2f} {'':>12}"


def measure(model, episodes: list[Episode], backends, repeats: int, kind: str = "synthetic", log=print,
            untimed=()) -> list[dict]:
    """Time every path on one set of episodes (forward and forward+backward, the paths interleaved in every
    repeat) with its RCE error; one row per (path, pass): median seconds, the median per-repeat speedup over
    independent_batched with its 95% bootstrap interval. T and prefix_tokens are the episodes' means (equal on
    synthetic episodes). `auto` rows name the path(s) it chose. Paths in `untimed` get their RCE only (one
    row, pass "rce")."""
    if "independent_batched" in untimed:
        raise ValueError("packing benchmark: independent_batched is the baseline of every speedup; it is always timed")
    T = sum(len(ep.invocations) for ep in episodes) / len(episodes)
    P = sum(ep.prefix_len for ep in episodes) / len(episodes)
    T, P = (int(T) if T == int(T) else round(T, 2)), (int(P) if P == int(P) else round(P, 1))
    n_ind = sum(len(i.input_ids) + len(i.output_ids) for ep in episodes for i in ep.invocations)
    R = n_ind / sum(len(pack(ep)) for ep in episodes)
    fr = flop_ratio(episodes, model)
    hidden_fns, targets = _paths(model, episodes, backends)
    ids = range(len(episodes))
    with torch.no_grad():
        ref = torch.cat([hidden_fns["independent_sequential"](e) for e in ids])
        errs = {name: rce_error(model, ref, torch.cat([fn(e) for e in ids]), torch.cat(targets))
                for name, fn in hidden_fns.items()}
    del ref
    fwd = {name: (lambda fn=fn: [chunked_token_logprobs(model, fn(e), targets[e]) for e in ids])
           for name, fn in hidden_fns.items() if name not in untimed}

    def backward(fn):  # one episode's graph at a time; the gradients add up over the episodes
        model.zero_grad(set_to_none=True)
        for e in ids:
            chunked_token_logprobs(model, fn(e), targets[e]).sum().backward()

    ckpt = recomputes_activations(model)  # prefix_shared's calls read the prefix KV cache checkpointed layers drop
    fb = {name: (lambda fn=fn: backward(fn)) for name, fn in hidden_fns.items() if name not in untimed
          and not (name == "packed_flex" and not torch.cuda.is_available())  # flex backward: GPU only
          and not (ckpt and name == "packed_prefix_shared")}
    with torch.no_grad():
        t_fwd = interleaved_times(fwd, repeats)
    training = model.training
    model.train(ckpt)  # transformers recomputes a layer only in training mode (these models have no dropout)
    try:
        t_fb = interleaved_times(fb, repeats)
    finally:
        model.train(training)
    model.zero_grad(set_to_none=True)
    chosen = {}
    if f"packed_{AUTO}" in hidden_fns:
        chosen = {"forward": _auto_choice(model, episodes, grad=False), "forward_backward": _auto_choice(model, episodes)}
    rows, speed = [], {}
    base = {"episodes": kind, "n_episodes": len(episodes), "calls": T, "prefix_tokens": P, "token_ratio": round(R, 4),
            "flop_ratio": round(fr, 4)}
    for name in hidden_fns:
        if name in untimed:
            rows.append({**base, "path": name, "pass": "rce", "rce_max_abs_dlogp": errs[name][0],
                         "rce_max_abs_dlogit": errs[name][1]})
            log(f"{kind:<9} {T:>3} {P:>6} {R:5.2f} {fr:5.2f}  {name:<24} {'(not timed)':>19} {'':>19}  "
                f"{errs[name][0]:14.2e} {errs[name][1]:11.2e}")
            continue
        feats = path_features(model, episodes, name)
        for pass_name, times in (("forward", t_fwd), ("forward_backward", t_fb)):
            if name not in times:
                continue
            m, lo, hi = ratio_interval(times["independent_batched"], times[name])
            speed[name, pass_name] = (m, lo, hi)
            rows.append({**base, "path": name, "pass": pass_name, "seconds": statistics.median(times[name]), "speedup_vs_batched": m, "speedup_lo": lo,
                         "speedup_hi": hi, "repeats": repeats, "threads": torch.get_num_threads(),
                         "auto_chose": chosen.get(pass_name, "") if name == f"packed_{AUTO}" else "",
                         "rce_max_abs_dlogp": errs[name][0], "rce_max_abs_dlogit": errs[name][1],
                         **({f"cost_{k}": v for k, v in feats.items()} if feats else {})})
        f = _x(*speed[name, "forward"])
        b = _x(*speed[name, "forward_backward"]) if (name, "forward_backward") in speed else f"{'n/a':>19}"
        log(f"{kind:<9} {T:>3} {P:>6} {R:5.2f} {fr:5.2f}  {name:<24} {f} {b}  {errs[name][0]:14.2e} {errs[name][1]:11.2e}"
            + (f"  auto: {chosen['forward_backward']}" if name == f"packed_{AUTO}" else ""))
    return rows


def _auto_choice(model, episodes: list[Episode], grad: bool = True) -> str:
    """The path(s) `auto` runs these episodes' packs on, with grad on or off ('+'-joined when they differ)."""
    with torch.set_grad_enabled(grad):
        return "+".join(dict.fromkeys(choose_backend(model, pack(ep)) for ep in episodes))


def calibrate(rows: list[dict]) -> dict[str, dict[str, float]]:
    """memopd.cost weights per pass, fit on every timed row the cost model prices (memopd.cost.fit)."""
    out = {}
    for pass_name in ("forward", "forward_backward"):
        pts = [{"features": {k[len("cost_"):]: v for k, v in r.items() if k.startswith("cost_") and v not in ("", None)},
                "seconds": r["seconds"]} for r in rows if r["pass"] == pass_name and r["path"] != f"packed_{AUTO}"]
        pts = [p for p in pts if p["features"]]
        if pts:
            out[pass_name] = cost.fit(pts)
    return out


def run_sweep(cfg: dict | None = None, seed: int = 0, repeats: int = 3, log=print) -> list[dict]:
    """The synthetic sweep: calls x prefix_tokens configurations on the benchmark's own tiny model."""
    cfg = {**DEFAULTS, **(cfg or {})}
    model = _model(cfg["model"], seed, cfg["device"])
    vocab = cfg["model"]["vocab_size"]
    rows = []
    log(HEADER)
    for T in cfg["calls"]:
        for P in cfg["prefix_tokens"]:
            rng = random.Random(seed * 1000 + T * 7 + P)
            pool = [rng.randrange(vocab) for _ in range(8192)]
            episodes = [random_episode(rng, pool, "full_retention", T, P, cfg["observation_tokens"],
                                       cfg["response_tokens"], task_id=f"bench{e}") for e in range(cfg["episodes"])]
            rows += measure(model, episodes, cfg["backends"], repeats, "synthetic", log, untimed=cfg["untimed"])
    return rows


def truncate(ep: Episode, calls: int) -> Episode:
    """The first `calls` calls of an episode: still a real trajectory prefix (retained spans only point
    backwards, so every kept call's state is unchanged)."""
    return Episode(ep.task_id, ep.prefix_len, ep.invocations[:calls], ep.reward, ep.metrics).validate()


def run_real(model, episodes: list[Episode], calls=(2, 4, 6), n_episodes: int = 4, backends=DEFAULTS["backends"],
             repeats: int = 3, log=print, untimed=DEFAULTS["untimed"]) -> list[dict]:
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
        rows += measure(model, eps, backends, repeats, "real", log, untimed=untimed)
    return rows


# The packing targets (per configuration, speedup over batched independent calls): the best exact path and
# `auto` >= 1.0x with the interval's lower bound; where R >= 1.75, forward >= 0.85 R and forward+backward
# >= 0.9 R (medians). For scale: the paper reports 1.08-1.63x, verl's prefix grouping 1.26-1.70x.
TARGETS = {"min_lower": 1.0, "r_from": 1.75, "forward": 0.85, "forward_backward": 0.9}


def summarize(rows: list[dict]) -> list[str]:
    """Per configuration: the fastest exact packed path (`rce_exact`) and `auto`, with their intervals, against
    TARGETS; a last line counts the configurations that meet them."""
    lines, met, n = [], 0, 0
    for kind, T, P in sorted({(r.get("episodes", "synthetic"), r["calls"], r["prefix_tokens"]) for r in rows}):
        cfg_rows = [r for r in rows if (r.get("episodes", "synthetic"), r["calls"], r["prefix_tokens"]) == (kind, T, P)
                    and r["path"].startswith("packed_") and rce_exact(r) and r["pass"] != "rce"]
        if not cfg_rows:
            tol = tolerances("float32")
            lines.append(f"{kind:<9} T={T:>2} prefix={P:>3}: no timed packed path within the fp32 RCE tolerances "
                         f"(max |d log p| <= {tol['dlogp']:g}, max |d logit| <= {tol['dlogit']:g})")
            continue
        n += 1
        R = cfg_rows[0]["token_ratio"]
        ok, parts = True, []
        for pass_name in ("forward", "forward_backward"):
            pr = [r for r in cfg_rows if r["pass"] == pass_name]
            if not pr:
                continue
            best = max(pr, key=lambda r: r["speedup_vs_batched"])
            auto = next((r for r in pr if r["path"] == f"packed_{AUTO}"), None)
            need = TARGETS[pass_name] * R if R >= TARGETS["r_from"] else 0.0
            for r in (best, auto) if auto is not None and auto is not best else (best,):
                lo = r.get("speedup_lo", float("nan"))
                good = r["speedup_vs_batched"] >= need and not math.isnan(lo) and lo >= TARGETS["min_lower"]
                ok &= good
                parts.append(f"{pass_name.replace('forward_backward', 'f+b').replace('forward', 'fwd')} "
                             f"{r['path'][len('packed_'):]}{'(' + r['auto_chose'] + ')' if r.get('auto_chose') else ''} "
                             f"{r['speedup_vs_batched']:4.2f}x [{lo:4.2f}, {r.get('speedup_hi', float('nan')):4.2f}]"
                             f"{'' if good else ' MISS'}")
        met += ok
        need = (f"; needs lower bound >= {TARGETS['min_lower']:g}x" + (
            f", fwd >= {TARGETS['forward'] * R:4.2f}x, f+b >= {TARGETS['forward_backward'] * R:4.2f}x"
            if R >= TARGETS["r_from"] else ""))
        lines.append(f"{kind:<9} T={T:>2} prefix={P:>3} R={R:4.2f}: " + ", ".join(parts) + need
                     + f" -> {'meets' if ok else 'misses'}")
    lines.append(f"{met} of {n} configurations meet the targets (paper: 1.08-1.63x, verl prefix grouping 1.26-1.70x)")
    return lines
