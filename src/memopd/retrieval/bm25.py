"""Sparse retrieval: a `bm25s` index over the corpus, saved to disk and loaded by the agent.

Each passage is indexed as its title followed by its text; the title is repeated `title_weight` times
because the title names the article, which is what most questions ask about (a cheap, standard field
boost for single-field BM25). Queries and passages go through the same tokenizer: lowercase, the
`bm25s` word pattern, English stop words, Snowball English stemming (PyStemmer).

Saved layout (a directory): the `bm25s` arrays, `passages.parquet` (id, title, text) and `meta.json`
(backend, tokenizer and BM25 parameters, passage count, build seconds, the config).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import numpy as np

from memopd.config import BM25Config
from memopd.retrieval.base import Hit, Retriever, write_index_dir


def _stemmer(name: str | None):
    if not name:
        return None
    import Stemmer

    return Stemmer.Stemmer(name).stemWords


def _sorted_vocabulary(tokens):
    """bm25s.Tokenized with its words numbered in sorted order: with a stemmer, bm25s (0.3.16, tokenization.py)
    numbers the stems in set order, which follows string hashes and so changes with every process; renumbered, the
    index is the same bytes in every run (its scores never depended on the numbering)."""
    vocab = {word: i for i, word in enumerate(sorted(tokens.vocab))}
    new_id = {old: vocab[word] for word, old in tokens.vocab.items()}
    return type(tokens)(ids=[[new_id[i] for i in doc] for doc in tokens.ids], vocab=vocab)


class BM25Retriever(Retriever):
    """`search(queries, k)` over a bm25s index; build with `BM25Retriever.build`, reopen with `load`."""

    backend = "bm25"

    def __init__(self, model, ids: list[str], titles: list[str], texts: list[str], params: dict):
        self.model, self.ids, self.titles, self.texts, self.params = model, ids, titles, texts, params
        self._stem = _stemmer(params["stemmer"])

    # ---------------------------------------------------------------------------------- building
    @classmethod
    def build(cls, corpus: dict[str, list[str]], params: BM25Config | dict | None = None,
              progress: bool = True) -> "BM25Retriever":
        """Index a corpus given as {"id": [...], "title": [...], "text": [...]}; `params` the retrieval.bm25
        section (a dict: its keys over BM25Config's defaults)."""
        import bm25s

        p = asdict(params if isinstance(params, BM25Config) else BM25Config.from_dict(params))
        if not corpus["id"]:
            raise ValueError("cannot index an empty corpus")
        docs = [" ".join([t] * p["title_weight"] + [x]) for t, x in zip(corpus["title"], corpus["text"])]
        tokens = _sorted_vocabulary(bm25s.tokenize(docs, stopwords=p["stopwords"], stemmer=_stemmer(p["stemmer"]),
                                                   show_progress=progress))
        model = bm25s.BM25(k1=p["k1"], b=p["b"], method=p["method"])
        model.index(tokens, show_progress=progress)
        return cls(model, list(corpus["id"]), list(corpus["title"]), list(corpus["text"]), p)

    def save(self, out_dir: str | Path, record: dict | None = None, build_seconds: float | None = None) -> None:
        """Write the index directory atomically (a temporary directory renamed into place)."""
        write_index_dir(out_dir, lambda d: self.model.save(d, show_progress=False), self.ids, self.titles, self.texts,
                        {"backend": self.backend, "params": self.params, "passages": len(self.ids),
                         "build_seconds": build_seconds, "config": record or {}})

    @classmethod
    def load(cls, index_dir: str | Path, mmap: bool = False) -> "BM25Retriever":
        import bm25s
        import pyarrow.parquet as pq

        d = Path(index_dir)
        meta = json.loads((d / "meta.json").read_text())
        model = bm25s.BM25.load(d, mmap=mmap, show_progress=False)
        t = pq.read_table(d / "passages.parquet")
        return cls(model, t.column("id").to_pylist(), t.column("title").to_pylist(), t.column("text").to_pylist(),
                   meta["params"])

    # ---------------------------------------------------------------------------------- searching
    def _query_tokens(self, queries: Sequence[str]) -> list[list[str]]:
        import bm25s

        toks = bm25s.tokenize(list(queries), stopwords=self.params["stopwords"], stemmer=self._stem,
                              return_ids=False, show_progress=False)
        vocab = self.model.vocab_dict
        return [[t for t in q if t in vocab] for q in toks]  # words the corpus never uses score nothing

    def search(self, queries: Sequence[str], k: int = 3) -> list[list[Hit]]:
        """Top-k passages per query, best first (ties broken by passage order). A query with no
        indexed word returns no hits."""
        if isinstance(queries, str):
            raise TypeError("search takes a list of queries (batched); wrap a single query in a list")
        if k < 1:
            raise ValueError(f"k must be positive, got {k}")
        k = min(k, len(self.ids))
        toks = self._query_tokens(queries)
        live = [i for i, t in enumerate(toks) if t]
        out: list[list[Hit]] = [[] for _ in queries]
        if not live:
            return out
        docs, scores = self.model.retrieve([toks[i] for i in live], k=k, show_progress=False, n_threads=1)
        for row, qi in enumerate(live):
            hits = [Hit(self.ids[j], self.titles[j], self.texts[j], float(s))
                    for j, s in zip(np.asarray(docs[row]).tolist(), np.asarray(scores[row]).tolist()) if s > 0]
            out[qi] = hits
        return out

    def __len__(self) -> int:
        return len(self.ids)


def build_index(corpus: dict[str, list[str]], out_dir: str | Path, params: BM25Config | dict | None = None,
                record: dict | None = None) -> dict:
    """Build and save; returns {"passages", "build_seconds"} (tokenising + indexing, not saving)."""
    t0 = time.perf_counter()
    r = BM25Retriever.build(corpus, params)
    seconds = time.perf_counter() - t0
    r.save(out_dir, record, seconds)
    return {"passages": len(r), "build_seconds": seconds}
