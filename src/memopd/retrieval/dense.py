"""Dense retrieval (paper scale): e5 embeddings searched by inner product, same interface as BM25.

e5 usage (Wang et al., 2022): inputs are prefixed "query: " / "passage: ", embeddings are the mean of the
last hidden states over non-padding tokens, L2-normalised; the score is their inner product (cosine).
A passage is encoded as "passage: {title}\\n{text}" (the wiki-18 `contents` layout without quotes).

Index directory: `embeddings.npy` (N x d float32, opened memory-mapped), `passages.arrow` (id, title, text;
Arrow IPC, memory-mapped), `meta.json`, `manifest.json` (the shards built) and, for a FAISS factory other
than "Flat", `faiss.index`. Memory is bounded by a shard or a search block, not by N (21M x 768 x 4 B =
64.6 GB at paper scale): the build streams the corpus in `shard_passages` shards into the memory-mapped
file in `<out>.partial/` (resumable: a rerun encodes only the shards its manifest does not list), and a
loaded index holds nothing of size N in anonymous memory: the embeddings and passages live in the page
cache (shared by every process of a node that opens the same files).

Search: FAISS when importable (`faiss-cpu`): "Flat" is exact, by `faiss.knn` straight over the memory-mapped
file (no copy); any other `faiss_factory` (IVF..., HNSW...) is built at index time, its recall@k against
exact search on a sample recorded in meta.json. Without FAISS, an exact numpy search streams over the file
in `search_block` rows and gives the same ids, order and scores as the full (queries x N) score matrix.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import numpy as np
from tqdm import tqdm

from memopd.atomic import atomic_path, write_text
from memopd.config import DenseConfig
from memopd.retrieval.base import Hit, Retriever

# what the embeddings depend on: a resumed build with other values starts over
EMBEDDING_KEYS = ("model", "max_length", "device", "dtype", "passage_prefix", "shard_passages")
RECALL_SAMPLE, RECALL_K = 1000, 10  # approximate FAISS indexes: recall@10 of 1,000 stored vectors as queries


def _faiss():
    try:
        import faiss
    except ImportError:
        return None
    return faiss


def index_memory_gb(n_passages: int, dim: int, dtype: str = "float32") -> float:
    """Size (GB = 1e9 B) of the embeddings file, n_passages x dim of dtype: the page cache a process that
    searches the index wants resident (every search reads all of it; less only makes searches read the disk).
    Paper scale: index_memory_gb(21_015_324, 768) = 64.6."""
    return n_passages * dim * np.dtype(dtype).itemsize / 1e9


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
        """(len(texts), hidden) float32, rows of unit norm."""
        import torch

        dim = self.model.config.hidden_size
        out = np.empty((len(texts), dim), np.float32)  # filled batch by batch: one copy of the result
        batches = range(0, len(texts), self.batch_size)
        for i in tqdm(batches, desc="encode", unit="batch", disable=not progress, mininterval=5):
            enc = self.tokenizer(list(texts[i:i + self.batch_size]), padding=True, truncation=True,
                                 max_length=self.max_length, return_tensors="pt").to(self.device)
            with torch.inference_mode():
                h = self.model(**enc).last_hidden_state.float()
            m = enc["attention_mask"].unsqueeze(-1).float()
            emb = (h * m).sum(1) / m.sum(1).clamp_min(1.0)
            out[i:i + self.batch_size] = torch.nn.functional.normalize(emb, dim=-1).cpu().numpy()
        return out


# ------------------------------------------------------------------------------------------------ search

def _block_topk(s: np.ndarray, k: int) -> np.ndarray:
    """Column indices (m, min(k, B)) of each row's k best scores of s (m, B), in no particular order; a tie
    across the k-th place keeps the smallest indices (as a stable sort of -s would)."""
    m, b = s.shape
    if k >= b:
        return np.broadcast_to(np.arange(b), (m, b))
    part = np.argpartition(-s, k - 1, axis=1)[:, :k]
    picked = np.take_along_axis(s, part, 1)
    kth = picked.min(1, keepdims=True)
    tied = (s == kth).sum(1) > (picked == kth).sum(1)  # argpartition chose among equal k-th scores arbitrarily
    for r in np.flatnonzero(tied):
        part[r] = np.argsort(-s[r], kind="stable")[:k]
    return part


def exact_search(q: np.ndarray, vectors: np.ndarray, k: int, block: int = DenseConfig.search_block
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Exact inner-product top k of queries q (m, d) over vectors (N, d) (e.g. a memmap), streamed in blocks
    of `block` rows: peak extra memory ~ m x block x 17 B, never m x N. Returns scores (m, k) float32 and row
    indices (m, k) int64, best first, ties by smaller index: the same as
    `idx = np.argsort(-(q @ vectors.T), axis=1, kind="stable")[:, :k]`."""
    m, k = len(q), min(k, len(vectors))
    best_s, best_i = np.empty((m, 0), np.float32), np.empty((m, 0), np.int64)
    for a in range(0, len(vectors), block):
        s = q @ np.asarray(vectors[a:a + block]).T
        local = _block_topk(s, k)
        cand_s = np.concatenate([best_s, np.take_along_axis(s, local, 1)], axis=1)
        cand_i = np.concatenate([best_i, local + a], axis=1)
        order = np.lexsort((cand_i, -cand_s), axis=1)[:, :k]  # score desc, then index asc
        best_s, best_i = np.take_along_axis(cand_s, order, 1), np.take_along_axis(cand_i, order, 1)
    return best_s, best_i


class FlatSearch:
    """FAISS exact inner-product search over a memory-mapped (N, d) array without copying it into an index
    (an IndexFlatIP would hold all N x d floats in anonymous memory)."""

    def __init__(self, vectors: np.ndarray):
        self.vectors, self.ntotal = vectors, len(vectors)

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Below `distance_compute_blas_threshold` queries FAISS scans the whole array once per query (an agent
        turn's 16 queries: 16 passes over 64.6 GB at paper scale); the threshold is lifted for the call, so that
        the BLAS path reads each database block once for a block of up to `distance_compute_blas_query_bs`
        queries (FAISS wiki, "Implementation notes": matrix multiplication for many distance computations)."""
        faiss = _faiss()
        before = faiss.cvar.distance_compute_blas_threshold
        faiss.cvar.distance_compute_blas_threshold = 0
        try:
            return faiss.knn(np.ascontiguousarray(q, np.float32), self.vectors, k, metric=faiss.METRIC_INNER_PRODUCT)
        finally:
            faiss.cvar.distance_compute_blas_threshold = before


# ------------------------------------------------------------------------------------------------- build

def _write_json(path: Path, obj: dict) -> None:
    """Atomically: a reader (or a resumed build) never sees half a file."""
    write_text(path, json.dumps(obj, indent=2) + "\n")


def corpus_shards(corpus: dict[str, list[str]] | str | Path, size: int) -> tuple[int, Iterator]:
    """(N, iterator of pyarrow Tables with columns id, title, text of `size` rows each, the last shorter).
    `corpus` is a {column: list} dict or a corpus parquet file, which is streamed (bounded memory)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = ["id", "title", "text"]
    if isinstance(corpus, dict):
        t = pa.table({c: pa.array(corpus[c], pa.string()) for c in cols})
        return len(t), (t.slice(a, size) for a in range(0, len(t), size))
    f = pq.ParquetFile(corpus)

    def rebatch():  # parquet batches end at row-group boundaries: regroup them into shards of exactly `size`
        buf, have = [], 0
        for b in f.iter_batches(batch_size=min(size, 65_536), columns=cols):
            buf.append(b)
            have += b.num_rows
            while have >= size:
                t = pa.Table.from_batches(buf)
                rest = t.slice(size)
                yield t.slice(0, size)
                buf, have = rest.to_batches(), rest.num_rows
        if have:
            yield pa.Table.from_batches(buf)

    return f.metadata.num_rows, rebatch()


@contextmanager
def _passages_sink(passages_file: str | Path | None) -> Iterator[Callable]:
    """A function taking the shards' Tables in order: written to `passages_file` as Arrow IPC, in place once the
    block ends (without a file: kept nowhere)."""
    if not passages_file:
        yield lambda t: None
        return
    import pyarrow as pa

    schema = pa.schema([(c, pa.string()) for c in ("id", "title", "text")])
    with atomic_path(passages_file) as tmp, pa.ipc.new_file(str(tmp), schema) as writer:
        yield writer.write_table


def build_embeddings(shards: Iterator, n: int, encode: Callable[[list[str]], np.ndarray], work: str | Path,
                     key: dict, prefix: str = "", passages_file: str | Path | None = None,
                     progress: bool = False) -> dict:
    """Encode `n` passages shard by shard into `work`/embeddings.npy (n, d) float32, resumably.

    shards: pyarrow Tables (id, title, text), consecutive, each `key["shard_passages"]` rows but the last.
    After each shard its rows are flushed to disk, then `work`/manifest.json records it (atomically) with a
    sha1 of the texts it encoded; a rerun with the same key encodes only the shards not recorded (or whose
    texts changed). Every shard is still read (passages_file, if given, is rewritten from them as Arrow IPC).
    Peak memory: one shard (its texts + encode's output + the file pages it writes), not n.
    Returns the manifest."""
    work = Path(work)
    path, mpath = work / "embeddings.npy", work / "manifest.json"
    man = json.loads(mpath.read_text()) if mpath.is_file() else {}
    if man.get("key") != key or man.get("passages") != n or not path.is_file():
        if man:
            print(f"{work}: other settings or corpus than its manifest: building from scratch")
        shutil.rmtree(work, ignore_errors=True)
        man = {"key": key, "passages": n, "dim": None, "shards": {}}
    work.mkdir(parents=True, exist_ok=True)
    start, todo, seconds = 0, 0, 0.0
    with _passages_sink(passages_file) as keep:
        for i, t in enumerate(tqdm(shards, desc="shards", unit="shard", disable=not progress)):
            docs = [f"{prefix}{a}\n{b}" for a, b in zip(t.column("title").to_pylist(), t.column("text").to_pylist())]
            digest = hashlib.sha1("\0".join(docs).encode()).hexdigest()
            keep(t)
            done = man["shards"].get(str(i))
            if not (done and done["sha1"] == digest and done["rows"] == [start, start + len(docs)]):
                t0 = time.perf_counter()
                x = encode(docs)
                if man["dim"] is None:  # the file is created once the dimension is known (sparse until written)
                    man["dim"] = int(x.shape[1])
                    np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, man["dim"]))
                    _write_json(mpath, man)
                # a fresh mapping per shard, unmapped after: the written pages leave the process's RSS (they
                # stay in the page cache, which the kernel may drop once flushed), so RSS does not grow with n
                mm = np.load(path, mmap_mode="r+")
                mm[start:start + len(docs)] = x
                mm.flush()  # on disk before the manifest says so
                del mm, x
                man["shards"][str(i)] = {"rows": [start, start + len(docs)], "sha1": digest,
                                         "seconds": round(time.perf_counter() - t0, 3)}
                _write_json(mpath, man)
                todo, seconds = todo + 1, seconds + man["shards"][str(i)]["seconds"]
            start += len(docs)
    if start != n:
        raise ValueError(f"corpus gave {start} passages, expected {n}")
    man["encoded_this_run"], man["encode_seconds_this_run"] = todo, seconds
    return man


def _build_faiss(vectors: np.ndarray, factory: str, search: str, work: Path, seed: int = 0) -> dict:
    """Train + fill an approximate FAISS index from the memory-mapped vectors (added block by block), save it
    as `work`/faiss.index, and measure its recall@RECALL_K against exact search on RECALL_SAMPLE stored
    vectors used as queries."""
    faiss = _faiss()
    n, d = vectors.shape
    index = faiss.index_factory(d, factory, faiss.METRIC_INNER_PRODUCT)
    rng = np.random.default_rng(seed)
    if not index.is_trained:  # a sorted sample: training reads at most 1M rows, not the whole file
        index.train(np.asarray(vectors[np.sort(rng.choice(n, min(n, 1_000_000), replace=False))]))
    for a in range(0, n, 262_144):
        index.add(np.asarray(vectors[a:a + 262_144]))
    if search:
        faiss.ParameterSpace().set_index_parameters(index, search)
    faiss.write_index(index, str(work / "faiss.index"))
    q = np.asarray(vectors[np.sort(rng.choice(n, min(n, RECALL_SAMPLE), replace=False))])
    k = min(RECALL_K, n)
    _, approx = index.search(q, k)
    _, exact = FlatSearch(vectors).search(q, k)
    recall = float(np.mean([len(set(a) & set(e)) / k for a, e in zip(approx.tolist(), exact.tolist())]))
    return {"factory": factory, "search": search, "recall_at_k": round(recall, 4), "k": k, "queries": len(q)}


def _params(params: DenseConfig | dict | None) -> dict:
    """The retrieval.dense section as a dict of every key (a dict: its keys over DenseConfig's defaults)."""
    return asdict(params if isinstance(params, DenseConfig) else DenseConfig.from_dict(params))


def build_index(corpus: dict[str, list[str]] | str | Path, out_dir: str | Path,
                params: DenseConfig | dict | None = None, record: dict | None = None, online: bool = False, encoder=None, progress: bool = True) -> dict:
    """Build the index directory `out_dir` from a corpus ({column: list} or its parquet file, streamed) in
    `<out_dir>.partial/`, renamed into place when complete (an interrupted build resumes there).
    `encoder`: anything with `encode(texts) -> (n, d) float32` (default: the configured e5 model, loaded
    only if a shard is left to encode). Returns {"passages", "build_seconds"} (all runs' encoding included)."""
    p = _params(params)
    out = Path(out_dir)
    work = out.with_name(out.name + ".partial")
    t0 = time.perf_counter()
    n, shards = corpus_shards(corpus, p["shard_passages"])
    if n == 0:
        raise ValueError("dense index: the corpus is empty")

    def encode(docs):
        nonlocal encoder
        if encoder is None:
            encoder = E5Encoder(p["model"], p["device"], p["dtype"], p["max_length"], p["batch_size"], online)
        return encoder.encode(docs)

    key = {k: p[k] for k in EMBEDDING_KEYS}
    man = build_embeddings(shards, n, encode, work, key, p["passage_prefix"], work / "passages.arrow", progress)
    faiss_info = None
    if p["faiss_factory"] != "Flat":
        if _faiss() is None:
            raise ImportError(f"faiss_factory {p['faiss_factory']!r} needs faiss (pip install faiss-cpu)")
        faiss_info = _build_faiss(np.load(work / "embeddings.npy", mmap_mode="r"), p["faiss_factory"],
                                  p["faiss_search"], work)
        print(f"faiss {p['faiss_factory']}: recall@{faiss_info['k']} {faiss_info['recall_at_k']:.4f} vs exact")
    # build time: this run's, less its encoding, plus every shard's encoding (of this or earlier runs)
    seconds = time.perf_counter() - t0 - man["encode_seconds_this_run"] + sum(s["seconds"] for s in man["shards"].values())
    _write_json(work / "meta.json", {"backend": "e5", "params": p, "passages": n, "dim": man["dim"],
                                     "build_seconds": seconds, "faiss": faiss_info, "config": record or {}})
    shutil.rmtree(out, ignore_errors=True)
    work.rename(out)
    return {"passages": n, "build_seconds": seconds, "encoded_shards": man["encoded_this_run"], "faiss": faiss_info}


# ------------------------------------------------------------------------------------------------ retriever

class DenseRetriever(Retriever):
    """Searches a built index directory (see the module docstring); `vectors` (N, d) is memory-mapped and
    `passages` a memory-mapped pyarrow Table (id, title, text)."""

    backend = "e5"

    def __init__(self, encoder, vectors: np.ndarray, passages, params: dict, index=None):
        self.encoder, self.vectors, self.passages, self.params = encoder, vectors, passages, params
        self.index = None  # anything with search(q, k) -> (scores, ids); None: exact numpy search
        if _faiss() is not None:
            self.index = FlatSearch(vectors) if params["faiss_factory"] == "Flat" else index
        elif params["faiss_factory"] != "Flat":
            raise ImportError(f"faiss_factory {params['faiss_factory']!r} needs faiss (pip install faiss-cpu)")

    @classmethod
    def load(cls, index_dir: str | Path, device: str | None = None, model: str | None = None,
             online: bool = False, encoder=None) -> DenseRetriever:
        """Reopen a saved index; `model` overrides the encoder location (e.g. a local copy), `encoder`
        replaces the encoder (anything with `encode(texts) -> (n, d)`)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        d = Path(index_dir)
        meta = json.loads((d / "meta.json").read_text())
        p = _params(meta["params"]) | ({"device": device} if device else {}) | ({"model": model} if model else {})
        if encoder is None:
            encoder = E5Encoder(p["model"], p["device"], p["dtype"], p["max_length"], p["batch_size"], online)
        if (d / "passages.arrow").is_file():
            passages = pa.ipc.open_file(pa.memory_map(str(d / "passages.arrow"))).read_all()  # zero-copy
        else:  # an index built before passages.arrow
            passages = pq.read_table(d / "passages.parquet", columns=["id", "title", "text"])
        index = None
        if p["faiss_factory"] != "Flat" and _faiss() is not None:
            index = _faiss().read_index(str(d / "faiss.index"))
            if p["faiss_search"]:
                _faiss().ParameterSpace().set_index_parameters(index, p["faiss_search"])
        return cls(encoder, np.load(d / "embeddings.npy", mmap_mode="r"), passages, p, index)

    def search(self, queries: Sequence[str], k: int = 3) -> list[list[Hit]]:
        import pyarrow as pa

        if isinstance(queries, str):
            raise TypeError("search takes a list of queries (batched); wrap a single query in a list")
        if k < 1:
            raise ValueError(f"k must be positive, got {k}")
        k = min(k, len(self))
        if not len(queries):
            return []
        q = np.asarray(self.encoder.encode([self.params["query_prefix"] + x for x in queries]), np.float32)
        if self.index is not None:
            scores, idx = self.index.search(q, k)
        else:
            scores, idx = exact_search(q, self.vectors, k, self.params["search_block"])
        rows = [[(j, float(s)) for j, s in zip(ri, rs) if j >= 0] for ri, rs in zip(idx.tolist(), scores.tolist())]
        got = self.passages.take(pa.array([j for r in rows for j, _ in r], pa.int64())).to_pydict()
        it = iter(zip(got["id"], got["title"], got["text"]))
        return [[Hit(*next(it), s) for _, s in r] for r in rows]

    def __len__(self) -> int:
        return len(self.vectors)
