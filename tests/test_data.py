"""Data loaders on the committed samples, benchmark composition, and the bad-input errors."""
import copy
import csv
import gzip
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from memopd.data import corpus_texts
from memopd.config import BenchmarksConfig
from memopd.data.compose import compose, load_pools, read_tasks, task_sets, write
from memopd.data.loaders import (DataConfigError, DataFormatError, MissingDataError, iter_passages, load_qa)
from memopd.data.steps import build_benchmarks

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"
HP1 = DATA / "hotpotqa/distractor_dev_sample_1.jsonl"
HP_OFFICIAL = DATA / "hotpotqa/hotpotqa_train_official_format.json"
NQ_OPEN = DATA / "nq/NQ-open.dev.jsonl"
NQ_ORACLE = DATA / "nq/nq-open-oracle.jsonl.gz"
WIKI = DATA / "wiki/wiki18_sample.jsonl"


@pytest.fixture(scope="module")
def bench_cfg():
    """The embedded default's `benchmarks` section, as Snakemake passes it."""
    return yaml.safe_load((ROOT / "config/config.yaml").read_text())["benchmarks"]


@pytest.fixture(scope="module")
def composed(bench_cfg):
    return compose(BenchmarksConfig.from_dict(bench_cfg), DATA, seed=1234, log=lambda *a: None)


# ------------------------------------------------------------------------------------------- loaders

def test_hotpotqa_hf_layout():
    qas = load_qa(HP1, "hotpotqa_hf")
    assert len(qas) == 300
    q = qas[0]
    assert q.qid == "hotpotqa:5abf63f15542997ec76fd3ea" and q.answers == ("October 1922",)
    assert q.evidence_titles == ("Socialist Revolutionary Party", "Russian Civil War")
    assert len(q.passages) == 10 and q.passages[0][0] == "Socialist Revolutionary Party"
    assert q.passages[0][1].startswith("The Socialist Revolutionary Party, or Party of") and "  " not in q.passages[0][1][:200]


def test_hotpotqa_official_layout():
    qas = load_qa(HP_OFFICIAL, "hotpotqa_official")
    assert len(qas) == 100
    q = qas[0]
    assert q.question == "If Gallu is a demon Lilu is what?"
    assert q.evidence_titles == ("Alû", "Lilu (mythology)")
    assert q.passages[0][0] == "Demon Dice"


def test_both_hotpotqa_layouts_give_the_same_record(tmp_path):
    """Convert HF-schema records to the official layout by hand: the loaders must agree field by field."""
    raw = [json.loads(line) for line in HP1.read_text().splitlines()[:20]]
    official = [{"_id": r["id"], "question": r["question"], "answer": r["answer"], "type": r["type"],
                 "level": r["level"],
                 "supporting_facts": [[t, s] for t, s in zip(r["supporting_facts"]["title"], r["supporting_facts"]["sent_id"])],
                 "context": [[t, s] for t, s in zip(r["context"]["title"], r["context"]["sentences"])]}
                for r in raw]
    path = tmp_path / "official.json"
    path.write_text(json.dumps(official, indent=1))
    assert load_qa(path, "hotpotqa_official") == load_qa(HP1, "hotpotqa_hf")[:20]


def test_nq_open_and_oracle():
    nq = load_qa(NQ_OPEN, "nq_open")
    assert len(nq) == 3610 and nq[0].answers == ("14 December 1972 UTC", "December 1972")
    oracle = load_qa(NQ_ORACLE, "nq_oracle")
    assert len(oracle) == 2655
    o = oracle[0]
    assert o.question == "who got the first nobel prize in physics" and o.answers == ("Wilhelm Conrad Röntgen",)
    assert o.evidence_titles == ("List of Nobel laureates in Physics",) and "Röntgen" in o.passages[0][1]
    # one question, one id, whichever file it comes from
    by_q = {q.question: q for q in nq}
    assert all(by_q[q.question].qid == q.qid and by_q[q.question].answers == q.answers for q in oracle)


def test_wiki18_passages():
    ps = list(iter_passages(WIKI, "wiki18"))
    assert len(ps) == 1000
    assert (ps[0].key, ps[0].title) == ("wiki18:0", "Evan Morris")      # quoted title unquoted
    assert ps[0].text.startswith("Evan Morris Evan L. Morris (January 26, 1977")
    absalon = [p for p in ps if p.title == "Absalon"]                    # unquoted titles occur too
    assert absalon and all(not p.title.startswith('"') for p in ps)


def test_corpus_texts_still_feeds_the_tokenizer():
    texts = list(corpus_texts(DATA))
    assert len(texts) > 15000
    assert "Evan Morris\nEvan Morris Evan L. Morris" in texts[0]
    assert any(t.startswith("who got the first nobel prize in physics") for t in texts)


# ------------------------------------------------------------------------------------------ bad input

def _jsonl(path, records):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def test_malformed_record_names_file_line_and_field(tmp_path):
    good = {"question": "who?", "answer": ["me"]}
    p = _jsonl(tmp_path / "nq.jsonl", [good, good, {"question": "who?"}])
    with pytest.raises(DataFormatError, match=r"nq\.jsonl:3: field 'answer': missing") as e:
        load_qa(p, "nq_open")
    assert e.value.field == "answer" and e.value.where.endswith("nq.jsonl:3")
    p = _jsonl(tmp_path / "bad.jsonl", [good, '{"question": "x", '])
    with pytest.raises(DataFormatError, match=r"bad\.jsonl:2: field '<json>': invalid JSON"):
        load_qa(p, "nq_open")
    p = _jsonl(tmp_path / "type.jsonl", [{"question": "who?", "answer": "me"}])
    with pytest.raises(DataFormatError, match=r"type\.jsonl:1: field 'answer': expected list, got str"):
        load_qa(p, "nq_open")
    # the official (JSON array) layout names the record index
    rec = json.loads(HP_OFFICIAL.read_text())[:3]
    del rec[2]["supporting_facts"]
    (tmp_path / "off.json").write_text(json.dumps(rec))
    with pytest.raises(DataFormatError, match=r"off\.json\[record 2\]: field 'supporting_facts': missing"):
        load_qa(tmp_path / "off.json", "hotpotqa_official")
    # gzipped oracle, nested field
    rec = {"question": "q", "answers": ["a"], "ctxs": [{"title": "T"}]}
    with gzip.open(tmp_path / "o.jsonl.gz", "wt") as f:
        f.write(json.dumps(rec) + "\n")
    with pytest.raises(DataFormatError, match=r"o\.jsonl\.gz:1 ctxs\[0\]: field 'text': missing"):
        load_qa(tmp_path / "o.jsonl.gz", "nq_oracle")
    _jsonl(tmp_path / "w.jsonl", [{"id": "1", "contents": "no title line"}])
    with pytest.raises(DataFormatError, match=r"w\.jsonl:1: field 'contents'"):
        list(iter_passages(tmp_path / "w.jsonl", "wiki18"))


def _cfg_with(bench_cfg, **changes):
    cfg = copy.deepcopy(bench_cfg)
    for k, v in changes.items():
        cfg[k] = v
    return cfg


def _assert_nothing_written(tmp_path):
    assert not any((tmp_path / "out").glob("*")) and not (tmp_path / "stats.csv").exists()


def test_missing_file_names_path_and_config_key(bench_cfg, tmp_path):
    cfg = copy.deepcopy(bench_cfg)
    cfg["sources"]["nq"][0]["path"] = "nq/not-there.jsonl.gz"
    with pytest.raises(MissingDataError) as e:
        build_benchmarks(cfg, DATA, 1, tmp_path / "out", tmp_path / "stats.csv")
    msg = str(e.value)
    assert "benchmarks.sources.nq[0].path" in msg and str(DATA / "nq/not-there.jsonl.gz") in msg
    _assert_nothing_written(tmp_path)


def test_unknown_source_is_a_config_error(bench_cfg, tmp_path):
    cfg = copy.deepcopy(bench_cfg)
    cfg["qn"]["sources"] = ["hotpotqa", "triviaqa"]
    with pytest.raises(DataConfigError, match="unknown source 'triviaqa'"):
        build_benchmarks(cfg, DATA, 1, tmp_path / "out", tmp_path / "stats.csv")
    _assert_nothing_written(tmp_path)


def test_n_larger_than_pool_is_a_config_error(bench_cfg, tmp_path):
    cfg = copy.deepcopy(bench_cfg)
    cfg["qn"]["sets"].append({"n": 500, "split": "test", "tasks": 1})  # hotpotqa test pool is ~340
    with pytest.raises(DataConfigError, match=r"q500_test: a task needs 500 distinct hotpotqa questions"):
        build_benchmarks(cfg, DATA, 1, tmp_path / "out", tmp_path / "stats.csv")
    _assert_nothing_written(tmp_path)


def test_cli_reports_bad_config_without_traceback(bench_cfg, tmp_path, capsys):
    from memopd.cli import main

    cfg = _cfg_with(bench_cfg, compose="interleaved")
    with pytest.raises(SystemExit) as e:
        main(["benchmarks", "--cfg", json.dumps(cfg), "--data-dir", str(DATA),
              "--out-dir", str(tmp_path / "out"), "--stats", str(tmp_path / "stats.csv")])
    assert e.value.code == 2 and "benchmarks.compose: 'interleaved'" in capsys.readouterr().err
    _assert_nothing_written(tmp_path)


def test_failure_while_writing_leaves_no_partial_output(composed, tmp_path, monkeypatch):
    import pyarrow.parquet as pqmod

    rows, stats = composed
    calls = {"n": 0}
    real = pqmod.write_table

    def failing(table, where, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full")
        return real(table, where, **kw)

    monkeypatch.setattr(pqmod, "write_table", failing)
    with pytest.raises(OSError, match="disk full"):
        write(rows, stats, tmp_path / "out", tmp_path / "stats.csv", {})
    _assert_nothing_written(tmp_path)


# ---------------------------------------------------------------------------------------- composition

def test_tasks_respect_n_and_carry_aliases(composed, bench_cfg):
    rows, _ = composed
    assert set(rows) == {"q2_train", "q2_test", "q8_test", "q16_test", "wikirag_train", "wikirag_test"}
    for ts in task_sets(BenchmarksConfig.from_dict(bench_cfg)):
        tasks = rows[ts.name]
        assert len(tasks) == ts.tasks
        for t in tasks:
            assert t["n"] == ts.n == len(t["questions"]) == len(t["answers"]) == len(t["qids"]) == len(t["sources"])
            assert len(set(t["qids"])) == ts.n                      # no question twice in a task
            assert len(t["answer"].split("; ")) == ts.n and len(t["question"].split("?; ")) == ts.n
            assert all(a for a in t["answers"]) and t["answer"].split("; ")[0] == t["answers"][0][0]
            if ts.benchmark != "wikirag":                           # same_source: one data set per task
                assert len(set(t["sources"])) == 1 and t["source"] == t["sources"][0]


def test_train_and_test_pools_are_disjoint(composed):
    rows, _ = composed
    ids = {split: {q for name, ts in rows.items() if name.endswith(split) for t in ts for q in t["qids"]}
           for split in ("_train", "_test")}
    texts = {split: {q.lower() for name, ts in rows.items() if name.endswith(split) for t in ts for q in t["questions"]}
             for split in ("_train", "_test")}
    assert ids["_train"] and ids["_test"] and not ids["_train"] & ids["_test"]
    assert not texts["_train"] & texts["_test"]
    # within a test benchmark sized to its pool, no question repeats
    q16 = [q for t in rows["q16_test"] for q in t["qids"]]
    assert len(q16) == len(set(q16)) == 400


def test_composition_is_deterministic(bench_cfg, composed):
    again = compose(BenchmarksConfig.from_dict(bench_cfg), DATA, seed=1234, log=lambda *a: None)
    assert again == composed
    other = compose(BenchmarksConfig.from_dict(bench_cfg), DATA, seed=99, log=lambda *a: None)
    assert other[0]["q2_test"] != composed[0]["q2_test"]


def test_split_does_not_depend_on_file_order(bench_cfg):
    cfg = copy.deepcopy(bench_cfg)
    cfg["sources"]["hotpotqa"] = cfg["sources"]["hotpotqa"][::-1]
    a, _ = load_pools(BenchmarksConfig.from_dict(bench_cfg), DATA, 7)
    b, _ = load_pools(BenchmarksConfig.from_dict(cfg), DATA, 7)
    assert {s: {k: [q.qid for q in v] for k, v in p.items()} for s, p in a.items()} == \
           {s: {k: [q.qid for q in v] for k, v in p.items()} for s, p in b.items()}
    # the official-layout file is train-only (pool: train)
    official = {q.qid for q in load_qa(HP_OFFICIAL, "hotpotqa_official")}
    assert official <= {q.qid for q in a["hotpotqa"]["train"]}


def test_mixed_composition_interleaves_sources(bench_cfg):
    cfg = _cfg_with(bench_cfg, compose="mixed")
    cfg["qn"]["sets"] = [{"n": 2, "split": "test", "tasks": 20}, {"n": 3, "split": "test", "tasks": 20}]
    rows, stats = compose(BenchmarksConfig.from_dict(cfg), DATA, seed=5, log=lambda *a: None)
    for t in rows["q2_test"]:
        assert sorted(t["sources"]) == ["hotpotqa", "nq"] and t["source"] == "mixed"
    counts = [t["sources"].count("hotpotqa") for t in rows["q3_test"]]
    assert set(counts) == {1, 2} and sum(counts) == 30   # the starting source alternates over tasks
    assert {(r["benchmark"], r["source"]): r["questions"] for r in stats}[("q3", "nq")] == 30


def test_stats_and_written_files_agree(composed, tmp_path):
    rows, stats = composed
    write(rows, stats, tmp_path / "out", tmp_path / "stats.csv", {"seed": 1234})
    lines = (tmp_path / "stats.csv").read_text().splitlines()
    assert lines[0] == "benchmark,split,source,tasks,questions"
    table = {tuple(l.split(",")[:3]): tuple(map(int, l.split(",")[3:])) for l in lines[1:]}
    assert table[("q16", "test", "all")] == (25, 400) and table[("q2", "train", "all")] == (800, 1600)
    for name, tasks in rows.items():
        back = read_tasks(tmp_path / "out" / f"{name}.parquet")
        assert back == tasks
        b, s = name.split("_")
        assert table[(b, s, "all")] == (len(tasks), sum(t["n"] for t in tasks))
        assert json.loads(pq.read_schema(tmp_path / "out" / f"{name}.parquet").metadata[b"memopd"])["seed"] == 1234


def test_keys_left_out_take_the_defaults_the_config_documents(bench_cfg, composed):
    """config/config.yaml states `test_fraction: 0.3` and `compose: same_source` and leaves most `pool`s out (split,
    its comment says): the reverse config, those two left out and every pool stated, composes the same tasks."""
    cfg = copy.deepcopy(bench_cfg)
    assert (cfg.pop("test_fraction"), cfg.pop("compose")) == (0.3, "same_source")
    for entries in cfg["sources"].values():
        for e in entries:
            e.setdefault("pool", "split")
    assert compose(BenchmarksConfig.from_dict(cfg), DATA, seed=1234, log=lambda *a: None) == composed


def test_the_benchmark_statistics_rebuild_from_each_tasks_sources_alone(composed, tmp_path):
    """What an archive keeps of the benchmarks (per task: id, qids, sources; memopd.report.archived_tables) rebuilds
    the statistics CSV the benchmark step wrote, byte for byte, in the config's order of sets."""
    from memopd.report.archived_tables import keep_tasks, rebuild_benchmarks

    rows, stats = composed
    write(rows, stats, tmp_path / "out", tmp_path / "stats.csv", {"seed": 1234})
    for name in rows:
        keep_tasks(tmp_path / "out" / f"{name}.parquet", tmp_path / "archive")
    rebuild_benchmarks(list(rows), tmp_path / "archive", tmp_path / "rebuilt.csv")
    assert (tmp_path / "rebuilt.csv").read_bytes() == (tmp_path / "stats.csv").read_bytes()
    with gzip.open(tmp_path / "archive/benchmarks/q2_train.csv.gz", "rt") as f:
        kept = list(csv.DictReader(f))
    assert [(k["task_id"], k["qids"].split()) for k in kept] == [(t["task_id"], t["qids"]) for t in rows["q2_train"]]
