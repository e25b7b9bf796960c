"""`memopd bench index`: peak RSS and time of the sharded dense-index build (and of exact search) on
synthetic corpora of growing size, each build in a fresh child process (ru_maxrss is a process's peak).

The encoder is synthetic (no model): a passage "t{i}\\n{i}" gets a fixed unit vector of i, so the figures
measure the index machinery alone: a build whose peak RSS grows with N (not with the shard) is what this
guards against (a one-shot build would hold ~3 copies of 21M x 768 float32).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


class SyntheticEncoder:
    """Deterministic unit vectors (len(texts), dim) float32 of the integer after the last newline of each
    text (any prefix before it is ignored): row i of every build is the same whatever the shard size."""

    def __init__(self, dim: int = 768, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.w = rng.uniform(0.001, 0.01, dim).astype(np.float32)
        self.b = rng.uniform(0, 2 * np.pi, dim).astype(np.float32)

    def encode(self, texts, progress: bool = False) -> np.ndarray:
        i = np.array([int(t.rsplit("\n", 1)[1]) for t in texts], np.float32)
        x = np.sin(np.outer(i, self.w) + self.b)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        return x


def write_synthetic_corpus(path: str | Path, n: int, chunk: int = 100_000) -> None:
    """A corpus parquet (id, title, text) of n passages "p{i}", "t{i}", "{i}", written in chunks."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([(c, pa.string()) for c in ("id", "title", "text")])
    with pq.ParquetWriter(path, schema) as w:
        for a in range(0, n, chunk):
            r = range(a, min(n, a + chunk))
            w.write_table(pa.table({"id": [f"p{i}" for i in r], "title": [f"t{i}" for i in r],
                                    "text": [str(i) for i in r]}, schema=schema))


def _child(corpus: str, out: str, dim: int, shard: int, queries: int) -> None:
    """Runs in the child process: build, report the peak RSS of the build, then time searches."""
    import resource
    import time

    from memopd.retrieval.dense import FlatSearch, _faiss, build_index, exact_search

    enc = SyntheticEncoder(dim)
    t0 = time.perf_counter()
    build_index(corpus, out, {"shard_passages": shard}, encoder=enc, progress=False)
    row = {"build_seconds": round(time.perf_counter() - t0, 3),
           "build_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    v = np.load(Path(out) / "embeddings.npy", mmap_mode="r")
    q = enc.encode([f"q\n{i}" for i in np.random.default_rng(1).integers(0, len(v), queries)])
    t0 = time.perf_counter()
    exact_search(q, v, 10)
    row["numpy_search_seconds"] = round(time.perf_counter() - t0, 3)
    if _faiss() is not None:
        t0 = time.perf_counter()
        FlatSearch(v).search(q, 10)
        row["faiss_flat_search_seconds"] = round(time.perf_counter() - t0, 3)
    print(json.dumps(row))


def run(sizes=(50_000, 200_000), dim: int = 768, shard: int = 10_000, queries: int = 64) -> list[dict]:
    """One row per corpus size: passages, dim, shard, index GB, build seconds, build peak RSS (MB),
    exact-search seconds of `queries` queries (numpy streamed; FAISS Flat if installed)."""
    from memopd.retrieval.dense import index_memory_gb

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            corpus, out = Path(tmp) / f"corpus{n}.parquet", Path(tmp) / f"index{n}"
            write_synthetic_corpus(corpus, n)
            code = (f"from memopd.retrieval.index_bench import _child; "
                    f"_child({str(corpus)!r}, {str(out)!r}, {dim}, {shard}, {queries})")
            res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            row = {"passages": n, "dim": dim, "shard_passages": shard,
                   "index_gb": round(index_memory_gb(n, dim), 3), **json.loads(res.stdout.strip().splitlines()[-1])}
            print(", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
            rows.append(row)
    return rows
