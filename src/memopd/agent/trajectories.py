"""Teacher trajectories for SFT: the library side of `memopd sft trajectories`.

The configured teacher (`teacher.kind`: scripted | llm) plays the benchmark tasks through the student's
rollout loop (config sections `agent` and `rollout`, as the student will see them), and the episodes are
written as ordinary records (records.save_episodes) in the student's token ids, with reward = task F1
or EM (`teacher.reward`) and the per-episode metrics of the rollout. A stats JSON sums them up,
including a preview of what a score filter would keep (the filter itself is the SFT data step's).
"""
from __future__ import annotations

import re
import time
from collections import Counter
from pathlib import Path

from memopd.agent.protocol import INFO, INFO_END, THINK, THINK_END
from memopd.agent.rollout import AgentConfig, rollout
from memopd.agent.teacher import ScriptedConfig, ScriptedTeacher, memory_claims
from memopd.records import Episode, save_episodes

FILTER_PREVIEW = (("f1>=0.5", lambda e: e.metrics["f1"] >= 0.5), ("f1==1", lambda e: e.metrics["f1"] == 1.0))


def unsupported_claims(episode: Episode, tokenizer) -> list[tuple[int, int, str]]:
    """(call, question, claim) for every `Qi: X` of a memory block whose X appears (ignoring case) in no
    passage shown to the agent up to that call. Empty for an honest teacher."""
    seen, bad = "", []
    for t, inv in enumerate(episode.invocations):
        text = tokenizer.decode(inv.input_ids[episode.prefix_len:], skip_special_tokens=False)
        passages = " ".join(re.findall(re.escape(INFO) + r"(.*?)" + re.escape(INFO_END), text, re.S))
        seen += " " + " ".join(passages.lower().split())  # whitespace collapsed, as the teacher writes spans
        out = tokenizer.decode(inv.output_ids, skip_special_tokens=False)
        for think in re.findall(re.escape(THINK) + r"(.*?)" + re.escape(THINK_END), out, re.S):
            bad += [(t, q, x) for q, x in memory_claims(think) if " ".join(x.lower().split()) not in seen]
    return bad


def summarize(episodes: list[Episode], tokenizer=None) -> dict:
    """Aggregate figures of a trajectory set (means over episodes; rates over calls)."""
    n = len(episodes)
    calls = sum(len(e.invocations) for e in episodes)

    def mean(key):
        return sum(float(e.metrics[key]) for e in episodes) / n if n else 0.0

    out = {
        "trajectories_generated": n, "em": mean("em"), "f1": mean("f1"), "calls_per_episode": calls / n if n else 0.0,
        "invalid_action_rate": sum(e.metrics["invalid_actions"] for e in episodes) / calls if calls else 0.0,
        "answered_rate": mean("answered"), "turn_examples": calls, "searches_per_episode": mean("searches"),
        "end_reasons": dict(Counter(e.metrics["end_reason"] for e in episodes)),
        "response_tokens_mean": sum(len(i.output_ids) for e in episodes for i in e.invocations) / calls if calls else 0,
        "response_tokens_max": max((len(i.output_ids) for e in episodes for i in e.invocations), default=0),
        "peak_context_tokens_mean": mean("peak_context_tokens"),
        "filter_preview": {name: {"trajectories": sum(map(keep, episodes)),
                                  "turn_examples": sum(len(e.invocations) for e in episodes if keep(e))}
                           for name, keep in FILTER_PREVIEW},
    }
    if tokenizer is not None:  # memory claims not backed by a passage the agent saw (scripted format)
        out["unsupported_memory_claims"] = sum(len(unsupported_claims(e, tokenizer)) for e in episodes)
    return out


def _load(benchmarks: list[str], limit: int | None):
    from memopd.agent.evaluate import load_tasks

    tasks = []
    for path in benchmarks:
        if not Path(path).exists():
            raise FileNotFoundError(f"benchmark file {path} not found (build it with `snakemake -c 2 benchmarks`)")
        tasks += load_tasks(path, limit=limit)
    return tasks


def trajectories_step(cfg: dict, benchmarks: list[str], index: str, tokenizer_dir: str, out: str, stats_out: str,
                      seed: int = 0, limit: int | None = None, progress: bool = True,
                      server_log: str | None = None) -> dict:
    """Generate, write the episodes (parquet) and the stats (JSON); return the stats.

    `cfg`: {"teacher": ..., "agent": ..., "rollout": ...} (config sections); `teacher.seed`, when set,
    overrides `seed`; `limit` overrides `teacher.max_tasks` (tasks per benchmark)."""
    from memopd.agent.evaluate import load_retriever
    from memopd.models import load_tokenizer

    tc = cfg["teacher"]
    seed = seed if tc.get("seed") is None else int(tc["seed"])
    limit = limit or tc.get("max_tasks")
    tok = load_tokenizer(tokenizer_dir)
    tasks = _load(benchmarks, limit)
    agent = AgentConfig.from_dict(cfg["agent"], batch_size=tc.get("batch_size") or cfg["rollout"]["batch_size"],
                                  reward=tc.get("reward", "f1"))
    retriever = load_retriever(index)
    t0 = time.perf_counter()
    rstats: dict = {}
    kind = tc["kind"]
    extra: dict = {}
    if kind == "scripted":
        sc = dict(tc.get("scripted") or {})
        if sc.get("max_new_tokens") is None:  # the student's generation budget: it must be able to say it
            sc["max_new_tokens"] = cfg["rollout"]["max_new_tokens"]
        teacher = ScriptedTeacher(tok, tasks, ScriptedConfig(**sc))
        episodes = rollout(tasks, teacher, tok, retriever, agent, seed=seed, progress=progress, stats=rstats)
        extra["budget_fits"] = teacher.fits
    elif kind == "llm":
        episodes, extra = _llm_rollout(tc["llm"], tok, tasks, retriever, agent, seed, progress, rstats,
                                       server_log or str(Path(stats_out).with_name("vllm_server.log")))
    else:
        raise ValueError(f"teacher.kind must be 'scripted' or 'llm', not {kind!r}")
    wall = time.perf_counter() - t0
    save_episodes(out, episodes)
    stats = {"teacher": kind, "model": tc["llm"]["model"] if kind == "llm" else "scripted",
             **summarize(episodes, tok if kind == "scripted" else None), **extra,
             "benchmarks": {b: summarize([e for e in episodes if e.metrics["benchmark"] == b])
                            for b in sorted({e.metrics["benchmark"] for e in episodes})},
             "wall_s": wall, "episodes_per_s": len(episodes) / wall if wall else 0.0, "rollout": rstats,
             "inputs": {"benchmarks": list(benchmarks), "index": str(index), "tokenizer": str(tokenizer_dir)},
             "outputs": {"trajectories": str(out)}, "config": {**cfg, "seed": seed, "limit": limit}}
    _write_json(stats_out, stats)
    return stats


def _llm_rollout(llm_cfg: dict, tok, tasks, retriever, agent, seed, progress, rstats, server_log):
    from memopd.agent.llm_teacher import LLMConfig, LLMTeacher, VLLMServer, server_kwargs

    lc = LLMConfig(**llm_cfg)
    srv = dict(lc.server)
    client = {k: srv[k] for k in ("max_concurrency", "request_timeout_s") if srv.get(k) is not None}
    if lc.engine == "offline" or lc.url:
        teacher = LLMTeacher(tok, lc, **client)
        eps = rollout(tasks, teacher, tok, retriever, agent, seed=seed, progress=progress, stats=rstats)
        return eps, {"server": lc.url or "offline"}
    with VLLMServer(lc.model, server_log, seed=seed, **server_kwargs(srv)) as server:
        teacher = LLMTeacher(tok, lc, url=server.url, **client)
        eps = rollout(tasks, teacher, tok, retriever, agent, seed=seed, progress=progress, stats=rstats)
    return eps, {"server": {"cmd": server.cmd, "log": server_log}}


def _write_json(path: str | Path, obj) -> None:
    from memopd.report.tables import write_json

    write_json(path, obj)
