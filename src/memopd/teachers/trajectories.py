"""Teacher trajectories for SFT: the library side of `memopd sft trajectories`.

The configured teacher (`teacher.kind`: scripted | llm) plays the benchmark tasks through the student's
rollout loop (config sections `agent` and `rollout`, as the student will see them), and the episodes are
written as ordinary records (records.save_episodes) in the student's token ids, with reward = task F1
or EM (`teacher.reward`) and the per-episode metrics of the rollout. A stats JSON sums them up,
including a preview of what a score filter would keep (the filter itself is the SFT data step's).
At scale the tasks are played in `teacher.shards` jobs (`trajectories_step(shard=i)`, resumable chunks)
and `merge_step` joins them into the one file and stats of a single run (teachers/shards.py says what is equal).
"""
from __future__ import annotations

import json
import re
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

from memopd.agent.protocol import INFO, INFO_END, THINK, THINK_END
from memopd.agent.rollout import rollout
from memopd.harness import digest, run_identity
from memopd.teachers.shards import (Chunks, chunk_bounds, code_digest, concat_episode_files, episode_rows, shard_bounds)
from memopd.teachers.scripted import ScriptedConfig, ScriptedTeacher, memory_claims
from memopd.config import AgentConfig, RolloutConfig, TeacherConfig, rollout_config, teacher_config
from memopd.records import Episode, save_episodes

def _metrics(x) -> dict:
    return x.metrics if isinstance(x, Episode) else x


# score filters previewed in the stats: predicates of an episode (or of its metrics)
FILTER_PREVIEW = (("f1>=0.5", lambda e: _metrics(e)["f1"] >= 0.5), ("f1==1", lambda e: _metrics(e)["f1"] == 1.0))


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
    out = summary_of_rows([(e.metrics, [len(i.output_ids) for i in e.invocations]) for e in episodes])
    if tokenizer is not None:  # memory claims not backed by a passage the agent saw (scripted format)
        out["unsupported_memory_claims"] = sum(len(unsupported_claims(e, tokenizer)) for e in episodes)
    return out


def summary_of_rows(rows: list[tuple[dict, list[int]]]) -> dict:
    """`summarize` from (episode metrics, response lengths of its calls) per episode: what a file of
    episodes gives without its token ids (shards.episode_rows), the same figures to the last bit."""
    n = len(rows)
    calls = sum(len(lens) for _, lens in rows)

    def mean(key):
        return sum(float(m[key]) for m, _ in rows) / n if n else 0.0

    return {
        "trajectories_generated": n, "em": mean("em"), "f1": mean("f1"), "calls_per_episode": calls / n if n else 0.0,
        "invalid_action_rate": sum(m["invalid_actions"] for m, _ in rows) / calls if calls else 0.0,
        "answered_rate": mean("answered"), "turn_examples": calls, "searches_per_episode": mean("searches"),
        "end_reasons": dict(Counter(m["end_reason"] for m, _ in rows)),
        "response_tokens_mean": sum(x for _, lens in rows for x in lens) / calls if calls else 0,
        "response_tokens_max": max((x for _, lens in rows for x in lens), default=0),
        "peak_context_tokens_mean": mean("peak_context_tokens"),
        "filter_preview": {name: {"trajectories": sum(keep(m) for m, _ in rows),
                                  "turn_examples": sum(len(lens) for m, lens in rows if keep(m))}
                           for name, keep in FILTER_PREVIEW},
    }


def by_benchmark(rows: list[tuple[dict, list[int]]]) -> dict:
    return {b: summary_of_rows([r for r in rows if r[0]["benchmark"] == b])
            for b in sorted({m["benchmark"] for m, _ in rows})}


def _load(benchmarks: list[str], limit: int | None):
    from memopd.agent.protocol import load_tasks

    tasks = []
    for path in benchmarks:
        if not Path(path).exists():
            raise FileNotFoundError(f"benchmark file {path} not found (build it with `snakemake -c 2 benchmarks`)")
        tasks += load_tasks(path, limit=limit)
    return tasks


def trajectories_step(cfg: dict, benchmarks: list[str], index: str, tokenizer_dir: str, out: str, stats_out: str,
                      seed: int = 0, limit: int | None = None, progress: bool = True,
                      server_log: str | None = None, shard: int | None = None) -> dict:
    """Generate, write the episodes (parquet) and the stats (JSON); return the stats.

    `cfg`: {"teacher": ..., "agent": ..., "rollout": ...} (config sections); `teacher.seed`, when set,
    overrides `seed`; `limit` overrides `teacher.max_tasks` (tasks per benchmark). `shard` (0 ..
    teacher.shards - 1) plays only that slice of the tasks, every episode sampled as in the whole run;
    None plays them all. Tasks go `teacher.chunk_tasks` at a time, each chunk kept in `<out>.parts/` until
    `out` is written, so a rerun of an interrupted step plays only the chunks it lacks (teachers/shards.py)."""
    from memopd.models import load_tokenizer
    from memopd.retrieval import load_retriever

    tc, ro = teacher_config(cfg), rollout_config(cfg)
    kind = tc.kind
    seed = seed if tc.seed is None else int(tc.seed)
    limit = limit or tc.max_tasks
    tok = load_tokenizer(tokenizer_dir)
    tasks = _load(benchmarks, limit)
    shards = tc.shards
    lo, hi = (0, len(tasks)) if shard is None else shard_bounds(len(tasks), shards, shard)
    bounds = chunk_bounds(lo, hi, tc.chunk_tasks)
    agent = AgentConfig.from_dict(cfg["agent"], batch_size=tc.batch_size or ro.batch_size,
                                  reward=tc.reward)
    key = digest(run_identity(cfg, seed, {"index": index, "tokenizer": tokenizer_dir}, limit=limit, chunks=bounds,
                              code=code_digest(), tasks=[(t.task_id, t.questions, t.answers, t.benchmark)
                                                         for t in tasks[lo:hi]]))
    parts = Chunks(Path(out).with_suffix(".parts"), key)
    infos = [parts.done(j) for j in range(len(bounds))]
    todo = [j for j, info in enumerate(infos) if info is None]
    fresh: dict[int, list[Episode]] = {}
    retriever = load_retriever(index) if todo else None
    t0 = time.perf_counter()
    log = server_log or str(Path(stats_out).with_name("vllm_server.log"))
    with _teacher(kind, tc, ro, tok, tasks, seed, log, start=bool(todo)) as (teacher, extra):
        startup = time.perf_counter() - t0
        for j in todo:
            a, b = bounds[j]
            fits = dict(getattr(teacher, "fits", {}))
            rstats: dict = {}
            t = time.perf_counter()
            fresh[j] = rollout(tasks[a:b], teacher, tok, retriever, agent, seed=seed, progress=progress, stats=rstats,
                               indices=list(range(a, b)))  # sampled as in the whole run (seeds by task position)
            chunk_extra = dict(extra)
            if fits:  # the scripted teacher: how this chunk's responses met the budget
                chunk_extra["budget_fits"] = {k: v - fits[k] for k, v in teacher.fits.items()}
            infos[j] = {"tasks": [a, b], "wall_s": time.perf_counter() - t, "rollout": rstats, "extra": chunk_extra}
            parts.write(j, fresh[j], infos[j])
    episodes = [e for j in range(len(bounds)) for e in (fresh[j] if j in fresh else parts.load(j))]
    save_episodes(out, episodes)
    wall = sum(i["wall_s"] for i in infos)
    stats = {"teacher": kind, "model": tc.llm["model"] if kind == "llm" else "scripted",
             **summarize(episodes, tok if kind == "scripted" else None), **combine([i["extra"] for i in infos]),
             "benchmarks": by_benchmark([(e.metrics, [len(i.output_ids) for i in e.invocations]) for e in episodes]),
             "wall_s": wall, "episodes_per_s": len(episodes) / wall if wall else 0.0,
             "rollout": combine([i["rollout"] for i in infos]),
             "inputs": {"benchmarks": list(benchmarks), "index": str(index), "tokenizer": str(tokenizer_dir)},
             "outputs": {"trajectories": str(out)}, "config": {**cfg, "seed": seed, "limit": limit},
             "shard": {"index": shard or 0, "of": 1 if shard is None else shards, "tasks": [lo, hi],
                       "chunks": len(bounds), "chunks_resumed": len(bounds) - len(todo), "startup_s": startup}}
    _write_json(stats_out, stats)
    parts.remove()
    return stats


def merge_step(shard_files: list[str], shard_stats: list[str], out: str, stats_out: str) -> dict:
    """The shards' files, in shard order -> `out` (the episodes of the whole run, in task order) and its
    stats: every figure of `summarize` recomputed over all episodes (equal to a single-process run's),
    counts summed, the shards listed. Reads metrics and response lengths only, one shard at a time."""
    if not shard_files or len(shard_files) != len(shard_stats):
        raise ValueError(f"{len(shard_files)} shard files, {len(shard_stats)} stats files: one of each per shard")
    parts = [json.loads(Path(p).read_text()) for p in shard_stats]
    n = len(parts)
    for i, s in enumerate(parts):
        sh = s["shard"]
        if sh["index"] != i or sh["of"] != n:
            raise ValueError(f"{shard_stats[i]}: shard {sh.get('index')} of {sh.get('of')}, expected {i} of {n}")
        if i and (s["config"] != parts[0]["config"] or sh["tasks"][0] != parts[i - 1]["shard"]["tasks"][1]):
            raise ValueError(f"{shard_stats[i]}: not the next slice of the same run as {shard_stats[i - 1]}")
    concat_episode_files(shard_files, out)
    rows = [r for f in shard_files for r in episode_rows(f)]
    first = parts[0]
    stats = {"teacher": first["teacher"], "model": first["model"], **summary_of_rows(rows)}
    if all("unsupported_memory_claims" in s for s in parts):
        stats["unsupported_memory_claims"] = sum(s["unsupported_memory_claims"] for s in parts)
    stats.update(combine([{k: s[k] for k in EXTRAS if k in s} for s in parts]))
    wall = sum(s["wall_s"] for s in parts)
    stats.update(benchmarks=by_benchmark(rows), wall_s=wall, episodes_per_s=len(rows) / wall if wall else 0.0,
                 rollout=combine([s["rollout"] for s in parts]), inputs={**first["inputs"], "shards": list(shard_files)},
                 outputs={"trajectories": str(out)}, config=first["config"],
                 shards=[{"stats": str(p), **s["shard"], "trajectories_generated": s["trajectories_generated"],
                          "wall_s": s["wall_s"]} for p, s in zip(shard_stats, parts)])
    _write_json(stats_out, stats)
    return stats


EXTRAS = ("budget_fits", "server")  # teacher-specific stats keys (scripted, llm)


def combine(dicts: list[dict]) -> dict:
    """Figures of several chunks or shards as one: numbers summed (also inside dicts of numbers), a value
    all share kept, else the list of distinct values."""
    out: dict = {}
    for k in dict.fromkeys(k for d in dicts for k in d):
        vals = [d[k] for d in dicts if k in d]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[k] = sum(vals)
        elif all(isinstance(v, dict) for v in vals) and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for v in vals for x in v.values()):
            out[k] = combine(vals)
        elif all(v == vals[0] for v in vals):
            out[k] = vals[0]
        else:
            out[k] = [v for i, v in enumerate(vals) if v not in vals[:i]]
    return out


@contextmanager
def _teacher(kind: str, tc: TeacherConfig, ro: RolloutConfig, tok, tasks, seed: int, server_log: str,
             start: bool = True):
    """(backend, stats of the teacher) for the step's chunks; the LLM teacher's server runs meanwhile.
    Nothing starts when every chunk is already written (`start` false)."""
    if not start:
        yield None, {}
    elif kind == "scripted":
        sc = dict(tc.scripted)
        if sc.get("max_new_tokens") is None:  # the student's generation budget: it must be able to say it
            sc["max_new_tokens"] = ro.max_new_tokens
        yield ScriptedTeacher(tok, tasks, ScriptedConfig(**sc)), {}  # all tasks: a shard finds its own as in one run
    else:
        from memopd.teachers.llm import LLMConfig, LLMTeacher, VLLMServer, server_kwargs

        lc = LLMConfig(**tc.llm)
        srv = dict(lc.server)
        client = {k: srv[k] for k in ("max_concurrency", "request_timeout_s") if srv.get(k) is not None}
        if lc.engine == "offline" or lc.url:
            yield LLMTeacher(tok, lc, **client), {"server": lc.url or "offline"}
        else:
            with VLLMServer(lc.model, server_log, seed=seed, **server_kwargs(srv)) as server:
                yield LLMTeacher(tok, lc, url=server.url, **client), {"server": {"cmd": server.cmd, "log": server_log}}


def _write_json(path: str | Path, obj) -> None:
    from memopd.outputs import write_json

    write_json(path, obj)
