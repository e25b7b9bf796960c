"""The audit steps behind `memopd audit ...`: roll out the audit episodes once, then one table (CSV +
Markdown with a caption saying what produced it) and, for some steps, one PNG figure.

Tables (results/tables/) and what they read:
  alignment_audit     persistent history, batched independent calls, packed backends vs independent calls
  state_corruption    exact vs visibility-only, positions-only and both corruptions (same columns)
  teacher_divergence  the teacher on the flattened vs the exact state, by invocation (+ figure)
  action_domain       the exact action mask vs the response and trajectory masks
  context_updates     RCE per memory-rewrite rule (one episode file per rule)
  packing_efficiency  speedup vs token ratio, real and synthetic episodes, fwd and fwd+bwd (+ figure)
`cfg` is the `audit` config section; the rollout step also takes `agent` and `rollout`.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from memopd.config import AuditRollout, AuditScoring, PackingAudit
from memopd.progress import Progress
from memopd.records import Episode, load_episodes, save_episodes
from memopd.outputs import pyplot, save_figure, write_table
from memopd.outputs import write_json as _write_json

# --- episodes -------------------------------------------------------------------------------------


# The paper's audit figures (arXiv 2608.07068, Qwen2.5-3B student / 7B teacher), quoted beside ours in the findings.
PAPER = {"model": "Qwen2.5-3B", "teacher": "Qwen2.5-7B", "persistent_p99": 1.774, "persistent_top1": 651,
         "persistent_false_clip": 0.1329, "packed_p99": 3.43e-5, "teacher_top1_agreement": 0.812,
         "teacher_p99": 19.854, "teacher_kl": 0.793, "teacher_top1": 444, "positions_top1": 260,
         "positions_false_clip": 0.0497}

def rollout_step(cfg: dict, model_dir: str, benchmark: str, index: str, out: str, seed: int,
                 rule: str | None = None, limit: int | None = None) -> list[Episode]:
    """Roll out the audit episodes once and save them (parquet) with their provenance (JSON beside it).
    `cfg` holds the `agent`, `rollout` and `audit` sections. rule=None: audit.rule, else agent.rule."""
    from dataclasses import replace

    from memopd.generation.backends import make_backend
    from memopd.agent.protocol import load_tasks
    from memopd.agent.rollout import rollout
    from memopd.config import agent_config, rollout_config
    from memopd.retrieval import load_retriever

    audit = AuditRollout.from_dict(cfg["audit"])
    rule = rule or audit.rule or cfg["agent"]["rule"]
    limit = limit or audit.episodes
    retriever = load_retriever(index)  # before the model: a missing index is refused at once
    torch.manual_seed(seed)
    overrides = audit.sampling()
    ro = rollout_config(cfg)
    backend, tok, _ = make_backend(ro, model_dir, seed=seed, **overrides)
    tasks = load_tasks(benchmark, limit=limit)
    agent = agent_config(cfg)
    agent = replace(agent, rule=rule, invalid_action=audit.invalid_action or agent.invalid_action)
    episodes = rollout(tasks, backend, tok, retriever, agent, seed=seed, label=f"audit rollout {rule}")
    out = Path(out)
    save_episodes(out, episodes)
    sampling = backend.sampling if hasattr(backend, "sampling") else None
    meta = {"model": Path(model_dir).name, "benchmark": Path(benchmark).stem, "rule": rule,
            "invalid_action": agent.invalid_action, "seed": seed, "backend": backend.name,
            "rollout_dtype": ro.dtype,
            "temperature": getattr(sampling, "temperature", overrides.get("temperature")),
            "max_new_tokens": getattr(sampling, "max_new_tokens", overrides.get("max_new_tokens")),
            **episode_stats(episodes)}
    _write_json(out.with_suffix(".json"), meta)
    print(f"{len(episodes)} episodes ({meta['calls']} calls, {meta['memory_updates']} with retained memory, "
          f"{meta['action_tokens']} action tokens) -> {out}")
    return episodes


def episode_stats(episodes: list[Episode]) -> dict:
    return {"episodes": len(episodes), "calls": sum(len(e.invocations) for e in episodes),
            "multi_call_episodes": sum(len(e.invocations) > 1 for e in episodes),
            "memory_updates": sum(bool(i.retained) for e in episodes for i in e.invocations),
            "retained_tokens": sum(r.length for e in episodes for i in e.invocations for r in i.retained),
            "action_tokens": sum(len(i.output_ids) for e in episodes for i in e.invocations),
            "invalid_actions": sum(e.metrics.get("invalid_actions", 0) for e in episodes)}


def read_episodes(path: str | Path) -> tuple[list[Episode], dict]:
    """Episodes and their provenance (the JSON written beside them; from the episodes' metrics if absent,
    e.g. for `memopd eval` output)."""
    path = Path(path)
    episodes = load_episodes(path)
    side = path.with_suffix(".json")
    meta = json.loads(side.read_text()) if side.exists() else {}
    m = episodes[0].metrics if episodes else {}
    meta.setdefault("model", path.parent.name)
    meta.setdefault("benchmark", m.get("benchmark", "?"))
    meta.setdefault("rule", m.get("rule", "?"))
    meta.update(episode_stats(episodes))  # always what is in the file
    return episodes, meta


def describe(meta: dict) -> str:
    """What produced the episodes, for captions."""
    return (f"{meta['episodes']} {meta['benchmark']} trajectories ({meta['calls']} calls, "
            f"{meta['memory_updates']} with retained memory, {meta['action_tokens']} sampled action tokens) "
            f"rolled out by {meta['model']} (rule {meta['rule']}, invalid_action {meta.get('invalid_action', '?')}, "
            f"temperature {meta.get('temperature', '?')}, max_new_tokens {meta.get('max_new_tokens', '?')}, "
            f"{meta.get('backend', '?')} backend, seed {meta.get('seed', '?')})")


def _device() -> str:
    from memopd.models import default_device

    return default_device()


def _load(model_dir: str, dtype: str):
    from memopd.models import load_model

    return load_model(model_dir, dtype=dtype, device=_device())


def _flex_note(backends, device: str) -> str:
    """What `flex` means where it ran (`device`): on CPU it is compiled per sequence length up to torch's recompile
    limit, then runs unfused (same BlockMask semantics), and has no backward."""
    if "flex" not in backends or device != "cpu":
        return ""
    return ("; flex on CPU: compiled per sequence length up to torch's recompile limit, unfused "
            "flex_attention (same BlockMask) beyond it, forward only")


def _orders(x: float, tol: float) -> str:
    return f"{math.log10(x / tol):.1f}" if x > 0 else "-inf"


# --- tables ---------------------------------------------------------------------------------------


def alignment_step(cfg: AuditScoring, model_dir: str, episodes_path: str, out: str) -> list[dict]:
    """Table 3: persistent history, batched independent calls and every packed backend vs each call run
    alone, at the sampled action tokens."""
    from memopd.audit.alignment import state_rows

    episodes, meta = read_episodes(episodes_path)
    model = _load(model_dir, cfg.dtype)
    states = ["persistent_history", "independent_batched"] + [f"packed_{b}" for b in list(cfg.backends)]
    rows = state_rows(model, episodes, states, clip=cfg.clip, dtype=cfg.dtype)
    alignment_table(rows, cfg, _device(), meta, out)
    return rows


def alignment_table(rows: list[dict], cfg: AuditScoring, device: str, meta: dict, out: str | Path) -> None:
    """Table 3 of the audit's rows (memopd.audit.alignment.state_rows) as scored on `device`, of the episodes
    `meta` describes (read_episodes): its CSV, and its Markdown with the caption and the finding."""
    from memopd.rce import tolerances

    tol = tolerances(cfg.dtype)["dlogp"]  # this table scores the sampled tokens only (the |d log p| column)
    r = {x["state"]: x for x in rows}
    packed = [x for x in rows if x["state"].startswith("packed_")]
    worst = max(packed, key=lambda x: x["max_abs_dlogp"])
    notes = [f"Finding: every packed backend at the {cfg.dtype} floor (max |d log p| <= {tol:g}): "
             f"{'yes' if all(x['at_floor'] for x in packed) else 'NO'} (worst {worst['state']} "
             f"{worst['max_abs_dlogp']:.2e}); persistent history max |d log p| "
             f"{r['persistent_history']['max_abs_dlogp']:.3g}, "
             f"{_orders(r['persistent_history']['max_abs_dlogp'], tol)} orders of magnitude above the tolerance, "
             f"p99 {r['persistent_history']['p99_abs_dlogp']:.3g}, {r['persistent_history']['top1_changes']} top-1 "
             f"changes, false clip rate {r['persistent_history']['false_clip_rate']:.4f} "
             f"(paper, {PAPER['model']}: p99 {PAPER['persistent_p99']}, {PAPER['persistent_top1']} top-1 changes, "
             f"false clip rate {PAPER['persistent_false_clip']}; packed p99 {PAPER['packed_p99']}, ours "
             f"{worst['p99_abs_dlogp']:.2e} worst)."]
    caption = (f"Alignment audit: |d log p| of the sampled action tokens vs each call run alone "
               f"(p99, max, mean over tokens), top-1 changes at action positions, false PPO clip rate "
               f"(ratio outside [1-{cfg.clip}, 1+{cfg.clip}] with identical weights). Model {meta['model']} "
               f"scored in {cfg.dtype} on {device} (packed rows: backend named"
               f"{_flex_note(list(cfg.backends), device)}; persistent history and references: sdpa); episodes: "
               f"{describe(meta)}.")
    write_table(rows, out, caption, notes=notes)


def state_corruption_step(cfg: AuditScoring, model_dir: str, episodes_path: str, out: str) -> list[dict]:
    """The exact state vs deliberate corruptions of it: visibility only, positions only, both."""
    from memopd.audit.alignment import state_rows

    episodes, meta = read_episodes(episodes_path)
    model = _load(model_dir, cfg.dtype)
    rows = state_rows(model, episodes, ["packed_sdpa", "corrupt_visibility", "corrupt_positions", "corrupt_both"],
                      clip=cfg.clip, dtype=cfg.dtype)
    for row in rows:
        row["state"] = {"packed_sdpa": "exact (packed_sdpa)"}.get(row["state"], row["state"])
    r = {x["state"]: x for x in rows}
    vis, pos = r["corrupt_visibility"], r["corrupt_positions"]
    keys = ("p99_abs_dlogp", "max_abs_dlogp", "mean_abs_dlogp", "top1_changes", "false_clip_rate")
    worse = [k for k in keys if vis[k] > pos[k]]
    verdict = ("holds on every column" if len(worse) == len(keys) else
               "does not hold on any column" if not worse else f"holds on {', '.join(worse)} only")
    notes = [f"Finding: the paper's ordering (visibility corruption worse than position corruption) {verdict}: "
             + "; ".join(f"{k} {vis[k]:.3g} (visibility) vs {pos[k]:.3g} (positions)" for k in keys) + ". "
             f"Positions only, paper ({PAPER['model']}): {PAPER['positions_top1']} top-1 changes, false clip rate "
             f"{PAPER['positions_false_clip']}; here {pos['top1_changes']} and {pos['false_clip_rate']:.4f}.",
             "corrupt_both (running positions and plain causal visibility) is the persistent-history layout."]
    caption = (f"State corruption: the exact packed state and deliberate corruptions of it, scored against each "
               f"call run alone (columns as in the alignment audit). Model {meta['model']} in {cfg.dtype} on "
               f"{_device()}, sdpa with dense masks; episodes: {describe(meta)}.")
    write_table(rows, out, caption, notes=notes)
    return rows


def teacher_divergence_step(cfg: AuditScoring, teacher_dir: str, episodes_path: str, out: str,
                            figure: str) -> list[dict]:
    """The teacher scored on the persistent flattening vs the exact state, by invocation index."""
    from memopd.audit.alignment import teacher_divergence

    episodes, meta = read_episodes(episodes_path)
    teacher = _load(teacher_dir, cfg.dtype)
    rows = teacher_divergence(teacher, episodes)
    r = {x["invocation"]: x for x in rows}
    notes = []
    if "after_first_update" in r:
        b, a = r["before_first_update"], r["after_first_update"]
        notes.append(f"Finding: before the first memory update the teacher sees the same state in both layouts "
                     f"(top-1 agreement {b['top1_agreement']:.3f}, p99 |d log p| {b['p99_abs_dlogp']:.2e}); after it, "
                     f"top-1 agreement {a['top1_agreement']:.3f}, p99 |d log p| {a['p99_abs_dlogp']:.3g}, "
                     f"mean KL {a['mean_kl']:.3g} nats, {a['top1_changes']} teacher top-1 changes (paper, "
                     f"{PAPER['teacher']}: top-1 agreement {PAPER['teacher_top1_agreement']}, p99 "
                     f"{PAPER['teacher_p99']}, mean KL {PAPER['teacher_kl']}, {PAPER['teacher_top1']} top-1 changes).")
    caption = (f"Teacher divergence: teacher {Path(teacher_dir).name} ({cfg.dtype}, {_device()}, sdpa) scored at "
               f"the sampled action tokens on the persistent-history flattening vs the exact state; by invocation "
               f"index, then before/after the first memory update (call 0 / calls >= 1); mean_kl = KL(exact || "
               f"flattened) per token in nats. Episodes: {describe(meta)}.")
    write_table(rows, out, caption, notes=notes)
    _teacher_figure([x for x in rows if x["invocation"].isdigit()], figure, Path(teacher_dir).name, meta)
    return rows


def _teacher_figure(rows: list[dict], path: str, teacher: str, meta: dict) -> None:
    plt = pyplot()
    x = [int(r["invocation"]) for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    a1.plot(x, [r["top1_agreement"] for r in rows], "o-")
    a1.set(xlabel="invocation index", ylabel="teacher top-1 agreement", ylim=(-0.02, 1.02),
           title="flattened vs exact state")
    floor = 1e-12  # call 0 is equal up to float noise; keep it on the log axis
    a2.semilogy(x, [max(r["p99_abs_dlogp"], floor) for r in rows], "o-", label="p99 |d log p|")
    a2.semilogy(x, [max(r["mean_kl"], floor) for r in rows], "s--", label="mean KL (nats)")
    a2.set(xlabel="invocation index", title="teacher divergence")
    a2.legend()
    for a in (a1, a2):
        a.set_xticks(x)
    save_figure(fig, path, f"teacher {teacher} on {meta['episodes']} {meta['benchmark']} rollouts of {meta['model']} "
                f"(rule {meta['rule']})", dpi=120, suptitle=True)


def action_domain_step(cfg: dict, episodes_path: str, out: str) -> list[dict]:
    """Which positions of the flattened transcripts each training mask selects."""
    from memopd.audit.alignment import action_domain

    episodes, meta = read_episodes(episodes_path)
    rows = action_domain(episodes)
    r = {x["mask"]: x for x in rows}
    ex, traj, resp = (r[k]["selected_positions"] for k in ("exact_action_mask", "trajectory_mask", "response_mask"))
    # arXiv 2608.07068 (64 trajectories, 199 calls): 12,083 sampled action tokens; trajectory and response
    # masks add 66,830 and 74,357 spurious positions
    p_ex, p_traj, p_resp = 12083, 12083 + 66830, 12083 + 74357
    holds = ex < traj <= resp
    why = []
    if ex == traj:
        why.append("no response token was retained into a later context, so the trajectory mask equals the exact mask")
    if traj == resp and ex < traj:
        why.append("no observation entered a context after the first call, so the response and trajectory masks "
                   "coincide")
    notes = [f"Finding: the exact action domain selects {ex:,} sampled action positions; the trajectory mask adds "
             f"{traj - ex:,} spurious positions (retained response copies) and the response mask {resp - ex:,} (the "
             f"copies plus {resp - traj:,} observation positions after the first call), "
             f"{(traj - ex) / ex if ex else 0:.2f}x and {(resp - ex) / ex if ex else 0:.2f}x the action count. "
             f"The paper's ordering exact < trajectory <= response {'holds' if holds else 'does NOT hold'} here "
             f"({ex:,} < {traj:,} <= {resp:,})" + (f" ({'; '.join(why)})" if why else "")
             + f". Paper (64 trajectories, 199 calls): {p_ex:,} sampled action tokens, +{p_traj - p_ex:,} (trajectory) "
             f"and +{p_resp - p_ex:,} (response), {(p_traj - p_ex) / p_ex:.2f}x and {(p_resp - p_ex) / p_ex:.2f}x."]
    caption = ("Action domain: positions of the flattened transcripts y = [q, x_0, a_0, x_1, a_1, ...] (one per "
               "episode) that each training mask selects; spurious = selected but not the sampled occurrence of an "
               "action. z_0 = [q, x_0], the first call's whole input, is the prompt; every token of x_t (t >= 1) is "
               "either a retained copy of an earlier response (from the recorded provenance, never by matching ids) "
               "or an observation the environment inserted (`<information>` block, hint). "
               "exact_action_mask: the sampled occurrence of every a_t (MemOPD). "
               "trajectory_mask: the info-masked trajectory of Search-R1 (Jin et al. 2025, arXiv:2503.09516, loss "
               "masking for retrieved tokens) and MEM1 (Zhou et al. 2025, arXiv:2506.15841, masked trajectory with "
               "information tokens masked from the loss), which train on model-generated tokens only: every token "
               "after z_0 except the observations, i.e. the sampled actions plus the retained copies (model text, "
               "so an info mask keeps them). "
               "response_mask: every token after z_0, observations included, as when all turns after the prompt are "
               "trained as one response with no tool-output mask (e.g. verl's response_mask, the attention mask of "
               "the response part). exact <= trajectory <= response position by position, by construction. "
               f"Counts only (no model); episodes: {describe(meta)}.")
    write_table(rows, out, caption, notes=notes)
    return rows


def context_updates_step(cfg: AuditScoring, model_dir: str, episode_paths: list[str], out: str) -> list[dict]:
    """RCE per memory-rewrite rule (one episode file per rule) and backend."""
    from memopd.audit.alignment import context_update_rows
    from memopd.rce import tolerances

    by_rule, metas = {}, []
    for p in episode_paths:
        eps, meta = read_episodes(p)
        by_rule[meta["rule"]] = eps
        metas.append(meta)
    model = _load(model_dir, cfg.dtype)
    rows, bar = [], Progress("audit context-updates", len(by_rule), "rules")
    for rule, eps in by_rule.items():  # a rule at a time: a line each
        rows += context_update_rows(model, {rule: eps}, list(cfg.backends), dtype=cfg.dtype)
        bar.update(1, note=rule)
    bar.close()
    calls = {m["rule"]: (m["calls"], m["retained_tokens"]) for m in metas}
    for row in rows:
        row["calls"], row["retained_tokens"] = calls[row["rule"]]
    order = ["rule", "backend", "episodes", "calls", "memory_updates", "retained_tokens"]
    rows = [{**{k: row[k] for k in order}, **{k: v for k, v in row.items() if k not in order}} for row in rows]
    tol = tolerances(cfg.dtype)
    gate = f"max |d log p| <= {tol['dlogp']:g} and full-vocabulary max |d logit| <= {tol['dlogit']:g}"
    failed = [f"{x['rule']}/{x['backend']}" for x in rows if not x["passed"]]
    notes = [f"Finding: {len(rows) - len(failed)} of {len(rows)} (rule, backend) pairs at the {cfg.dtype} floor "
             f"({gate})" + (f"; failed: {', '.join(failed)}" if failed else "") + "; worst max |d log p| "
             f"{max(x['max_abs_dlogp'] for x in rows):.2e}, worst max |d logit| "
             f"{max(x['max_abs_dlogit'] for x in rows):.2e} (paper: every rule at the numerical floor)."]
    m = metas[0]
    caption = (f"Context updates: RCE (packed vs each call run alone) per memory-rewrite rule and backend; passed = "
               f"{gate} ({cfg.dtype} tolerances). Model "
               f"{Path(model_dir).name} scored in {cfg.dtype} on {_device()}"
               f"{_flex_note(list(cfg.backends), _device())}; "
               f"per rule: "
               f"{m['episodes']} {m['benchmark']} trajectories rolled out by {m['model']} (invalid_action "
               f"{m.get('invalid_action', '?')}, temperature {m.get('temperature', '?')}, max_new_tokens "
               f"{m.get('max_new_tokens', '?')}, seed {m.get('seed', '?')}); memory_updates = calls whose context "
               f"holds retained response tokens.")
    write_table(rows, out, caption, notes=notes)
    return rows


def packing_step(pk: PackingAudit, audit_backends, model_dir: str, episodes_path: str, out: str, figure: str,
                 seed: int = 0) -> list[dict]:
    """Packing efficiency: synthetic sweep (the benchmark's tiny model) and real audit episodes (the audit
    model), every path, forward and forward+backward, each row with its RCE error; the paths are
    audit.packing.backends, else the audit's (`audit_backends`)."""
    from memopd.audit.packing_bench import DEFAULTS, run_real, run_sweep, summarize
    from memopd.rce import tolerances

    backends = list(pk.backends or audit_backends)
    syn = {**pk.synthetic, "backends": backends}
    rows = run_sweep(syn, seed=seed, repeats=pk.repeats)
    episodes, meta = read_episodes(episodes_path)
    model = _load(model_dir, "float32")
    if pk.activation_checkpointing:  # one episode's activations would not fit (memopd.plan)
        from memopd.parallel import checkpoint_activations

        model = checkpoint_activations(model)
    real = pk.real
    rows += run_real(model, episodes, calls=real["calls"], n_episodes=real["episodes"], backends=backends,
                     repeats=pk.repeats)
    for line in summarize(rows):
        print(line)
    syn = {**DEFAULTS, **syn}
    full = sorted(syn["calls"]) == [4, 8, 16] and sorted(syn["prefix_tokens"]) == [128, 256, 512]
    sweep = (f"{len(syn['calls']) * len(syn['prefix_tokens'])} configurations (calls {syn['calls']} x prefix "
             f"{syn['prefix_tokens']})" + ("" if full else ", a reduced sweep: the full nine (calls [4, 8, 16] x "
                                                             "prefix [128, 256, 512]) exceed the embedded time budget; "
                                                             "set audit.packing.synthetic for the full sweep"))
    m, tol = syn["model"], tolerances("float32")
    caption = (f"Packing efficiency: {pk.repeats} timed repeat(s) after a warm-up, the paths interleaved in every "
               f"repeat; median seconds, and the median per-repeat speedup vs independent calls batched with padding "
               f"with its 95% bootstrap interval (speedup_lo, speedup_hi); `packed_auto` is memopd.cost's pick per pack "
               f"(auto_chose); token ratio R = independent tokens / packed tokens, FLOP "
               f"ratio, and each path's RCE error vs calls run one by one (max |d log p| of the sampled tokens, "
               f"full-vocabulary max |d logit|; exact: <= {tol['dlogp']:g} and <= {tol['dlogit']:g}, the float32 "
               f"tolerances). float32 on {_device()}, "
               f"{torch.get_num_threads()} torch thread(s){_flex_note(backends, _device())}. Synthetic: {sweep}, "
               f"full-retention episodes of {syn['episodes']} episode(s), ~{syn['observation_tokens']}+"
               f"{syn['response_tokens']} context and {syn['response_tokens']} response tokens per call, tiny Qwen2 "
               f"(hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, vocab {m['vocab_size']}). Real: the "
               f"first {real['episodes']} audit episodes with >= T calls cut to their first T calls, T in "
               f"{real['calls']}, scored by {Path(model_dir).name}, one episode at a time"
               + (", forward+backward with activation checkpointing (prefix_shared: forward only)"
                  if pk.activation_checkpointing else "") + f"; episodes: {describe(meta)}.")
    write_table(rows, out, caption, notes=["Best exact packed path per configuration: "] + summarize(rows))
    _packing_figure(rows, figure)
    return rows


def _packing_figure(rows: list[dict], path: str) -> None:
    from memopd.audit.packing_bench import rce_exact

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    best = {}
    for r in rows:
        if r["path"].startswith("packed_") and r["pass"] != "rce" and rce_exact(r):
            k = (r["episodes"], r["calls"], r["prefix_tokens"], r["pass"])
            if k not in best or r["speedup_vs_batched"] > best[k]["speedup_vs_batched"]:
                best[k] = r
    style = {("synthetic", "forward"): ("o", "C0"), ("synthetic", "forward_backward"): ("s", "C0"),
             ("real", "forward"): ("o", "C1"), ("real", "forward_backward"): ("s", "C1")}
    for (kind, pss), (marker, color) in style.items():
        pts = [r for (k, *_, p), r in best.items() if k == kind and p == pss]
        if pts:
            x, y = [r["token_ratio"] for r in pts], [r["speedup_vs_batched"] for r in pts]
            err = [[max(0.0, r["speedup_vs_batched"] - r.get("speedup_lo", r["speedup_vs_batched"])) for r in pts],
                   [max(0.0, r.get("speedup_hi", r["speedup_vs_batched"]) - r["speedup_vs_batched"]) for r in pts]]
            err = [[0.0 if e != e else e for e in side] for side in err]  # one repeat: no interval
            ax.errorbar(x, y, yerr=err, fmt="none", ecolor=color, elinewidth=0.8, capsize=2)
            ax.scatter(x, y, marker=marker, facecolors=color if pss == "forward" else "none", edgecolors=color,
                       label=f"{kind}, {pss.replace('_', '+')} (95% interval)")
    lim = max([1.0] + [r["token_ratio"] for r in best.values()] + [r["speedup_vs_batched"] for r in best.values()])
    ax.plot([0, lim * 1.1], [0, lim * 1.1], "k--", lw=1, label="speedup = R")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set(xlim=(0.9, lim * 1.1), ylim=(0, lim * 1.1), xlabel="token ratio R (independent / packed tokens)",
           ylabel="speedup vs batched independent calls")
    ax.legend(fontsize=8)
    save_figure(fig, path, "fastest exact packed path per configuration", dpi=120, width=60)
