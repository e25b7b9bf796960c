"""Benchmark composition: Q_n multi-question tasks and Wiki-RAG single-question tasks.

Pipeline: `plan()` checks the whole `benchmarks` config (sources, files, n vs pool sizes) and loads the
question pools, so every config error surfaces before anything is written; `compose()` builds the
tasks; `write()` writes all parquet files and the stats table atomically (all or nothing).

Splits. Every question of a source is assigned to exactly one pool, train, dev or test, once, for all
benchmarks: a source entry with `pool: train` / `pool: dev` / `pool: test` goes there whole (an upstream
split; dev: tasks for choices, kept apart from the test tasks a result is reported on); an entry with
`pool: split` (default) is split into train and test by a seeded hash of the question id, so the assignment of a
question never depends on file order or on which other questions are present. Questions are also
de-duplicated by normalised text within a source. Hence no test question (Q2, Q8, Q16 or Wiki-RAG) is
ever in a training task, and Wiki-RAG test questions are unseen by a model trained on Q2.

Tasks. A task of horizon n is n distinct questions asked together; the task text is the questions joined
by '; ' (MEM1's format, each ending in '?') and the gold answer the canonical answers joined by '; '.
Questions are drawn as consecutive chunks of a seeded shuffle of the pool, reshuffled when a pool is used
up (a remainder shorter than the chunk is dropped, as in MEM1), so a benchmark uses every pool question
once before any repeats, and no task repeats a question.
"""
from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from memopd.atomic import atomic_path
from memopd.config import COMPOSE_MODES, SPLITS, BenchmarksConfig, QASourceConfig
from memopd.data.loaders import QA, QA_PARSERS, DataConfigError, load_qa, resolve

TASK_COLUMNS = ("task_id", "benchmark", "split", "n", "source", "question", "answer",
                "questions", "answers", "qids", "sources", "evidence_titles")


@dataclass(frozen=True)
class TaskSet:
    """One benchmark file: e.g. benchmark 'q8', split 'test', horizon 8, 50 tasks."""

    benchmark: str
    split: str
    n: int
    tasks: int
    sources: tuple[str, ...]
    mode: str

    @property
    def name(self) -> str:
        return f"{self.benchmark}_{self.split}"


def task_sets(bench: BenchmarksConfig) -> list[TaskSet]:
    """The benchmark files a config asks for (also used by Snakemake to name the outputs)."""
    out = [TaskSet(f"q{s.n}", s.split, s.n, s.tasks, bench.qn.sources, bench.compose) for s in bench.qn.sets]
    if wr := bench.wiki_rag:
        # single-question tasks: "mode" only decides the order of sources over tasks
        out += [TaskSet("wikirag", split, 1, int(getattr(wr, split)), wr.sources, "same_source")
                for split in ("train", "test") if getattr(wr, split)]
    return out


# --------------------------------------------------------------------------------------------- checks

def check_config(bench: BenchmarksConfig, data_dir: str | Path) -> list[TaskSet]:
    """Static checks (no data read yet): known sources, formats, modes, splits, n, files exist."""
    errors = []
    sources = bench.sources
    if not sources:
        errors.append("benchmarks.sources: no question source configured")
    if bench.compose not in COMPOSE_MODES:
        errors.append(f"benchmarks.compose: {bench.compose!r} is not one of {COMPOSE_MODES}")
    tf = bench.test_fraction
    if not (isinstance(tf, (int, float)) and 0 < tf < 1):
        errors.append(f"benchmarks.test_fraction: {tf!r} must be in (0, 1)")
    for name, entries in sources.items():
        for i, e in enumerate(entries):
            key = f"benchmarks.sources.{name}[{i}]"
            if e.format not in QA_PARSERS:
                errors.append(f"{key}.format: unknown format {e.format!r} (known: {', '.join(QA_PARSERS)})")
            if e.pool not in ("split", *SPLITS):
                errors.append(f"{key}.pool: {e.pool!r} is not split, train, dev or test")
            if e.path is not None:
                try:
                    resolve(e.path, data_dir, f"{key}.path")
                except DataConfigError as err:
                    errors.append(err)
            elif e.name is None:
                errors.append(f"{key}: needs a path (local file) or a name (hub data set)")
    sets = task_sets(bench)
    seen = Counter(ts.name for ts in sets)
    errors += [f"benchmarks.qn.sets: {name} configured {c} times" for name, c in seen.items() if c > 1]
    for ts in sets:
        where = "benchmarks.wiki_rag" if ts.benchmark == "wikirag" else f"benchmarks.qn ({ts.name})"
        if ts.split not in SPLITS:
            errors.append(f"{where}: split {ts.split!r} is not train, dev or test")
        if ts.n < 1 or ts.tasks < 1:
            errors.append(f"{where}: n and tasks must be positive (n={ts.n}, tasks={ts.tasks})")
        if not ts.sources:
            errors.append(f"{where}: no sources")
        for s in ts.sources:
            if s not in sources:
                errors.append(f"{where}: unknown source {s!r} (configured: {', '.join(sources) or 'none'})")
    if len(errors) == 1 and isinstance(errors[0], DataConfigError):
        raise errors[0]  # keep its type (MissingDataError is also a FileNotFoundError)
    if errors:
        raise DataConfigError("invalid benchmarks config:\n  " + "\n  ".join(map(str, errors)))
    return sets


def _per_task_need(ts: TaskSet) -> dict[str, int]:
    """Questions one task draws from each source (same_source: all n from one source)."""
    if ts.mode == "same_source":
        return {s: ts.n for s in ts.sources}
    k = len(ts.sources)
    return {s: ts.n // k + (1 if i < ts.n % k else 0) for i, s in enumerate(ts.sources)}


def check_sizes(sets: list[TaskSet], pools: dict[str, dict[str, list[QA]]]) -> None:
    """An n larger than a pool is a config error (a task could not hold n distinct questions)."""
    errors = []
    for ts in sets:
        for s, need in _per_task_need(ts).items():
            have = len(pools[s][ts.split])
            if need > have:
                errors.append(f"{ts.name}: a task needs {need} distinct {s} questions but the {ts.split} "
                              f"pool of {s} has {have}")
    if errors:
        raise DataConfigError("benchmarks do not fit their question pools:\n  " + "\n  ".join(errors))


# ---------------------------------------------------------------------------------------------- pools

def _norm_q(q: str) -> str:
    return " ".join(q.lower().split()).rstrip("?").strip()


def _in_test(qid: str, seed: int, fraction: float) -> bool:
    """Seeded, order-independent assignment of one question to the test pool."""
    h = hashlib.sha256(f"{seed}|{qid}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


def load_source(name: str, entries: tuple[QASourceConfig, ...], data_dir: str | Path) -> list[tuple[QA, str]]:
    """(question, pool) for every record of one source, in config order."""
    out = []
    for i, e in enumerate(entries):
        key = f"benchmarks.sources.{name}[{i}]"
        if e.path is not None:
            qas = load_qa(resolve(e.path, data_dir, f"{key}.path"), e.format, f"{key}.path")
        else:
            from memopd.data.hub import load_qa_hub

            qas = load_qa_hub(e.name, e.config, e.split, e.format, f"{key}.name", e.revision)
        out += [(qa, e.pool) for qa in qas]
    return out


def load_pools(bench: BenchmarksConfig, data_dir: str | Path, seed: int) -> tuple[dict[str, dict[str, list[QA]]], dict]:
    """{source: {"train": [...], "dev": [...], "test": [...]}} (sorted by id) and counts of duplicates dropped."""
    pools, dropped = {}, {}
    for name, entries in bench.sources.items():
        seen_text, seen_id, pool = set(), set(), {s: [] for s in SPLITS}
        for qa, where in load_source(name, entries, data_dir):
            key = _norm_q(qa.question)
            if key in seen_text or qa.qid in seen_id:  # first occurrence wins (config order)
                dropped[name] = dropped.get(name, 0) + 1
                continue
            seen_text.add(key)
            seen_id.add(qa.qid)
            if where == "split":
                where = "test" if _in_test(qa.qid, seed, bench.test_fraction) else "train"
            pool[where].append(qa)
        pools[name] = {s: sorted(v, key=lambda q: q.qid) for s, v in pool.items()}
    return pools, dropped


# ------------------------------------------------------------------------------------------------ tasks

class _Stream:
    """Consecutive chunks of a seeded shuffle of one pool; reshuffled when used up."""

    def __init__(self, pool: list[QA], rng: random.Random):
        self.pool, self.rng, self.order, self.pos, self.epochs = pool, rng, [], 0, 0

    def take(self, k: int) -> list[QA]:
        if self.pos + k > len(self.order):  # drop the short remainder: no question twice in a task
            self.order = list(self.pool)
            self.rng.shuffle(self.order)
            self.pos, self.epochs = 0, self.epochs + 1
        chunk = self.order[self.pos:self.pos + k]
        self.pos += k
        return chunk


def _ask(q: str) -> str:
    q = q.strip()
    return q if q.endswith("?") else q + "?"


def compose_set(ts: TaskSet, pools: dict[str, dict[str, list[QA]]], seed: int) -> tuple[list[dict], dict]:
    """The tasks of one benchmark file, and {source: epochs used} (1 = no question repeated)."""
    streams = {s: _Stream(pools[s][ts.split], random.Random(f"{seed}:{ts.name}:{s}")) for s in ts.sources}
    k, rows = len(ts.sources), []
    for t in range(ts.tasks):
        if ts.mode == "same_source":  # MEM1: n consecutive questions of one data set, sources alternate
            source = ts.sources[t % k]
            qs = streams[source].take(ts.n)
        else:  # mixed: positions cycle through the sources, starting source rotates with the task
            order = [ts.sources[(t + j) % k] for j in range(ts.n)]
            need = Counter(order)
            drawn = {s: iter(streams[s].take(c)) for s, c in need.items()}
            qs = [next(drawn[s]) for s in order]
            source = "mixed" if len(need) > 1 else order[0]
        rows.append({
            "task_id": f"{ts.name}-{t:05d}",
            "benchmark": ts.benchmark,
            "split": ts.split,
            "n": ts.n,
            "source": source,
            "question": "; ".join(_ask(q.question) for q in qs),
            "answer": "; ".join(q.answers[0] for q in qs),
            "questions": [q.question for q in qs],
            "answers": [list(q.answers) for q in qs],
            "qids": [q.qid for q in qs],
            "sources": [q.source for q in qs],
            "evidence_titles": [list(q.evidence_titles) for q in qs],
        })
    return rows, {s: st.epochs for s, st in streams.items()}


def stats_rows(rows_by_set: dict[str, list[dict]]) -> list[dict]:
    """benchmark, split, source, tasks, questions: one row per question source and one 'all' row."""
    out = []
    for rows in rows_by_set.values():
        if not rows:
            continue
        per_src_tasks, per_src_q = Counter(), Counter()
        for r in rows:
            c = Counter(r["sources"])
            per_src_q.update(c)
            per_src_tasks.update(c.keys())
        bench, split = rows[0]["benchmark"], rows[0]["split"]
        for s in sorted(per_src_q):
            out.append({"benchmark": bench, "split": split, "source": s, "tasks": per_src_tasks[s],
                        "questions": per_src_q[s]})
        out.append({"benchmark": bench, "split": split, "source": "all", "tasks": len(rows),
                    "questions": sum(per_src_q.values())})
    return out


def compose(bench: BenchmarksConfig, data_dir: str | Path, seed: int,
            log=print) -> tuple[dict[str, list[dict]], list[dict]]:
    """Check, load, compose. Returns ({file name: task rows}, stats rows); raises before any output."""
    sets = check_config(bench, data_dir)
    pools, dropped = load_pools(bench, data_dir, seed)
    for s, d in dropped.items():
        log(f"{s}: dropped {d} duplicate questions")
    for s, p in pools.items():
        dev = f" / {len(p['dev'])} dev" if p["dev"] else ""
        log(f"{s}: {len(p['train'])} train{dev} / {len(p['test'])} test questions")
    check_sizes(sets, pools)
    ids = {sp: {q.qid for p in pools.values() for q in p[sp]} for sp in SPLITS}
    for i, a in enumerate(SPLITS):  # by construction; cheap to verify
        assert not any(ids[a] & ids[b] for b in SPLITS[i + 1:]), "a question in two pools"
    out = {}
    for ts in sets:
        out[ts.name], epochs = compose_set(ts, pools, seed)
        for s, e in epochs.items():
            if e > 1:
                log(f"{ts.name}: the {ts.split} pool of {s} was used {e} times over (questions repeat "
                    f"across tasks, never within one)")
    return out, stats_rows(out)


# ---------------------------------------------------------------------------------------------- write

def write(rows_by_set: dict[str, list[dict]], stats: list[dict], out_dir: str | Path, stats_path: str | Path,
          record: dict) -> list[Path]:
    """All parquet files + the stats CSV, each written to a temporary name and renamed only when every
    file has been written (no partial output on failure). `record` (the config) goes into the parquet
    metadata under b'memopd'."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir, stats_path = Path(out_dir), Path(stats_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    stats_path.parent.mkdir(parents=True, exist_ok=True)
    meta = {b"memopd": json.dumps(record, sort_keys=True).encode()}
    final = [out_dir / f"{name}.parquet" for name in rows_by_set] + [stats_path]
    with ExitStack() as stack:  # entered last to first: the files are renamed in order, once all are written
        tmps = [stack.enter_context(atomic_path(p)) for p in reversed(final)][::-1]
        for (name, rows), tmp in zip(rows_by_set.items(), tmps):
            table = pa.Table.from_pylist(rows, schema=_schema()).replace_schema_metadata(meta)
            pq.write_table(table, tmp)
        with open(tmps[-1], "w", newline="") as f:
            write_stats(f, stats)
    return final


def write_stats(f, stats: list[dict]) -> None:
    """The statistics rows (stats_rows) as the benchmark statistics CSV, to the open text file `f`."""
    import csv

    w = csv.DictWriter(f, fieldnames=["benchmark", "split", "source", "tasks", "questions"])
    w.writeheader()
    w.writerows(stats)


def _schema():
    import pyarrow as pa

    s, ls, lls = pa.string(), pa.list_(pa.string()), pa.list_(pa.list_(pa.string()))
    types = {"n": pa.int32(), "questions": ls, "answers": lls, "qids": ls, "sources": ls, "evidence_titles": lls}
    return pa.schema([(c, types.get(c, s)) for c in TASK_COLUMNS])


def read_tasks(path: str | Path) -> list[dict]:
    """The tasks of one benchmark parquet file as dicts (lists as Python lists)."""
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()
