"""The `memopd retrieval ...` steps: corpus, index, recall (+ timing), search. `cfg` is the config's `retrieval`
section, typed (memopd.config.RetrievalConfig)."""
from __future__ import annotations

import json
import time
from pathlib import Path

from memopd.config import RetrievalConfig
from memopd.retrieval import format_passages, load_retriever
from memopd.retrieval.corpus import build_corpus, read_corpus
from memopd.retrieval.recall import (HITS_COLUMNS, RECALL_COLUMNS, recall_hits, recall_table, sample_questions,
                                     time_queries)
from memopd.outputs import write_csv


def corpus_step(cfg: RetrievalConfig, data_dir: str | Path, out: str | Path) -> dict:
    corpus = list(cfg.corpus)
    stats = build_corpus(corpus, data_dir, out, record={"corpus": corpus, "data_dir": str(data_dir)})
    print(f"corpus: {stats['passages']:,} passages {stats['by_source']} -> {out}")
    return stats


def index_step(cfg: RetrievalConfig, section: dict, corpus_path: str | Path, out_dir: str | Path,
               online: bool = False) -> dict:
    """The configured backend's index of the corpus; `section` (the retrieval section as written) is recorded in
    the index's meta.json."""
    backend, record = cfg.backend, {"retrieval": section, "corpus": str(corpus_path)}
    if backend == "bm25":
        from memopd.retrieval.bm25 import build_index

        info = build_index(read_corpus(corpus_path), out_dir, cfg.bm25, record)
    else:  # streams the parquet shard by shard (21M passages at paper scale), resumable
        from memopd.retrieval.dense import build_index

        if not Path(corpus_path).is_file():
            raise FileNotFoundError(f"corpus {corpus_path} not found (build it with `memopd retrieval corpus`)")
        info = build_index(corpus_path, out_dir, cfg.dense, record, online=online)
    print(f"index ({backend}): {info['passages']:,} passages in {info['build_seconds']:.2f} s -> {out_dir}")
    return info


def recall_step(cfg: RetrievalConfig, index_dir: str | Path, data_dir: str | Path, seed: int, out: str | Path,
                timing_out: str | Path, hits_out: str | Path | None = None) -> list[dict]:
    """The three recall figures (CSV: dataset, metric, k, hits, total), each sampled question's hit (`hits_out`,
    when given: what an archive keeps to rebuild the figures) and a timing row: index build seconds (as measured
    when the index was built) and `timing_queries` batched searches."""
    rc = cfg.recall
    t0 = time.perf_counter()
    retriever = load_retriever(index_dir)
    load_s = time.perf_counter() - t0
    questions = sample_questions(list(rc.sources), data_dir, rc.questions, seed)
    hits = recall_hits(retriever, questions, rc.nq_k, rc.hotpot_k)
    rows = recall_table(hits)
    pool = [q.question for qs in questions.values() for q in qs] or ["wikipedia"]
    n = rc.timing_queries
    timing = time_queries(retriever, (pool * (n // len(pool) + 1))[:n], k=rc.timing_k)
    meta = json.loads((Path(index_dir) / "meta.json").read_text())
    trow = {"backend": meta["backend"], "passages": meta["passages"], "build_seconds": round(meta["build_seconds"], 3),
            "load_seconds": round(load_s, 3), "queries": timing["queries"], "k": timing["k"],
            "query_seconds": round(timing["seconds"], 3), "queries_per_second": round(timing["queries_per_second"], 1)}
    write_csv(out, rows, RECALL_COLUMNS)
    if hits_out:
        write_csv(hits_out, hits, HITS_COLUMNS)
    write_csv(timing_out, [trow], list(trow))
    for r in rows:
        print(f"{r['dataset']:8s} {r['metric']:20s} @{r['k']:<3d} {r['hits']}/{r['total']}")
    print(f"{meta['backend']}: {meta['passages']:,} passages, build {trow['build_seconds']} s, "
          f"{timing['queries']} queries in {trow['query_seconds']} s")
    return rows


def search_step(index_dir: str | Path, queries: list[str], k: int) -> None:
    retriever = load_retriever(index_dir)
    for q, hits in zip(queries, retriever.search(queries, k)):
        print(f"# {q}")
        print(format_passages(hits) or "(no hits)")
        print("scores: " + ", ".join(f"{h.id}={h.score:.2f}" for h in hits))
