"""Retrieval: corpus building, a bm25s index (embedded default), e5 + FAISS (paper scale).

    from memopd.retrieval import load_retriever, format_passages
    r = load_retriever("results/retrieval/bm25")
    hits = r.search(["who got the first nobel prize in physics"], k=3)[0]
    print(format_passages(hits))
"""
from __future__ import annotations

import json
from pathlib import Path

from memopd.retrieval.base import Hit, Retriever, format_passages

__all__ = ["Hit", "Retriever", "format_passages", "load_retriever"]


def load_retriever(index_dir: str | Path, **kwargs) -> Retriever:
    """Open a saved index; the backend is read from its meta.json."""
    d = Path(index_dir)
    meta_path = d / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{d} is not a retrieval index (no meta.json); build it with `memopd retrieval index`")
    backend = json.loads(meta_path.read_text())["backend"]
    if backend == "bm25":
        from memopd.retrieval.bm25 import BM25Retriever

        return BM25Retriever.load(d, **kwargs)
    if backend == "e5":
        from memopd.retrieval.dense import DenseRetriever

        return DenseRetriever.load(d, **kwargs)
    raise ValueError(f"{meta_path}: unknown retrieval backend {backend!r}")
