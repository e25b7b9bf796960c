"""Dense retrieval (paper scale): e5 embeddings + a FAISS inner-product index, same interface as BM25.

e5 usage (Wang et al., 2022): inputs are prefixed "query: " / "passage: ", embeddings are the mean of the
last hidden states over non-padding tokens, L2-normalised; the score is their inner product (cosine).
A passage is encoded as "passage: {title}\\n{text}" (the wiki-18 `contents` layout without quotes).

FAISS is used when importable (`faiss-cpu` or the GPU build; index type from `faiss_factory`, default
exact "Flat"); without it an exact numpy inner-product search over the same normalised embeddings gives
the same ranking, which keeps the code path testable on any machine. The model is loaded by hub name at
paper scale (`online: true`) or from a local directory.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Sequence

import numpy as np
from tqdm import tqdm

from memopd.retrieval.base import Hit, Retriever, write_index_dir

DEFAULTS = {"model": "intfloat/e5-base-v2", "max_length": 256, "batch_size": 256, "device": "auto",
            "dtype": "auto", "faiss_factory": "Flat", "query_prefix": "query: ", "passage_prefix": "passage: "}


def _faiss():
    try:
        import faiss
    except ImportError:
        return None
    return faiss


class E5Encoder:
    """Mean-pooled, L2-normalised sentence embeddings from a Hugging Face encoder."""

    def __init__(self, model: str, device: str = "auto", dtype: str = "auto", max_length: int = 256,
                 batch_size: int = 256, online: bool = False):
        import torch
        from transformers import AutoModel, AutoTokenizer

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if dtype == "auto":
            dtype = "float16" if device.startswith("cuda") else "float32"
        self.device, self.max_length, self.batch_size = device, max_length, batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=not online)
        self.model = AutoModel.from_pretrained(model, dtype=getattr(torch, dtype), local_files_only=not online)
        self.model.to(device).eval()

    def encode(self, texts: Sequence[str], progress: bool = False) -> np.ndarray:
        import torch

        out = []
        batches = range(0, len(texts), self.batch_size)
        for i in tqdm(batches, desc="encode", unit="batch", disable=not progress, mininterval=5):
            enc = self.tokenizer(list(texts[i:i + self.batch_size]), padding=True, truncation=True,
                                 max_length=self.max_length, return_tensors="pt").to(self.device)
            with torch.inference_mode():
                h = self.model(**enc).last_hidden_state.float()
            m = enc["attention_mask"].unsqueeze(-1).float()
            emb = (h * m).sum(1) / m.sum(1).clamp_min(1.0)
            out.append(torch.nn.functional.normalize(emb, dim=-1).cpu().numpy())
        dim = self.model.config.hidden_size
        return np.concatenate(out).astype(np.float32) if out else np.zeros((0, dim), np.float32)


class DenseRetriever(Retriever):
    backend = "e5"

    def __init__(self, encoder: E5Encoder, vectors: np.ndarray, ids: list[str], titles: list[str],
                 texts: list[str], params: dict):
        self.encoder, self.ids, self.titles, self.texts, self.params = encoder, ids, titles, texts, params
        self.vectors = vectors  # kept for the numpy path and for saving
        self.index = None
        faiss = _faiss()
        if faiss is not None:
            self.index = faiss.index_factory(vectors.shape[1], params["faiss_factory"], faiss.METRIC_INNER_PRODUCT)
            if not self.index.is_trained:
                self.index.train(vectors)
            self.index.add(vectors)
        elif params["faiss_factory"] != "Flat":
            raise ImportError(f"faiss_factory {params['faiss_factory']!r} needs faiss (pip install faiss-cpu)")

    @classmethod
    def build(cls, corpus: dict[str, list[str]], params: dict | None = None, online: bool = False,
              progress: bool = True) -> "DenseRetriever":
        p = {**DEFAULTS, **(params or {})}
        unknown = set(p) - set(DEFAULTS)
        if unknown:
            raise ValueError(f"unknown dense retrieval parameters {sorted(unknown)} (known: {sorted(DEFAULTS)})")
        enc = E5Encoder(p["model"], p["device"], p["dtype"], p["max_length"], p["batch_size"], online)
        docs = [f"{p['passage_prefix']}{t}\n{x}" for t, x in zip(corpus["title"], corpus["text"])]
        return cls(enc, enc.encode(docs, progress), list(corpus["id"]), list(corpus["title"]),
                   list(corpus["text"]), p)

    def save(self, out_dir: str | Path, record: dict | None = None, build_seconds: float | None = None) -> None:
        """Write the index directory atomically (a temporary directory renamed into place)."""
        write_index_dir(out_dir, lambda d: np.save(d / "embeddings.npy", self.vectors), self.ids, self.titles, self.texts,
                        {"backend": self.backend, "params": self.params, "passages": len(self.ids),
                         "dim": int(self.vectors.shape[1]), "build_seconds": build_seconds, "config": record or {}})

    @classmethod
    def load(cls, index_dir: str | Path, device: str | None = None, model: str | None = None,
             online: bool = False) -> "DenseRetriever":
        """Reopen a saved index; `model` overrides the encoder location (e.g. a local copy)."""
        import pyarrow.parquet as pq

        d = Path(index_dir)
        meta = json.loads((d / "meta.json").read_text())
        p = meta["params"] | ({"device": device} if device else {}) | ({"model": model} if model else {})
        enc = E5Encoder(p["model"], p["device"], p["dtype"], p["max_length"], p["batch_size"], online)
        t = pq.read_table(d / "passages.parquet")
        vectors = np.load(d / "embeddings.npy", mmap_mode="r")
        return cls(enc, np.ascontiguousarray(vectors), t.column("id").to_pylist(), t.column("title").to_pylist(),
                   t.column("text").to_pylist(), p)

    def search(self, queries: Sequence[str], k: int = 3) -> list[list[Hit]]:
        if isinstance(queries, str):
            raise TypeError("search takes a list of queries (batched); wrap a single query in a list")
        if k < 1:
            raise ValueError(f"k must be positive, got {k}")
        k = min(k, len(self.ids))
        if not len(queries):
            return []
        q = self.encoder.encode([self.params["query_prefix"] + x for x in queries])
        if self.index is not None:
            scores, idx = self.index.search(q, k)
        else:  # exact inner product, stable order on ties
            sims = q @ self.vectors.T
            idx = np.argsort(-sims, axis=1, kind="stable")[:, :k]
            scores = np.take_along_axis(sims, idx, axis=1)
        return [[Hit(self.ids[j], self.titles[j], self.texts[j], float(s)) for j, s in zip(ri, rs) if j >= 0]
                for ri, rs in zip(idx.tolist(), scores.tolist())]

    def __len__(self) -> int:
        return len(self.ids)


def build_index(corpus: dict[str, list[str]], out_dir: str | Path, params: dict | None = None,
                record: dict | None = None, online: bool = False) -> dict:
    t0 = time.perf_counter()
    r = DenseRetriever.build(corpus, params, online)
    seconds = time.perf_counter() - t0
    r.save(out_dir, record, seconds)
    return {"passages": len(r), "build_seconds": seconds}
