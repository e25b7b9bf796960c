"""Dense index at paper scale: sharded, resumable build into a memory-mapped file (peak memory bounded by
the shard, not N), exact numpy search streamed in blocks, FAISS search, `memopd bench index`. CPU only, no
model: a deterministic fake encoder stands in for e5."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from memopd.retrieval import dense

DenseRetriever, build_index, exact_search = dense.DenseRetriever, dense.build_index, dense.exact_search
index_memory_gb = dense.index_memory_gb

needs_faiss = pytest.mark.skipif(dense._faiss() is None, reason="faiss not installed (pip install faiss-cpu)")


class FakeEncoder:
    """Unit vectors (n, dim) that depend only on each text (a seeded generator per sha of the text);
    counts calls, and raises on call number `fail_at` (an interrupted build)."""

    def __init__(self, dim: int = 16, fail_at: int | None = None):
        self.dim, self.fail_at, self.calls = dim, fail_at, 0

    def encode(self, texts, progress=False):
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise KeyboardInterrupt("killed")
        import hashlib

        x = np.stack([np.random.default_rng(int(hashlib.sha1(t.encode()).hexdigest()[:12], 16)).standard_normal(self.dim)
                      for t in texts]).astype(np.float32)
        return x / np.linalg.norm(x, axis=1, keepdims=True)


def _corpus(n: int) -> dict[str, list[str]]:
    return {"id": [f"p{i}" for i in range(n)], "title": [f"title {i % 17}" for i in range(n)],
            "text": [f"passage number {i}" for i in range(n)]}


def _emb(d):
    return np.load(d / "embeddings.npy")


def _reference(q, v, k):
    """The exact search written plainly: the full (queries x N) score matrix, stable sort."""
    sims = q @ v.T
    idx = np.argsort(-sims, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(sims, idx, axis=1), idx


def test_sharded_build_equals_one_shot(tmp_path):
    corpus, enc = _corpus(103), FakeEncoder()
    build_index(corpus, tmp_path / "one", {"shard_passages": 1000}, encoder=enc, progress=False)
    assert enc.calls == 1
    enc = FakeEncoder()
    build_index(corpus, tmp_path / "sharded", {"shard_passages": 10}, encoder=enc, progress=False)
    assert enc.calls == 11  # ceil(103 / 10) shards, one encode call each
    one, sharded = _emb(tmp_path / "one"), _emb(tmp_path / "sharded")
    assert one.shape == (103, 16) and np.array_equal(one, sharded)
    docs = [f"passage: {t}\n{x}" for t, x in zip(corpus["title"], corpus["text"])]
    assert np.array_equal(one, FakeEncoder().encode(docs))
    man = json.loads((tmp_path / "sharded" / "manifest.json").read_text())
    assert sorted(map(int, man["shards"])) == list(range(11)) and man["shards"]["10"]["rows"] == [100, 103]
    assert not (tmp_path / "sharded.partial").exists()
    # the corpus parquet (streamed, as the workflow does) gives the same index as the in-memory corpus
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(corpus), tmp_path / "corpus.parquet", row_group_size=7)  # groups across shards
    build_index(tmp_path / "corpus.parquet", tmp_path / "pq", {"shard_passages": 10}, encoder=FakeEncoder(),
                progress=False)
    assert np.array_equal(_emb(tmp_path / "pq"), one)
    r = DenseRetriever.load(tmp_path / "pq", encoder=FakeEncoder())
    assert r.passages.column("id").to_pylist() == corpus["id"] and len(r) == 103


def test_interrupted_build_resumes_only_the_missing_shards(tmp_path):
    corpus, p = _corpus(95), {"shard_passages": 10}  # 10 shards
    with pytest.raises(KeyboardInterrupt):
        build_index(corpus, tmp_path / "idx", p, encoder=FakeEncoder(fail_at=4), progress=False)  # 3 shards done
    assert not (tmp_path / "idx").exists()
    man = json.loads((tmp_path / "idx.partial" / "manifest.json").read_text())
    assert sorted(map(int, man["shards"])) == [0, 1, 2]
    enc = FakeEncoder()
    info = build_index(corpus, tmp_path / "idx", p, encoder=enc, progress=False)
    assert enc.calls == 7 and info["encoded_shards"] == 7
    build_index(corpus, tmp_path / "ref", p, encoder=FakeEncoder(), progress=False)
    assert np.array_equal(_emb(tmp_path / "idx"), _emb(tmp_path / "ref"))
    assert info["build_seconds"] >= 0 and not (tmp_path / "idx.partial").exists()
    # settings the embeddings depend on changed: the partial build is discarded, every shard encoded again
    with pytest.raises(KeyboardInterrupt):
        build_index(corpus, tmp_path / "b", p, encoder=FakeEncoder(fail_at=3), progress=False)
    enc = FakeEncoder()
    build_index(corpus, tmp_path / "b", {**p, "max_length": 64}, encoder=enc, progress=False)
    assert enc.calls == 10


@pytest.mark.parametrize("block", [1, 7, 64, 10_000])
def test_streamed_numpy_search_equals_the_full_score_matrix(block):
    rng = np.random.default_rng(0)
    v = rng.standard_normal((500, 16)).astype(np.float32)
    q = rng.standard_normal((9, 16)).astype(np.float32)
    for k in (1, 5, 500, 600):
        s, i = exact_search(q, v, k, block)
        rs, ri = _reference(q, v, k)
        assert np.array_equal(i, ri) and np.allclose(s, rs, atol=1e-6)
    # many exact ties (small integers: the dot products are exact): same ids, same order, same scores
    v = rng.integers(-1, 2, (300, 4)).astype(np.float32)
    q = rng.integers(-1, 2, (12, 4)).astype(np.float32)
    for k in (1, 3, 20, 299):
        s, i = exact_search(q, v, k, block)
        rs, ri = _reference(q, v, k)
        assert np.array_equal(i, ri) and np.array_equal(s, rs)


@needs_faiss
def test_faiss_flat_search_equals_exact_search():
    rng = np.random.default_rng(1)
    v = rng.standard_normal((2000, 32)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    q = v[rng.integers(0, 2000, 20)] + 0.1 * rng.standard_normal((20, 32)).astype(np.float32)
    s, i = dense.FlatSearch(v).search(q, 10)
    rs, ri = exact_search(q, v, 10)
    assert np.array_equal(i, ri) and np.allclose(s, rs, atol=1e-5)


@needs_faiss
def test_a_turns_few_queries_take_faiss_blas_path(monkeypatch):
    """16 queries (an agent turn) are below FAISS's default BLAS threshold, where it scans the array once per query:
    the search lifts the threshold for its call (recorded by a stand-in for faiss.knn) and puts it back."""
    import faiss

    seen, knn = [], faiss.knn
    monkeypatch.setattr(faiss, "knn", lambda *a, **kw: (seen.append(faiss.cvar.distance_compute_blas_threshold),
                                                         knn(*a, **kw))[1])
    before = faiss.cvar.distance_compute_blas_threshold
    rng = np.random.default_rng(2)
    v = rng.standard_normal((500, 16)).astype(np.float32)
    q = rng.standard_normal((16, 16)).astype(np.float32)
    s, i = dense.FlatSearch(v).search(q, 5)
    assert seen and seen[0] < len(q) and faiss.cvar.distance_compute_blas_threshold == before
    rs, ri = exact_search(q, v, 5)
    assert np.array_equal(i, ri) and np.allclose(s, rs, atol=1e-5)


@pytest.mark.parametrize("use_faiss", [pytest.param(True, marks=needs_faiss), False], ids=["faiss", "numpy"])
def test_retriever_searches_the_memory_mapped_index(tmp_path, monkeypatch, use_faiss):
    if not use_faiss:
        monkeypatch.setattr(dense, "_faiss", lambda: None)
    corpus = _corpus(120)
    build_index(corpus, tmp_path / "idx", {"shard_passages": 25, "query_prefix": "", "passage_prefix": "",
                                            "search_block": 32}, encoder=FakeEncoder(), progress=False)
    r = DenseRetriever.load(tmp_path / "idx", encoder=FakeEncoder())
    assert isinstance(r.vectors, np.memmap) and (r.index is not None) == use_faiss
    queries = [f"{corpus['title'][i]}\n{corpus['text'][i]}" for i in (5, 77, 119)]
    hits = r.search(queries, k=4)
    assert [hs[0].id for hs in hits] == ["p5", "p77", "p119"]
    assert hits[1][0].title == corpus["title"][77] and hits[1][0].text == corpus["text"][77]
    _, ri = _reference(FakeEncoder().encode(queries), np.asarray(r.vectors), 4)
    assert [[h.id for h in hs] for hs in hits] == [[f"p{j}" for j in row] for row in ri.tolist()]


@needs_faiss
def test_approximate_faiss_index_records_its_recall(tmp_path):
    corpus = _corpus(2000)
    p = {"shard_passages": 500, "faiss_factory": "IVF4,Flat", "faiss_search": "nprobe=4"}
    info = build_index(corpus, tmp_path / "ivf", p, encoder=FakeEncoder(), progress=False)
    meta = json.loads((tmp_path / "ivf" / "meta.json").read_text())
    assert meta["faiss"] == info["faiss"] and meta["faiss"]["k"] == 10 and meta["faiss"]["queries"] == 1000
    assert meta["faiss"]["recall_at_k"] == 1.0  # nprobe = nlist: every list is scanned, exact
    r = DenseRetriever.load(tmp_path / "ivf", encoder=FakeEncoder())
    assert r.index.ntotal == 2000 and not isinstance(r.index, dense.FlatSearch)
    q = [f"{corpus['title'][i]}\n{corpus['text'][i]}" for i in (3, 1500)]
    r.params["query_prefix"] = "passage: "  # a query equal to a passage's encoded text finds that passage
    assert [hs[0].id for hs in r.search(q, k=3)] == ["p3", "p1500"]


def test_index_memory_gb():
    assert index_memory_gb(21_015_324, 768) == pytest.approx(64.56, abs=0.01)  # wiki-18, e5-base, float32
    assert index_memory_gb(1000, 768, "float16") == pytest.approx(1000 * 768 * 2 / 1e9)


def test_build_peak_rss_is_bounded_by_the_shard_not_the_corpus():
    """Each build in a fresh process (ru_maxrss): 200k x 768 float32 (614 MB) peaks within 64 MB of 50k
    (154 MB) with 10k-passage shards; the one-shot build held ~3 x N x d x 4 B (1.8 GB at 200k)."""
    from memopd.retrieval.index_bench import run

    small, large = run((50_000, 200_000), dim=768, shard=10_000, queries=8)
    assert large["build_peak_rss_mb"] - small["build_peak_rss_mb"] < 64, (small, large)


def test_bench_index_cli_writes_csv(tmp_path):
    from memopd.cli import main

    main(["bench", "index", "--sizes", "3000", "6000", "--dim", "32", "--shard", "1000", "--queries", "4",
          "--out", str(tmp_path / "index.csv")])
    with open(tmp_path / "index.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["passages"]) for r in rows] == [3000, 6000]
    assert {"build_seconds", "build_peak_rss_mb", "numpy_search_seconds", "index_gb", "shard_passages"} <= set(rows[0])
