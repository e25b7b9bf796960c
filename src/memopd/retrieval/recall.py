"""Retrieval quality and speed on the embedded corpus: the figures the agent's ceiling depends on.

- NQ: the answer appears in a top-k passage (k = 5): some alias, normalised like the metrics
  (SQuAD normalisation), occurs as a whole-token sequence in the normalised passage text.
- HotpotQA: at least one, and both, supporting articles are among the titles of the top-k (k = 10).

Questions are a seeded sample of each data set's questions (`questions`: sample size, null = all).
"""
from __future__ import annotations

import random
import time
from pathlib import Path

from memopd.data.loaders import QA, load_qa, resolve
from memopd.metrics import normalize_answer
from memopd.retrieval.base import Hit, Retriever

RECALL_COLUMNS = ("dataset", "metric", "k", "hits", "total")
HITS_COLUMNS = ("dataset", "qid", "k", "any", "all")


def answer_in_passage(answers, hit: Hit) -> bool:
    text = f" {normalize_answer(hit.text)} "
    return any(f" {a} " in text for a in (normalize_answer(x) for x in answers) if a)


def sample_questions(entries: list[dict], data_dir: str | Path, n: int | None, seed: int,
                     key: str = "retrieval.recall.sources") -> dict[str, list[QA]]:
    """{"nq": [...], "hotpotqa": [...]}: a seeded sample of the questions of the configured files that
    carry evidence (NQ oracle answers; HotpotQA supporting titles)."""
    pools: dict[str, list[QA]] = {"nq": [], "hotpotqa": []}
    for i, e in enumerate(entries):
        if e["format"] in ("nq_oracle", "hotpotqa_hf", "hotpotqa_official"):
            pools["nq" if e["format"] == "nq_oracle" else "hotpotqa"] += load_qa(
                resolve(e["path"], data_dir, f"{key}[{i}].path"), e["format"], f"{key}[{i}].path")
    out = {}
    for name, pool in pools.items():
        pool = sorted(pool, key=lambda q: q.qid)
        rng = random.Random(f"{seed}:recall:{name}")
        out[name] = pool if n is None or n >= len(pool) else rng.sample(pool, n)
    return out


def recall_hits(retriever: Retriever, questions: dict[str, list[QA]], nq_k: int = 5, hotpot_k: int = 10,
                batch: int = 256) -> list[dict]:
    """Per sampled question (HITS_COLUMNS): its data set, id, k and whether its evidence is in the top k: for NQ
    the answer in some passage (any = all), for HotpotQA one supporting article (any) and both (all)."""
    out = []
    for name, k in (("nq", nq_k), ("hotpotqa", hotpot_k)):
        qs = questions.get(name, [])
        for q, hs in zip(qs, _search(retriever, [q.question for q in qs], k, batch) if qs else []):
            if name == "nq":
                any_ = all_ = any(answer_in_passage(q.answers, h) for h in hs)
            else:
                titles = {h.title for h in hs}
                any_, all_ = bool(set(q.evidence_titles) & titles), set(q.evidence_titles) <= titles
            out.append({"dataset": name, "qid": q.qid, "k": k, "any": int(any_), "all": int(all_)})
    return out


def recall_table(hits: list[dict]) -> list[dict]:
    """The three figures as rows (RECALL_COLUMNS) of the per-question `hits` (NQ first, a data set without
    questions has no row)."""
    rows = []
    for name, figures in (("nq", (("answer_in_topk", "any"),)),
                          ("hotpotqa", (("support_any_in_topk", "any"), ("support_all_in_topk", "all")))):
        hs = [h for h in hits if h["dataset"] == name]
        for metric, col in figures if hs else ():
            rows.append({"dataset": name, "metric": metric, "k": int(hs[0]["k"]),
                         "hits": sum(int(h[col]) for h in hs), "total": len(hs)})
    return rows


def _search(retriever: Retriever, queries: list[str], k: int, batch: int) -> list[list[Hit]]:
    out = []
    for i in range(0, len(queries), batch):
        out += retriever.search(queries[i:i + batch], k)
    return out


def time_queries(retriever: Retriever, queries: list[str], k: int = 3, batch: int = 256) -> dict:
    """Wall-clock seconds for `len(queries)` searches, batched as the agent batches them."""
    t0 = time.perf_counter()
    _search(retriever, queries, k, batch)
    s = time.perf_counter() - t0
    return {"queries": len(queries), "k": k, "seconds": s, "queries_per_second": len(queries) / s if s else None}
