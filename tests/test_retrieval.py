"""Retrieval: corpus (de-dup, stable ids), the real bm25s index, the interface, recall, dense e5 path."""
import csv
import json
import os
from pathlib import Path

import numpy as np
import pytest
import yaml

from memopd.data.loaders import MissingDataError, load_qa
from memopd.retrieval import Hit, format_passages, load_retriever
from memopd.retrieval.bm25 import BM25Retriever, build_index
from memopd.retrieval.corpus import build_corpus, read_corpus
from memopd.retrieval.recall import answer_in_passage, recall_hits, recall_table, sample_questions

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"


@pytest.fixture(scope="module")
def retrieval_cfg():
    return yaml.safe_load((ROOT / "config/config.yaml").read_text())["retrieval"]


@pytest.fixture(scope="module")
def embedded_index(retrieval_cfg, tmp_path_factory):
    """The embedded default's corpus and BM25 index, built once (a few seconds) in a temporary dir."""
    d = tmp_path_factory.mktemp("retrieval")
    build_corpus(retrieval_cfg["corpus"], DATA, d / "corpus.parquet")
    info = build_index(read_corpus(d / "corpus.parquet"), d / "index", retrieval_cfg["bm25"])
    return d, info


# ---------------------------------------------------------------------------------------------- corpus

def test_corpus_is_deduplicated_with_stable_ids(retrieval_cfg, embedded_index, tmp_path):
    d, _ = embedded_index
    c = read_corpus(d / "corpus.parquet")
    assert len(c["id"]) == len(set(c["id"])) > 15000
    assert len({(t, x) for t, x in zip(c["title"], c["text"])}) == len(c["id"])
    assert set(c["source"]) == {"wiki18", "hotpotqa", "nq"}
    assert c["id"][0] == "wiki18:0" and c["title"][0] == "Evan Morris"
    # a file listed twice adds nothing; the order of the files does not change any id
    entries = retrieval_cfg["corpus"]
    build_corpus(entries[::-1] + entries[:1], DATA, tmp_path / "c2.parquet")
    c2 = read_corpus(tmp_path / "c2.parquet")
    assert sorted(c2["id"]) == sorted(c["id"])


def test_corpus_missing_file_names_key_and_leaves_nothing(retrieval_cfg, tmp_path):
    entries = [retrieval_cfg["corpus"][0], {"format": "nq_oracle", "path": "nq/missing.jsonl.gz"}]
    with pytest.raises(MissingDataError, match=r"retrieval\.corpus\[1\]\.path: data file .*nq/missing\.jsonl\.gz"):
        build_corpus(entries, DATA, tmp_path / "c.parquet")
    assert not list(tmp_path.iterdir())


# --------------------------------------------------------------------------------------------- search

def test_finds_known_passages(embedded_index):
    d, info = embedded_index
    r = load_retriever(d / "index")
    assert isinstance(r, BM25Retriever) and len(r) == info["passages"]
    hits = r.search(["who got the first nobel prize in physics",
                     "Socialist Revolutionary Party Russia agrarian socialism"], k=3)
    assert hits[0][0].title == "List of Nobel laureates in Physics" and "Röntgen" in hits[0][0].text
    assert hits[1][0].title == "Socialist Revolutionary Party"
    for hs in hits:
        assert len(hs) == 3 and all(isinstance(h, Hit) for h in hs)
        assert [h.score for h in hs] == sorted((h.score for h in hs), reverse=True) and hs[0].score > 0


def test_batched_equals_one_by_one_and_reload_is_identical(embedded_index):
    d, _ = embedded_index
    r = load_retriever(d / "index")
    queries = [q.question for q in load_qa(DATA / "nq/NQ-open.dev.jsonl", "nq_open")[:40]]
    batched = r.search(queries, k=5)
    assert batched == [r.search([q], k=5)[0] for q in queries]
    assert BM25Retriever.load(d / "index").search(queries, k=5) == batched
    meta = json.loads((d / "index/meta.json").read_text())
    assert meta["backend"] == "bm25" and meta["params"]["title_weight"] == 2


def test_search_edge_cases(embedded_index):
    r = load_retriever(embedded_index[0] / "index")
    assert r.search(["qwxzv zzqjk"], k=3) == [[]]            # no indexed word: no hits
    assert r.search(["", "the of and"], k=2) == [[], []]      # empty / stop words only
    assert r.search([], k=2) == []
    with pytest.raises(TypeError, match="list of queries"):
        r.search("a single string", k=2)
    with pytest.raises(ValueError):
        r.search(["x"], k=0)


def test_small_index_roundtrip_and_k_clamp(tmp_path):
    corpus = {"id": ["a", "b", "c"], "title": ["Paris", "Berlin", "Rome"],
              "text": ["capital of France on the Seine", "capital of Germany on the Spree", "capital of Italy"]}
    build_index(corpus, tmp_path / "idx")
    r = load_retriever(tmp_path / "idx")
    hits = r.search(["which river flows through the capital of Germany"], k=10)[0]
    assert hits[0].id == "b" and len(hits) == 3   # k clamped to the corpus size
    assert not (tmp_path / "idx.tmp").exists()


def test_format_passages():
    hits = [Hit("x", "Evan Morris", "Evan L. Morris was a lobbyist.", 3.0), Hit("y", "Tappet", "A tappet.", 1.0)]
    assert format_passages(hits) == ("Doc 1 (Title: Evan Morris) Evan L. Morris was a lobbyist.\n"
                                     "Doc 2 (Title: Tappet) A tappet.")
    assert format_passages([]) == "No results."


def test_load_retriever_rejects_a_non_index(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a retrieval index"):
        load_retriever(tmp_path)


# --------------------------------------------------------------------------------------------- recall

def test_answer_matching_is_token_aligned():
    h = Hit("x", "t", "He was born in 1972, in Paris.", 1.0)
    assert answer_in_passage(["1972"], h) and answer_in_passage(["the Paris"], h)
    assert not answer_in_passage(["197"], h) and not answer_in_passage(["", "London"], h)


def test_recall_on_a_sample_beats_plain_bm25_level(retrieval_cfg, embedded_index):
    """100 questions per data set: the figures are real retrieval, not a given (over every question,
    plain BM25 reaches 86% / 99% / 69%, the configured index 90% / 99.5% / 72%)."""
    r = load_retriever(embedded_index[0] / "index")
    qs = sample_questions(retrieval_cfg["recall"]["sources"], DATA, 100, seed=3)
    rows = {(x["dataset"], x["metric"]): x for x in recall_table(recall_hits(r, qs))}
    assert rows[("nq", "answer_in_topk")]["total"] == 100 and rows[("nq", "answer_in_topk")]["k"] == 5
    assert rows[("nq", "answer_in_topk")]["hits"] >= 80
    assert rows[("hotpotqa", "support_any_in_topk")]["hits"] >= 95
    assert 55 <= rows[("hotpotqa", "support_all_in_topk")]["hits"] <= rows[("hotpotqa", "support_any_in_topk")]["hits"]


def test_each_questions_hit_is_its_own_search_and_the_figures_rebuild_from_them(retrieval_cfg, embedded_index,
                                                                                   tmp_path):
    """`retrieval recall --hits`: each sampled question's hit is what a search of that question alone finds (the
    answer in a top-5 passage; a supporting title among the top 10), and the figures an archive rebuilds from the
    hits alone (memopd.report.archived_tables) are the step's CSV byte for byte."""
    from memopd.cli import main
    from memopd.report.archived_tables import keep_recall, rebuild_recall

    cfg = {**retrieval_cfg, "recall": {**retrieval_cfg["recall"], "questions": 40, "timing_queries": 4}}
    main(["retrieval", "recall", "--cfg", json.dumps(cfg), "--seed", "3", "--index", str(embedded_index[0] / "index"),
          "--data-dir", str(DATA), "--out", str(tmp_path / "recall.csv"), "--timing", str(tmp_path / "timing.csv"),
          "--hits", str(tmp_path / "hits.csv")])
    with open(tmp_path / "hits.csv") as f:
        hits = {(h["dataset"], h["qid"]): h for h in csv.DictReader(f)}
    r = load_retriever(embedded_index[0] / "index")
    qs = sample_questions(cfg["recall"]["sources"], DATA, 40, seed=3)
    assert len(hits) == sum(len(v) for v in qs.values()) == 80
    for q in qs["nq"]:
        found = any(answer_in_passage(q.answers, h) for h in r.search([q.question], 5)[0])
        assert hits[("nq", q.qid)]["any"] == hits[("nq", q.qid)]["all"] == str(int(found))
    for q in qs["hotpotqa"]:
        titles = {h.title for h in r.search([q.question], 10)[0]}
        found = [t in titles for t in q.evidence_titles]
        assert (hits[("hotpotqa", q.qid)]["any"], hits[("hotpotqa", q.qid)]["all"]) == (str(int(any(found))),
                                                                                      str(int(all(found))))
    keep_recall(tmp_path / "hits.csv", tmp_path / "archive")
    rebuild_recall(tmp_path / "archive", tmp_path / "rebuilt.csv")
    assert (tmp_path / "rebuilt.csv").read_bytes() == (tmp_path / "recall.csv").read_bytes()


# ---------------------------------------------------------------------------------------------- dense

def _tiny_encoder(path: Path, texts):
    """A randomly initialised tiny BERT + WordPiece tokenizer trained here: exercises the e5 code path
    (tokenise, mean-pool, normalise, index, save, load) without any download."""
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]")
    fast.save_pretrained(path)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(fast), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=128)).save_pretrained(path)


@pytest.fixture(scope="module")
def tiny_dense_setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("dense")
    ps = [p for p in load_qa(DATA / "nq/nq-open-oracle.jsonl.gz", "nq_oracle")[:30] for p in p.passages]
    corpus = {"id": [f"p{i}" for i in range(len(ps))], "title": [t for t, _ in ps], "text": [x for _, x in ps]}
    _tiny_encoder(d / "enc", [f"{t}\n{x}" for t, x in ps])
    return d / "enc", corpus


@pytest.mark.parametrize("use_faiss", [True, False], ids=["faiss", "numpy"])
def test_dense_backend_interface(tiny_dense_setup, tmp_path, monkeypatch, use_faiss):
    from memopd.retrieval import dense
    from memopd.retrieval.dense import DenseRetriever, build_index as build_dense

    if use_faiss and dense._faiss() is None:
        pytest.skip("faiss not installed (pip install faiss-cpu)")
    if not use_faiss:
        monkeypatch.setattr(dense, "_faiss", lambda: None)
    enc, corpus = tiny_dense_setup
    ps = corpus["title"]
    # no prefixes: a query equal to a passage's encoded text must find that passage with cosine 1
    params = {"model": str(enc), "device": "cpu", "max_length": 64, "batch_size": 8,
              "query_prefix": "", "passage_prefix": ""}
    info = build_dense(corpus, tmp_path / "dense", params)
    assert info["passages"] == len(ps)
    r = load_retriever(tmp_path / "dense")
    assert isinstance(r, DenseRetriever) and r.vectors.shape == (len(ps), 32)
    assert (r.index is not None) == use_faiss
    assert np.allclose(np.linalg.norm(r.vectors, axis=1), 1.0, atol=1e-5)
    queries = [f"{corpus['title'][i]}\n{corpus['text'][i]}" for i in (3, 17)]
    hits = r.search(queries, k=4)
    assert [hs[0].id for hs in hits] == ["p3", "p17"] and hits[0][0].score == pytest.approx(1.0, abs=1e-4)
    # scores are the inner products of the encoder's own embeddings, best first
    q = r.encoder.encode(queries)
    for qi, hs in enumerate(hits):
        ids = [int(h.id[1:]) for h in hs]
        assert [h.score for h in hs] == pytest.approx((r.vectors[ids] @ q[qi]).tolist(), abs=1e-5)
        assert [h.score for h in hs] == sorted((h.score for h in hs), reverse=True)
    assert DenseRetriever.load(tmp_path / "dense", device="cpu").search(queries, k=4) == hits


def _e5_path():
    """A local e5 checkpoint: $MEMOPD_E5_MODEL, or the hub cache (no download is attempted)."""
    if os.environ.get("MEMOPD_E5_MODEL"):
        return os.environ["MEMOPD_E5_MODEL"]
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download("intfloat/e5-base-v2", local_files_only=True)
    except Exception:
        return None


@pytest.mark.gpu
@pytest.mark.skipif(_e5_path() is None, reason="e5 weights not available locally")
def test_e5_finds_the_gold_passage(tmp_path):
    import torch

    from memopd.retrieval.dense import build_index as build_dense

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    qas = load_qa(DATA / "nq/nq-open-oracle.jsonl.gz", "nq_oracle")[:200]
    corpus = {"id": [q.qid for q in qas], "title": [q.passages[0][0] for q in qas], "text": [q.passages[0][1] for q in qas]}
    build_dense(corpus, tmp_path / "e5", {"model": _e5_path()})
    hits = load_retriever(tmp_path / "e5").search([q.question for q in qas], k=5)
    found = sum(q.qid in {h.id for h in hs} for q, hs in zip(qas, hits))
    assert found >= 180, f"gold passage in top 5 for {found}/200"


def test_an_index_is_the_same_bytes_whatever_the_string_hashes(tmp_path):
    """bm25s numbers stemmed words in set order (string hashes differ per process): two builds under other
    PYTHONHASHSEEDs write the same vocabulary and score matrix, and find the same passages."""
    import os
    import subprocess
    import sys

    script = ("import sys; from memopd.retrieval.bm25 import build_index; "
              "build_index({'id': ['a', 'b', 'c'], 'title': ['Paris', 'Berlin', 'Rome'], 'text': ['capital of "
              "France on the Seine river', 'capital of Germany on the Spree river', 'capital of Italy, the "
              "eternal city, rivers Tiber and Aniene']}, sys.argv[1])")
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run([sys.executable, "-c", script, str(tmp_path / seed)], check=True, env=env)
    vocab = [json.loads((tmp_path / s / "vocab.index.json").read_text()) for s in ("1", "2")]
    assert vocab[0] == vocab[1]  # each word the same id
    for name in ("data", "indices", "indptr"):
        assert (tmp_path / "1" / f"{name}.csc.index.npy").read_bytes() == \
            (tmp_path / "2" / f"{name}.csc.index.npy").read_bytes()
    hits = [load_retriever(tmp_path / s).search(["the river through the capital of Germany"], k=3)[0] for s in "12"]
    assert [h.id for h in hits[0]] == [h.id for h in hits[1]] and hits[0][0].id == "b"
