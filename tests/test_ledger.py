"""The exact call ledger (memopd.ledger, `memopd ledger check|write`): our episodes round-trip through it under every
memory rule, and a ledger that breaks the format is refused with the line, episode, call and offset named."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from memopd.ledger import LedgerError, read_ledger, spans_of, write_ledger
from memopd.records import save_episodes
from memopd.synthetic import RULES, random_episode

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 16}


def _episodes(seed=0):
    rng = random.Random(seed)
    pool = list(range(3, 400))
    eps = [random_episode(rng, pool, rule, 4, 6, (3, 9), (2, 7), task_id=f"t{i}") for i, rule in enumerate(RULES)]
    for ep in eps:
        for inv in ep.invocations:
            inv.logprobs = [-rng.random() for _ in inv.output_ids]
    return eps


def test_every_rules_episodes_round_trip_and_the_spans_cover_each_input(tmp_path):
    eps = _episodes()
    assert any(inv.retained for ep in eps for inv in ep.invocations)  # copies to check provenance on
    write_ledger(tmp_path / "l.jsonl", eps, SAMPLING, "tok", 3)
    head, got = read_ledger(tmp_path / "l.jsonl")
    assert head["version"] == 1 and head["sampling"] == SAMPLING and head["weight_version"] == 3
    for ep, le in zip(eps, got):
        back = le.to_episode()
        assert back.prefix_len == ep.prefix_len and le.sampling == SAMPLING and le.weight_version == 3
        for a, b in zip(ep.invocations, back.invocations):
            assert (a.input_ids, a.output_ids, a.logprobs) == (b.input_ids, b.output_ids, b.logprobs)
            assert sorted(a.retained, key=lambda r: r.dst_start) == b.retained
            kinds = [None] * len(a.input_ids)  # by hand: every input token in exactly one span
            for s in spans_of(a, ep.prefix_len):
                for i in range(s["start"], s["end"]):
                    assert kinds[i] is None
                    kinds[i] = s["kind"]
            assert None not in kinds and kinds[: ep.prefix_len] == ["prefix"] * ep.prefix_len


def _break(tmp_path, edit):
    eps = _episodes()
    write_ledger(tmp_path / "l.jsonl", eps, SAMPLING)
    lines = (tmp_path / "l.jsonl").read_text().splitlines()
    docs = [json.loads(x) for x in lines]
    edit(docs)
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    return tmp_path / "bad.jsonl"


def _first_retained(docs):
    for e, d in enumerate(docs[1:], 1):
        for t, c in enumerate(d["calls"]):
            for s in c["spans"]:
                if s["kind"] == "retained":
                    return d, c, s, t
    raise AssertionError("no retained span")


def _copy_changed(docs):
    d, c, s, _ = _first_retained(docs)
    c["input_ids"][s["start"] + 1] += 1


def _gap(docs):
    docs[2]["calls"][1]["spans"][1]["start"] += 1


def _prefix(docs):
    docs[1]["calls"][2]["input_ids"][3] = 399


def _logprobs(docs):
    docs[3]["calls"][0]["logprobs"].pop()


def _from_later(docs):
    d, c, s, t = _first_retained(docs)
    s["from_call"] = t


@pytest.mark.parametrize("edit, said", [
    (_copy_changed, r"line \d+ \(episode 'e\d'\) call \d span \d+: offset \d+: token \d+ is not call \d's action token"),
    (_gap, r"line 3 \(episode 'e1'\) call 1 span 1: offset \d+: spans must cover the input in order"),
    (_prefix, r"line 2 \(episode 'e0'\) call 2: offset 3: the input does not start with the episode's prefix"),
    (_logprobs, r"line 4 \(episode 'e2'\) call 0: logprobs must hold one value per action token"),
    (_from_later, r"call (\d) span \d+: offset \d+: from_call \1 is not an earlier call"),
    (lambda docs: docs[0].update(version=2), r"line 1: version 2; this code reads version 1"),
])
def test_a_broken_ledger_is_refused_naming_where(tmp_path, edit, said):
    with pytest.raises(LedgerError, match=said):
        read_ledger(_break(tmp_path, edit))


def test_the_cli_checks_in_one_line_and_writes_from_our_episodes(tmp_path):
    eps = _episodes(1)
    save_episodes(tmp_path / "eps.parquet", eps)
    run = lambda *a: subprocess.run([sys.executable, "-m", "memopd.cli", "ledger", *a], capture_output=True,  # noqa: E731
                                    text=True, timeout=120, cwd=tmp_path)
    r = run("write", "--cfg", json.dumps(SAMPLING), "--episodes", "eps.parquet", "--out", "l.jsonl")
    assert r.returncode == 0, r.stderr
    r = run("check", "l.jsonl")
    calls = sum(len(e.invocations) for e in eps)
    assert r.returncode == 0 and f"{len(eps)} episodes, {calls} calls" in r.stdout and r.stdout.strip().endswith("valid")
    (tmp_path / "l.jsonl").write_text((tmp_path / "l.jsonl").read_text().replace('"kind": "prefix"', '"kind": "prefx"', 1))
    before = sorted(p.name for p in tmp_path.iterdir())
    r = run("check", "l.jsonl")
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "line 2 (episode 'e0') call 0 span 0: kind 'prefx' is not one of" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_the_documented_example_is_a_valid_ledger(tmp_path):
    from agent_support import ROOT

    text = (ROOT / "docs/ledger.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```json\n")[1:]]
    assert len(blocks) == 2
    (tmp_path / "doc.jsonl").write_text("".join(json.dumps(json.loads(b)) + "\n" for b in blocks))
    head, (ep,) = read_ledger(tmp_path / "doc.jsonl")
    assert ep.calls[1].retained[0].src_call == 0 and ep.calls[0].top_logprobs[1][1] == [71, -1.40]
