"""Evaluation and the rollout RCE audit: the library side of `memopd eval` and `memopd rce-rollouts`.

Aggregates (results/eval/{model}/{benchmark}.json): em and f1 are fractions, averaged per question
inside a task and then over tasks; peak_context_tokens, dependency and calls_per_episode are means over
episodes; inference_time_s is the measured wall clock of the whole evaluation divided by the number of
episodes (episodes run batched, so this is throughput-based time per task; the total is
inference_time_total_s); invalid_action_rate = invalid actions / calls; copy_f1 / copy_exact: the copy
probe (memopd.metrics.copy_probe: question 1 reproduced in the first search query), means over episodes.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from memopd.agent.protocol import Task, load_tasks
from memopd.agent.rollout import rollout
from memopd.config import RULES, AgentConfig, EvalConfig, RCERolloutsConfig, RolloutConfig, rollout_config
from memopd.generation.backends import make_backend, make_sampling
from memopd.outputs import write_csv, write_json
from memopd.records import Episode, save_episodes
from memopd.retrieval import load_retriever

def load_agent(ro: RolloutConfig, model_dir: str | Path, index: str | Path, seed: int, **sampling):
    """(backend, tokenizer, model, retriever) of an agent step; the index opens first, so that a missing one
    is refused before the model loads."""
    retriever = load_retriever(index)
    torch.manual_seed(seed)
    backend, tok, model = make_backend(ro, model_dir, seed=seed, **sampling)
    return backend, tok, model, retriever


def aggregate(episodes: list[Episode], wall_s: float) -> dict:
    n = len(episodes)
    calls = sum(len(e.invocations) for e in episodes)

    def mean(key):
        return sum(e.metrics[key] for e in episodes) / n if n else 0.0

    return {
        "episodes": n, "em": mean("em"), "f1": mean("f1"), "peak_context_tokens": mean("peak_context_tokens"),
        "inference_time_s": wall_s / n if n else 0.0, "dependency": mean("dependency"),
        "calls_per_episode": calls / n if n else 0.0,
        "invalid_action_rate": sum(e.metrics["invalid_actions"] for e in episodes) / calls if calls else 0.0,
        "inference_time_total_s": wall_s, "answered_rate": mean("answered"),
        "copy_f1": mean("copy_f1"), "copy_exact": mean("copy_exact"),
        "peak_context_tokens_max": max((e.metrics["peak_context_tokens"] for e in episodes), default=0),
    }


ROW_KEYS = ("em", "f1", "answered", "end_reason", "calls", "searches", "invalid_actions", "peak_context_tokens",
            "dependency", "generated_tokens", "retained_spans", "copy_f1", "copy_exact")


def episode_rows(episodes: list[Episode]) -> list[dict]:
    return [{"task_id": e.task_id, "reward": e.reward, **{k: e.metrics[k] for k in ROW_KEYS},
             "predictions": " ; ".join(e.metrics["predictions"]),
             "gold": " ; ".join("|".join(a) for a in e.metrics["gold"]),
             "actions": " ".join(e.metrics["actions"])} for e in episodes]


def evaluate(tasks: list[Task], backend, tokenizer, retriever, agent: AgentConfig, seed: int = 0,
             progress: bool = True, label: str = "eval") -> tuple[dict, list[Episode]]:
    stats: dict = {}
    t0 = time.perf_counter()
    episodes = rollout(tasks, backend, tokenizer, retriever, agent, seed=seed, progress=progress, stats=stats,
                       label=label)
    wall = time.perf_counter() - t0
    out = aggregate(episodes, wall)
    out["throughput"] = {"episodes_per_s": len(episodes) / wall if wall else 0.0,
                         "generated_tokens_per_s": stats["generated_tokens"] / wall if wall else 0.0, **stats}
    return out, episodes


def behaviour_mismatch(model, episodes: list[Episode]) -> dict:
    """|behaviour log-prob - independent recomputation| over the sampled tokens that carry one (each call run
    alone; the LM head a chunk of tokens at a time, never all N x V logits: rce.independent_token_logprobs)."""
    from memopd.rce import independent_token_logprobs

    eps = [e for e in episodes if all(i.logprobs is not None for i in e.invocations)]
    if not eps:
        return {"tokens": 0}
    with torch.no_grad():
        ref = independent_token_logprobs(model, eps,
                                         torch.tensor([t for e in eps for i in e.invocations for t in i.output_ids]))
    beh = torch.tensor([lp for e in eps for i in e.invocations for lp in i.logprobs], dtype=ref.dtype)
    d = (ref.cpu() - beh).abs()
    return {"tokens": int(d.numel()), "max_abs_dlogp": d.max().item(), "mean_abs_dlogp": d.mean().item(),
            "p99_abs_dlogp": torch.quantile(d.double(), 0.99).item()}


def rce_rollouts(model, backend, tokenizer, tasks: list[Task], retriever, agent: AgentConfig, rules=RULES,
                 backends=("sdpa", "eager", "flex", "prefix_shared", "calls", "segmented", "auto"), dtype: str = "float32",
                 tolerance: float | None = None, seed: int = 0, progress: bool = True) -> dict:
    """Roll out `tasks` under every rule, compile, and check RCE; plus the behaviour log-prob mismatch."""
    from dataclasses import replace

    from memopd.rce import rce_report

    report = {"dtype": dtype, "rules": {}}
    for rule in rules:
        cfg = replace(agent, rule=rule)
        eps = rollout(tasks, backend, tokenizer, retriever, cfg, seed=seed, progress=progress, label=f"rce-rollouts {rule}")
        r = rce_report(model, eps, list(backends), dtype=dtype, tolerance=tolerance)
        r["calls"] = sum(len(e.invocations) for e in eps)
        r["retained_tokens"] = sum(s.length for e in eps for i in e.invocations for s in i.retained)
        r["behaviour_vs_recomputed"] = behaviour_mismatch(model, eps)
        report["rules"][rule] = r
    report["tolerance"] = next(iter(report["rules"].values()))["tolerance"] if report["rules"] else tolerance
    report["passed"] = all(r["passed"] for r in report["rules"].values())
    return report


def evaluate_benchmarks(cfg: dict, agent: AgentConfig, model_dir: str, benchmarks: list[str], index: str,
                        out_dir: str | Path, seed: int = 0, limit: int | None = None, tracking: str | None = None):
    """Every benchmark of one model in one process: the model, tokenizer and index load once (on the embedded
    default, loading and imports take ~10 s of a ~12 s job per benchmark). Writes {benchmark}.json, .csv
    and .episodes.parquet under `out_dir`, each benchmark tracked as a child of the run that trained the model."""
    from memopd.tracking import eval_metrics, run_ref, tracked

    ev, ro = EvalConfig.from_dict(cfg.get("eval")), rollout_config(cfg)
    stems = [Path(b).stem for b in benchmarks]
    backend, tok, _, retriever = load_agent(ro, model_dir, index, seed, **ev.at(stems[0]).sampling())
    for path, bench in zip(benchmarks, stems):
        torch.manual_seed(seed)  # as if each benchmark ran alone
        backend.sampling = make_sampling(ro, **ev.at(bench).sampling())
        tasks = load_tasks(path, limit=limit or ev.at(bench).max_tasks)
        # a child of the run that trained the model (its id in the model directory), tagged with its method and seed
        with tracked(tracking, f"eval-{Path(model_dir).name}-{bench}", cfg, stage="eval", model=Path(model_dir).name,
                     seed=seed, tags={"benchmark": bench, "eval_seed": seed}, parent=run_ref(model_dir)) as run:
            run.log_input(path, "eval")
            out, episodes = evaluate(tasks, backend, tok, retriever, agent, seed=seed, label=f"eval {bench}")
            run.log_metrics(eval_metrics(out), 0)  # eval/f1, eval/em, eval/invalid_rate, ... in every eval run
        out.update(model=model_dir, benchmark=path, backend=backend.name, config={**cfg, "seed": seed},
                   # the protocol used (eval overrides or the training rollout's): tables state the budget
                   max_new_tokens=backend.sampling.max_new_tokens, temperature=backend.sampling.temperature)
        out_path = Path(out_dir) / f"{bench}.json"
        write_json(out_path, out)
        write_csv(out_path.with_suffix(".csv"), episode_rows(episodes))
        save_episodes(out_path.with_suffix(".episodes.parquet"), episodes)
        print(f"{bench}: {len(episodes)} episodes: EM {out['em']:.3f} F1 {out['f1']:.3f} "
              f"calls/ep {out['calls_per_episode']:.2f} invalid {out['invalid_action_rate']:.3f} "
              f"peak {out['peak_context_tokens']:.0f} {out['throughput']['episodes_per_s']:.2f} ep/s "
              f"{out['throughput']['generated_tokens_per_s']:.0f} tok/s")


def rce_rollouts_step(cfg: dict, rc: RCERolloutsConfig, agent: AgentConfig, model_dir: str, benchmark: str,
                      index: str, seed: int = 0, limit: int | None = None) -> dict:
    """The RCE of real rollouts under every memory-rewrite rule (`cfg`: the agent, rollout and rce_rollouts sections
    as written, recorded with the report; `rc` its rce_rollouts section)."""
    from dataclasses import replace

    from memopd.models import default_device, load_model
    from memopd.rce import tolerance_fields, tolerances

    rollout_cfg = cfg["rollout"]
    if rc.gpu_memory_utilization is not None:  # the engine stays up while the model scores beside it
        rollout_cfg = {**rollout_cfg, "vllm": {**rollout_cfg.get("vllm", {}),
                                               "gpu_memory_utilization": rc.gpu_memory_utilization}}
    backend, tok, model, retriever = load_agent(rollout_config({"rollout": rollout_cfg}), model_dir, index, seed,
                                                max_new_tokens=rc.max_new_tokens)
    tasks = load_tasks(benchmark, limit=limit or rc.tasks)
    if model is None or str(model.dtype).split(".")[-1] != rc.dtype:
        # the packed and independent passes run under transformers in the audit's dtype
        model = load_model(model_dir, dtype=rc.dtype, device=default_device())
    agent = replace(agent, invalid_action=rc.invalid_action or agent.invalid_action)
    report = rce_rollouts(model, backend, tok, tasks, retriever, agent, rules=rc.rules, backends=list(rc.backends),
                          dtype=rc.dtype, tolerance=rc.tolerance, seed=seed)
    report["config"] = {**cfg, "rollout": rollout_cfg, "seed": seed, "model": model_dir, "benchmark": benchmark}
    report.update(tolerance_fields(tolerances(rc.dtype, rc.tolerance)))  # what every rule was gated on
    return report
