"""The controlled study's knowledge base: seeded, disjoint pools, every answer stated by its gold passage,
look-alike people, and files the loaders and the retrieval read unchanged."""
import json

import pytest

from memopd.config import KBConfig
from memopd.data.kb import ATTRIBUTES, aliases, generate, passages, write
from memopd.data.loaders import iter_passages, load_qa
from memopd.metrics import exact_match

CFG = KBConfig(people=60, first_names=8, surnames=10, values=12)


def test_same_seed_same_files_other_seed_other_files(tmp_path):
    write(CFG, 3, tmp_path / "a"), write(CFG, 3, tmp_path / "b"), write(CFG, 4, tmp_path / "c")
    for name in ("passages.jsonl", "train.jsonl", "test.jsonl"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()
        assert (tmp_path / "a" / name).read_text() != (tmp_path / "c" / name).read_text()


def test_pools_are_disjoint_people_of_the_configured_sizes(tmp_path):
    write(CFG, 0, tmp_path)
    kb = json.loads((tmp_path / "kb.json").read_text())
    pools = {}
    for p in kb["people"]:
        pools.setdefault(p["pool"], set()).add(p["name"])
    assert sum(map(len, pools.values())) == 60 == len(set().union(*pools.values()))
    assert (len(pools["test"]), len(pools["dev"])) == (round(0.25 * 60), round(0.15 * 60))
    asked = {pool: {q.question for q in load_qa(tmp_path / f"{pool}.jsonl", "nq_oracle")} for pool in pools}
    for pool, qs in asked.items():
        assert len(qs) == len(pools[pool]) * len(ATTRIBUTES)  # one question per (person, attribute)
        for q in qs:  # the person asked about is in this pool and in no other
            owners = {o for o, names in pools.items() if any(n in q for n in names)}
            assert owners == {pool}, q


def test_every_answer_is_stated_in_its_gold_passage_and_the_corpus(tmp_path):
    write(CFG, 1, tmp_path)
    corpus = {(p.title, p.text) for p in iter_passages(tmp_path / "passages.jsonl", "wiki18")}
    assert len(corpus) == 2 * 60  # two passages per person
    for pool in ("train", "dev", "test"):
        for qa in load_qa(tmp_path / f"{pool}.jsonl", "nq_oracle"):
            assert len(qa.passages) == 1 and qa.passages[0] in corpus
            title, text = qa.passages[0]
            assert title in qa.question and qa.answers[0] in text
            assert all(exact_match(a, list(qa.answers)) for a in qa.answers)


def test_look_alikes_share_names_and_values():
    people = generate(CFG, 2)
    firsts = [p.name.split()[0] for p in people]
    assert len(set(firsts)) <= 8 < len(people)  # 60 people over 8 first names: look-alikes
    for a in ATTRIBUTES:  # every value word is shared (60 people, 12 values), and never a name
        vals = [p.facts[a.name] for p in people]
        assert len(set(vals)) < len(vals)
    words = {w for p in people for w in p.name.split()}
    assert not words & {w for p in people for v in p.facts.values() for w in v.split()}


def test_each_passage_states_two_facts_of_one_person():
    people = generate(CFG, 5)
    for title, text in passages(people, 5):
        person = next(p for p in people if p.name == title)
        stated = [a for a in ATTRIBUTES if person.facts[a.name] in text]
        assert len(stated) == 2 and text.count(".") == 2


def test_aliases_drop_the_suffix_only():
    employer = next(a for a in ATTRIBUTES if a.name == "employer")
    assert aliases(employer, "Quenda Guild") == ["Quenda Guild", "Quenda"]
    birthplace = next(a for a in ATTRIBUTES if a.name == "birthplace")
    assert aliases(birthplace, "Tolvar") == ["Tolvar"]


def test_too_few_names_for_the_people_is_refused():
    with pytest.raises(ValueError, match="names"):
        KBConfig(people=100, first_names=5, surnames=5)


def test_the_tokenizer_corpus_reads_the_listed_files_only(tmp_path):
    from memopd.data import corpus_texts

    write(CFG, 0, tmp_path)
    files = [{"format": "wiki18", "path": "passages.jsonl"}, {"format": "nq_oracle", "path": "train.jsonl"}]
    texts = list(corpus_texts(tmp_path, files))
    n_train = sum(1 for _ in open(tmp_path / "train.jsonl"))
    assert len(texts) == 2 * 60 + 2 * n_train  # every passage; every question, then its gold passage
    first = json.loads(open(tmp_path / "passages.jsonl").readline())["contents"].replace('"', "")
    assert texts[0] == first
    test_q = json.loads(open(tmp_path / "test.jsonl").readline())["question"]
    assert not any(t.startswith(test_q) for t in texts)  # a file not listed is not read


def test_dev_pool_composes_dev_tasks_apart_from_train_and_test(tmp_path):
    from memopd.config import BenchmarksConfig
    from memopd.data.compose import compose

    write(CFG, 5, tmp_path)
    cfg = {"sources": {"kb": [{"format": "nq_oracle", "path": f"{p}.jsonl", "pool": p} for p in ("train", "dev", "test")]},
           "qn": {"sources": ["kb"], "sets": [{"n": 2, "split": s, "tasks": 6} for s in ("train", "dev", "test")]}}
    rows, stats = compose(BenchmarksConfig.from_dict(cfg), tmp_path, seed=1, log=lambda *a: None)
    pool_of = {q.qid: p for p in ("train", "dev", "test") for q in load_qa(tmp_path / f"{p}.jsonl", "nq_oracle")}
    for split in ("train", "dev", "test"):  # every question of a set comes from its own pool's file
        assert {pool_of[q] for t in rows[f"q2_{split}"] for q in t["qids"]} == {split}
    assert {(r["split"], r["tasks"]) for r in stats if r["source"] == "all"} == {("train", 6), ("dev", 6), ("test", 6)}
    # without a dev source a dev set has no questions to draw: a config error naming it
    cfg["sources"]["kb"] = [e for e in cfg["sources"]["kb"] if e["pool"] != "dev"]
    with pytest.raises(ValueError, match="q2_dev"):
        compose(BenchmarksConfig.from_dict(cfg), tmp_path, seed=1, log=lambda *a: None)
