"""Teacher trajectories: the scripted teacher through the real rollout loop (real tokenizer, real BM25
over real passages, real NQ questions), its honesty and budget, the `memopd sft trajectories` CLI, and
the LLM teacher (request/response handling on CPU; a real vLLM server and engine on GPU)."""
from __future__ import annotations

import importlib.util
import json
import re
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, HTTPServer

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from agent_support import ListBackend, ROOT, nq_tasks, random_student, retriever, tokenizer
from memopd.teachers.llm import LLMConfig, LLMTeacher, completion_generation, cut_after_action
from memopd.agent.protocol import Task, parse_response, prefix_ids
from memopd.agent.rollout import rollout
from memopd.config import AgentConfig
from memopd.teachers.scripted import ScriptedConfig, ScriptedTeacher, _find, evidence, keywords, memory_claims, passages
from memopd.teachers.trajectories import FILTER_PREVIEW, summarize, unsupported_claims
from memopd.records import load_episodes

CFG = AgentConfig(turns={"default": 6}, max_observation_tokens=128, batch_size=8, reward="f1")


def _roll(tasks, cfg=CFG, seed=0, **teacher_kw):
    tok = tokenizer()
    teacher = ScriptedTeacher(tok, tasks, ScriptedConfig(**teacher_kw))
    return rollout(tasks, teacher, tok, retriever(), cfg, seed=seed, progress=False), teacher


def _outs(ep):
    return [tokenizer().decode(i.output_ids, skip_special_tokens=False) for i in ep.invocations]


def test_scripted_episodes_are_valid_honest_records():
    tasks = nq_tasks(10, n_questions=2)
    eps, teacher = _roll(tasks)
    tok = tokenizer()
    for ep, task in zip(eps, tasks):
        ep.validate()
        assert ep.metrics["invalid_actions"] == 0 and ep.metrics["end_reason"] == "answer"
        assert len(ep.invocations) <= 6 and ep.metrics["searches"] >= 2
        assert all(parse_response(o).valid for o in _outs(ep))
        assert ep.invocations[0].input_ids == prefix_ids(tok, task, 6)
        assert ep.reward == ep.metrics["f1"]
        assert unsupported_claims(ep, tok) == []  # every memory claim is in a passage it saw
    claims = [c for ep in eps for o in _outs(ep) for c in memory_claims(o)]
    assert len(claims) >= 5, "the teacher found (almost) nothing: the honesty check would be vacuous"
    s = summarize(eps, tok)
    assert s["f1"] > 0.3 and s["invalid_action_rate"] == 0 and s["unsupported_memory_claims"] == 0
    assert s["turn_examples"] == sum(len(e.invocations) for e in eps)
    assert teacher.fits["truncated"] == 0


def test_memory_carries_findings_forward():
    (ep,), _ = _roll(nq_tasks(1, n_questions=2, start=2))
    outs = _outs(ep)
    assert outs[0] == f"<think>Searching Q1.</think><search>{ep.metrics['questions'][0].strip()}</search>"
    lines = [re.search(r"Q1: .*", o).group(0) for o in outs[1:]]
    final = next(k for k, x in enumerate(lines) if x != "Q1: not found yet")  # Q1's finding (after a retry or not)
    assert all(x == lines[final] for x in lines[final:])  # ... survives every later rewrite (summary_replacement)
    assert outs[-1].endswith("</answer>") and len(ep.metrics["predictions"]) == 2


def test_claim_checker_catches_an_unsupported_claim():
    """The honesty check can fail: a policy that writes an answer no passage showed is caught."""
    tok, task = tokenizer(), nq_tasks(1, n_questions=2)[0]
    backend = ListBackend(tok, [f"<think>Searching Q1.</think><search>{task.questions[0]}</search>",
                                "<think>Q1: Zyxwv Qutrb (Doc 1)\nSearching Q2.</think><search>x</search>",
                                "<think>done</think><answer>a; b</answer>"])
    (ep,) = rollout([task], backend, tok, retriever(), replace(CFG, batch_size=1), progress=False)
    assert unsupported_claims(ep, tok) == [(1, 1, "Zyxwv Qutrb")]


def test_deterministic_given_the_seed():
    tasks = nq_tasks(6, n_questions=2, start=20)
    ids = lambda eps: [[(i.input_ids, i.output_ids) for i in e.invocations] for e in eps]  # noqa: E731
    a, b = _roll(tasks, seed=5, keywords_prob=0.5)[0], _roll(tasks, seed=5, keywords_prob=0.5)[0]
    assert ids(a) == ids(b)
    c = _roll(tasks, seed=6, keywords_prob=0.5)[0]
    assert [e.metrics["queries"] for e in a] != [e.metrics["queries"] for e in c]  # the seed draws the query style


def test_turn_budget_respected():
    tasks = nq_tasks(3, n_questions=4, start=40)
    for budget in (1, 3, 5):
        eps, _ = _roll(tasks, cfg=replace(CFG, turns={"default": budget}))
        for ep in eps:
            assert len(ep.invocations) <= budget and ep.metrics["end_reason"] == "answer"
            assert len(ep.metrics["predictions"]) == 4  # one answer per question, 'unknown' if unsearched
        if budget == 1:
            assert all(e.metrics["predictions"] == ["unknown"] * 4 for e in eps)
        if budget == 3:  # two searches, then the answer; no retry (it would leave a question unsearched)
            assert all(e.metrics["searches"] == 2 and e.metrics["predictions"][2:] == ["unknown"] * 2 for e in eps)


def test_unretrievable_answer_is_wrong_and_filtered():
    real = nq_tasks(1)[0]
    task = Task("nope", ["Which zorblax founded the quuxland glimmer guild?", real.questions[0]],
                [["Xyzzyplugh Flimflam"], real.answers[0]], "q2")
    (ep,), _ = _roll([task], unsupported="unknown")
    outs = _outs(ep)
    assert ep.metrics["queries"][:2] == [task.questions[0], keywords(task.questions[0])]  # retried, reformulated
    assert "Q1: not found yet" in outs[1] and "Q1: not found\n" in outs[2]
    assert ep.metrics["predictions"][0] == "unknown" and ep.metrics["f1"] <= 0.5
    assert not FILTER_PREVIEW[1][1](ep)  # the F1 == 1 filter drops it
    (g,), _ = _roll([task], unsupported="guess")  # a guess: the title of the top passage of the last search
    assert re.search(r"Q1: not found \(guess: .+\)", _outs(g)[-1]) and g.metrics["predictions"][0] != "unknown"


def test_token_budget_shortens_instead_of_truncating():
    tasks = nq_tasks(6, n_questions=2, start=60)
    eps, teacher = _roll(tasks, max_new_tokens=28)
    assert all(len(i.output_ids) <= 28 for e in eps for i in e.invocations)
    assert teacher.fits["short"] > 0 and sum(e.metrics["invalid_actions"] for e in eps) == teacher.fits["truncated"]
    assert all(unsupported_claims(e, tokenizer()) == [] for e in eps)


def test_evidence_quote_by_hand():
    """`evidence` on hand-made passages; the expected quotes are written out by hand."""
    docs = [(1, "Mark Lawrence (ice hockey)", ("Mark Jay Lawrence (born January 27, 1972) is a Canadian ice hockey "
             "winger who played for the Dallas Stars and the New York Islanders. He was born in Burlington.")),
            (2, "Sir Syed University", "The university is honored in the name of Sir Syed.")]
    def quote(alias, words):
        m, _, title_len = _find([alias], docs)
        return evidence(m, words, title_len)

    assert quote("Burlington", 16) == "He was born in Burlington."  # the whole sentence fits
    assert quote("Burlington", 2) == "in Burlington."
    # too long: the words before the span (up to 3 after it; none here), the sentence's end kept
    assert quote("New York Islanders", 8) == "the Dallas Stars and the New York Islanders."
    # no word before the span: all the room goes after it
    assert quote("Mark Jay Lawrence", 16) == \
        "Mark Jay Lawrence (born January 27, 1972) is a Canadian ice hockey winger who played for"
    assert quote("Canadian", 4) == "Canadian ice hockey winger"  # 3 words after the span first
    assert quote("ice hockey", 3) == "ice hockey winger"  # in the title and the text: quoted from the text
    assert quote("Canadian", 6) == "is a Canadian ice hockey winger"  # ... then the words before it
    assert quote("Sir Syed University", 16) == "Sir Syed University"  # in the title only: the title
    assert quote("Sir Syed University", 1) == "Sir Syed University"  # the span is never cut


def test_evidence_is_the_passage_read_then_dropped():
    """With `evidence` a finding's turn quotes the passage it came from (words of that passage, the span
    inside, at most N words), the next turn's memory no longer has it, and every decision is the same."""
    tasks = nq_tasks(8, n_questions=2, start=100)
    plain, _ = _roll(tasks)
    quoted, teacher = _roll(tasks, evidence=12)
    tok, n = tokenizer(), 0
    for a, b in zip(plain, quoted):
        assert a.metrics["queries"] == b.metrics["queries"] and a.metrics["predictions"] == b.metrics["predictions"]
        outs = _outs(b)
        for t, o in enumerate(outs):
            q = re.search(r'<think>Doc (\d+): "(.*)"\nQ', o)
            if not q:
                continue
            n += 1
            k, text = int(q.group(1)), q.group(2)
            prompt = tok.decode(b.invocations[t].input_ids, skip_special_tokens=False)
            obs = prompt[prompt.rfind("<information>") + len("<information>"): prompt.rfind("</information>")]
            body = next(f"{title} {p}" for j, title, p in passages(obs) if j == k)
            assert text in " ".join(body.replace(";", ",").split()) and 1 <= len(text.split()) <= 12
            searched = int(re.search(r"Searching Q(\d+)\.", tok.decode(b.invocations[t - 1].output_ids)).group(1))
            claim = re.search(rf"^Q{searched}: (.*) \(Doc {k}\)$", o.split("</think>")[0], re.M).group(1)
            assert claim.lower() in text.lower()
            if t + 1 < len(outs):
                assert q.group(0)[len("<think>"):-2] not in outs[t + 1]  # this quote line is gone
    assert n >= 4 and teacher.fits["truncated"] == 0
    with pytest.raises(ValueError, match="evidence"):
        ScriptedConfig(evidence=-1)


def test_same_decisions_under_every_rule_that_keeps_the_memory():
    tasks = nq_tasks(4, n_questions=2, start=80)
    preds = {rule: [e.metrics["predictions"] for e in _roll(tasks, cfg=replace(CFG, rule=rule))[0]]
             for rule in ("summary_replacement", "full_retention", "sliding_window", "retrieval_refresh")}
    assert len({json.dumps(p) for p in preds.values()}) == 1, preds


def test_cli_writes_trajectories_and_stats(tmp_path, capsys):
    import yaml

    from memopd.cli import main

    tok = tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    retriever().save(tmp_path / "index")  # a real saved BM25 index, opened by memopd.retrieval
    tasks = nq_tasks(5, n_questions=2, start=100)
    pq.write_table(pa.table({"task_id": [t.task_id for t in tasks], "questions": [t.questions for t in tasks],
                             "answers": [t.answers for t in tasks], "benchmark": ["q2"] * 5}), tmp_path / "q2.parquet")
    full = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    cfg = {k: full[k] for k in ("teacher", "agent", "rollout")}
    out, stats = tmp_path / "sft/trajectories.parquet", tmp_path / "sft/trajectories_stats.json"
    main(["sft", "trajectories", "--cfg", json.dumps(cfg), "--seed", "3", "--benchmark", str(tmp_path / "q2.parquet"),
          "--index", str(tmp_path / "index"), "--tokenizer", str(tmp_path / "tok"), "--limit", "4",
          "--out", str(out), "--stats", str(stats)])
    eps = load_episodes(out)
    s = json.loads(stats.read_text())
    assert len(eps) == 4 and [e.task_id for e in eps] == [t.task_id for t in tasks[:4]]
    for e in eps:
        e.validate()
        assert e.reward == e.metrics["f1"]  # teacher.reward: f1
    assert s["teacher"] == "scripted" and s["trajectories_generated"] == 4 and s["invalid_action_rate"] == 0
    assert s["f1"] == pytest.approx(sum(e.metrics["f1"] for e in eps) / 4)
    assert s["calls_per_episode"] == pytest.approx(sum(len(e.invocations) for e in eps) / 4)
    assert s["config"]["seed"] == 3 and s["config"]["teacher"]["kind"] == "scripted"
    assert set(s["filter_preview"]) == {"f1>=0.5", "f1==1"} and s["unsupported_memory_claims"] == 0
    assert all(len(i.output_ids) <= cfg["rollout"]["max_new_tokens"] for e in eps for i in e.invocations)
    with pytest.raises(SystemExit) as e:
        main(["sft", "trajectories", "--cfg", json.dumps(cfg), "--benchmark", str(tmp_path / "missing.parquet"),
              "--index", str(tmp_path / "index"), "--tokenizer", str(tmp_path / "tok"), "--out", str(out),
              "--stats", str(stats)])
    assert e.value.code == 2 and "missing.parquet not found" in capsys.readouterr().err


# --- shards: one job per slice of the tasks, resumable chunks, a cheap merge ------------------------------

def _step_inputs(tmp_path, n=7):
    """A saved tokenizer and BM25 index, and n real NQ Q2 tasks over two benchmark files (4 + n-4)."""
    import yaml

    tok = tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    retriever().save(tmp_path / "index")
    tasks = nq_tasks(n, n_questions=2, start=120)
    files = []
    for name, part in (("q2a", tasks[:4]), ("q2b", tasks[4:])):
        files.append(str(tmp_path / f"{name}.parquet"))
        pq.write_table(pa.table({"task_id": [t.task_id for t in part], "questions": [t.questions for t in part],
                                 "answers": [t.answers for t in part], "benchmark": [name] * len(part)}), files[-1])
    full = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    cfg = {k: full[k] for k in ("teacher", "agent", "rollout")}
    return cfg, files, tasks


def _traj(cfg, files, tmp_path, out, shard=None):
    from memopd.teachers.trajectories import trajectories_step

    return trajectories_step(cfg, files, str(tmp_path / "index"), str(tmp_path / "tok"), str(out),
                             str(out.with_name(out.stem + "_stats.json")), seed=5, progress=False, shard=shard)


SUMMARY_KEYS = ("trajectories_generated", "em", "f1", "calls_per_episode", "invalid_action_rate", "answered_rate",
                "turn_examples", "searches_per_episode", "end_reasons", "response_tokens_mean", "response_tokens_max",
                "peak_context_tokens_mean", "filter_preview", "unsupported_memory_claims", "budget_fits",
                "benchmarks")


def test_shards_merged_equal_one_process(tmp_path, capsys):
    """Three shards (chunks of 2 tasks) of 7 tasks over two benchmark files, merged by the CLI: the same
    episodes, in the same order, and the same stats (every figure, to the last bit) as one process playing
    every task at once; each shard holds exactly its slice of that run. The scripted teacher is deterministic
    and every episode is sampled with the seeds of its position in the whole task list, so this is equality,
    not a statistical match. Failed before: one job, no --shard, no merge."""
    from memopd.teachers.shards import shard_bounds
    from memopd.cli import main

    cfg, files, tasks = _step_inputs(tmp_path)
    one = _traj(cfg, files, tmp_path, tmp_path / "one/trajectories.parquet")
    ref = load_episodes(tmp_path / "one/trajectories.parquet")
    assert [e.task_id for e in ref] == [t.task_id for t in tasks] and one["shard"]["chunks"] == 1
    sharded = {**cfg, "teacher": {**cfg["teacher"], "shards": 3, "chunk_tasks": 2}}
    outs = [tmp_path / f"sh/shard_{i}.parquet" for i in range(3)]
    for i, out in enumerate(outs):
        main(["sft", "trajectories", "--cfg", json.dumps(sharded), "--seed", "5", "--benchmark", *files, "--index",
              str(tmp_path / "index"), "--tokenizer", str(tmp_path / "tok"), "--shard", str(i), "--out", str(out),
              "--stats", str(out.with_name(out.stem + "_stats.json"))])
        lo, hi = shard_bounds(len(tasks), 3, i)
        assert load_episodes(out) == ref[lo:hi], i  # the shard is its slice of the one-process run
        assert not out.with_suffix(".parts").exists()  # the chunks go once the shard is written
    assert [load_episodes(o)[0].task_id for o in outs] == ["nq120", "nq122", "nq124"]  # slices [0,2) [2,4) [4,7)
    main(["sft", "merge-trajectories", "--shards", *map(str, outs),
          "--shard-stats", *(str(o.with_name(o.stem + "_stats.json")) for o in outs),
          "--out", str(tmp_path / "merged.parquet"), "--stats", str(tmp_path / "merged_stats.json")])
    assert load_episodes(tmp_path / "merged.parquet") == ref
    merged = json.loads((tmp_path / "merged_stats.json").read_text())
    assert {k: merged[k] for k in SUMMARY_KEYS} == {k: one[k] for k in SUMMARY_KEYS}
    assert set(merged["benchmarks"]) == {"q2a", "q2b"} and merged["rollout"]["episodes"] == 7
    assert [s["tasks"] for s in merged["shards"]] == [[0, 2], [2, 4], [4, 7]]
    assert [s["chunks"] for s in merged["shards"]] == [1, 1, 2]
    with pytest.raises(SystemExit) as e:  # shards out of order are refused
        main(["sft", "merge-trajectories", "--shards", *map(str, outs[1::-1]), "--shard-stats",
              *(str(o.with_name(o.stem + "_stats.json")) for o in outs[1::-1]), "--out", str(tmp_path / "x.parquet"),
              "--stats", str(tmp_path / "x.json")])
    assert e.value.code == 2 and "expected 0 of 2" in capsys.readouterr().err


def test_one_shard_merged_is_the_one_process_file_byte_for_byte(tmp_path):
    """teacher.shards 1 (the embedded default): shard 0 plus the merge give the very bytes of the one-process
    step, which plays the tasks as before sharding existed (one rollout over every task)."""
    from memopd.agent.protocol import load_tasks
    from memopd.teachers.trajectories import merge_step
    from memopd.records import save_episodes

    cfg, files, _ = _step_inputs(tmp_path, n=5)
    tasks = [t for f in files for t in load_tasks(f)]
    _traj(cfg, files, tmp_path, tmp_path / "one.parquet")
    _traj(cfg, files, tmp_path, tmp_path / "shard_0.parquet", shard=0)
    merged = merge_step([str(tmp_path / "shard_0.parquet")], [str(tmp_path / "shard_0_stats.json")],
                        str(tmp_path / "merged.parquet"), str(tmp_path / "merged_stats.json"))
    assert (tmp_path / "merged.parquet").read_bytes() == (tmp_path / "one.parquet").read_bytes()
    tok = tokenizer()
    sc = {**cfg["teacher"]["scripted"], "max_new_tokens": cfg["rollout"]["max_new_tokens"]}
    agent = AgentConfig.from_dict(cfg["agent"], batch_size=cfg["teacher"]["batch_size"], reward="f1")
    before = rollout(tasks, ScriptedTeacher(tok, tasks, ScriptedConfig(**sc)), tok, retriever(), agent, seed=5,
                     progress=False)  # the step before sharding
    save_episodes(tmp_path / "before.parquet", before)
    assert (tmp_path / "before.parquet").read_bytes() == (tmp_path / "one.parquet").read_bytes()
    assert merged["trajectories_generated"] == 5 and merged["shards"][0]["tasks"] == [0, 5]


def test_a_rerun_shard_plays_only_the_chunks_it_lacks(tmp_path, monkeypatch):
    """A shard killed after its first chunk (2 of its 4 tasks) is rerun: it rolls out the second chunk only
    and writes the same file as an uninterrupted run. Chunks of other work (here another seed) are dropped."""
    import memopd.teachers.trajectories as traj
    from memopd.teachers.shards import Chunks

    cfg, files, _ = _step_inputs(tmp_path, n=7)
    cfg = {**cfg, "teacher": {**cfg["teacher"], "shards": 2, "chunk_tasks": 2}}
    _traj(cfg, files, tmp_path, tmp_path / "ref/shard_1.parquet", shard=1)  # tasks [3, 7): chunks [3, 5) [5, 7)
    real, played = traj.rollout, []

    def killed_after_one_chunk(tasks, *a, **kw):
        played.append([t.task_id for t in tasks])
        if len(played) == 2:
            raise KeyboardInterrupt("preempted")
        return real(tasks, *a, **kw)

    out = tmp_path / "run/shard_1.parquet"
    monkeypatch.setattr(traj, "rollout", killed_after_one_chunk)
    with pytest.raises(KeyboardInterrupt):
        _traj(cfg, files, tmp_path, out, shard=1)
    assert not out.exists() and sorted(p.name for p in out.with_suffix(".parts").glob("chunk_*")) == \
        ["chunk_0000.json", "chunk_0000.parquet"]
    played.clear()
    monkeypatch.setattr(traj, "rollout", lambda tasks, *a, **kw: played.append([t.task_id for t in tasks]) or
                        real(tasks, *a, **kw))
    s = _traj(cfg, files, tmp_path, out, shard=1)
    assert played == [["nq125", "nq126"]] and s["shard"]["chunks_resumed"] == 1
    assert out.read_bytes() == (tmp_path / "ref/shard_1.parquet").read_bytes()
    assert s["rollout"]["episodes"] == 4 and s["budget_fits"] == json.loads(
        (tmp_path / "ref/shard_1_stats.json").read_text())["budget_fits"]
    parts = Chunks(tmp_path / "parts", "work A")
    parts.write(0, load_episodes(out)[:1], {"wall_s": 1.0})
    assert Chunks(tmp_path / "parts", "work A").done(0) == {"wall_s": 1.0}
    assert Chunks(tmp_path / "parts", "work B").done(0) is None


def _dry_run(configfile, target="results/sft/trajectories.parquet"):
    import os
    import subprocess
    import sys
    from pathlib import Path

    bin_dir = Path(sys.executable).parent
    args = [str(bin_dir / "snakemake"), target, "-n", "--forceall", "-p"]
    args += ["--configfile", configfile] if configfile else []
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    res = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout + res.stderr


@pytest.mark.parametrize("configfile, shards", [(None, 1), ("config/paper.yaml", 40)])
def test_rule_builds_the_trajectories(configfile, shards):
    """One job per shard (teacher.shards: 1 on the embedded default, 40 of 1,000 tasks at paper scale), each
    with --shard i and its own file, then one merge into results/sft/trajectories.parquet (what the SFT data
    step reads). Failed before: one job of every task at paper scale."""
    import yaml

    out = _dry_run(configfile)
    assert re.search(rf"sft_trajectories\s+{shards}\n", out) and re.search(r"sft_trajectories_merge\s+1\n", out)
    assert sorted(map(int, re.findall(r"--shard (\d+) --out results/sft/trajectories/shard_(?:\d+)\.parquet", out))) \
        == list(range(shards))
    assert sorted(map(int, re.findall(r"output: results/sft/trajectories/shard_(\d+)\.parquet", out))) == \
        list(range(shards))
    merge = re.search(r"merge-trajectories --shards (.*?) --shard-stats", out).group(1).split()
    assert merge == [f"results/sft/trajectories/shard_{i}.parquet" for i in range(shards)]
    cfg = yaml.safe_load((ROOT / (configfile or "config/config.yaml")).read_text())["teacher"]
    assert cfg["shards"] == shards


# --- the LLM teacher ------------------------------------------------------------------------------------

def test_llm_config_and_reply_handling():
    with pytest.raises(ValueError, match="server"):
        LLMConfig(engine="offline", prompt="chat")
    assert cut_after_action("<think>m</think><search>q</search> and more <answer>x</answer>") == \
           ("<think>m</think><search>q</search>", True)
    assert cut_after_action("no action") == ("no action", False)
    g = completion_generation({"text": "", "finish_reason": "stop", "stop_reason": "</search>",
                               "logprobs": {"tokens": ["token_id:5", "token_id:9"], "token_logprobs": [-0.5, -1.0]}}, 2)
    assert (g.output_ids, g.logprobs, g.stop_reason) == ([5, 9], [-0.5, -1.0], "stop")
    g = completion_generation({"token_ids": [4, 2], "finish_reason": "stop", "stop_reason": None,
                               "logprobs": {"token_logprobs": [-0.1, -0.2]}}, 2)
    assert g.stop_reason == "eos" and g.output_ids == [4, 2]


class _StandIn(BaseHTTPRequestHandler):
    """A local stand-in for vLLM's OpenAI-compatible API (vLLM cannot run on CPU): it answers like the
    scripted teacher would, and keeps the request bodies for the test to inspect."""

    teacher: ScriptedTeacher
    bodies: list = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        tok = tokenizer()
        if self.path == "/v1/chat/completions":
            user = body["messages"][1]["content"].split("\n\nContinue:")[0]  # the instruction names the tags
            text = self.teacher.respond("\n" + user)
            ans = {"choices": [{"message": {"content": text + " and text after the action"}, "finish_reason": "stop"}]}
        else:
            ids = tok(self.teacher.respond(tok.decode(body["prompt"])), add_special_tokens=False)["input_ids"]
            ans = {"choices": [{"token_ids": ids, "finish_reason": "stop", "stop_reason": "</search>",
                                "logprobs": {"token_logprobs": [-1.0] * len(ids)}}]}
        data = json.dumps(ans).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("prompt", ["ids", "chat"])
def test_llm_teacher_client_through_the_rollout(prompt):
    tok, tasks = tokenizer(), nq_tasks(3, n_questions=2, start=120)
    _StandIn.teacher, _StandIn.bodies = ScriptedTeacher(tok, tasks), []
    server = HTTPServer(("127.0.0.1", 0), _StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cfg = LLMConfig(model="stand-in", prompt=prompt, sampling={"temperature": 0.7, "max_new_tokens": 99})
        teacher = LLMTeacher(tok, cfg, url=f"http://127.0.0.1:{server.server_port}", max_concurrency=4)
        eps = rollout(tasks, teacher, tok, retriever(), replace(CFG, batch_size=3), seed=1, progress=False)
    finally:
        server.shutdown()
    assert all(e.metrics["invalid_actions"] == 0 and e.metrics["end_reason"] == "answer" for e in eps)
    b = _StandIn.bodies[0]
    assert b["model"] == "stand-in" and b["temperature"] == 0.7 and b["max_tokens"] == 99 and "seed" in b
    assert len({x["seed"] for x in _StandIn.bodies}) == len(_StandIn.bodies)  # one seed per call
    if prompt == "ids":
        sent = sorted(x["prompt"] for x in _StandIn.bodies)  # requests run concurrently: compare as sets
        assert sent == sorted(i.input_ids for e in eps for i in e.invocations) and b["return_tokens_as_token_ids"]
        assert all(i.logprobs == [-1.0] * len(i.output_ids) for e in eps for i in e.invocations)
    else:  # reply text cut after its action and tokenised once by the student tokenizer
        assert all(i.logprobs is None for e in eps for i in e.invocations)
        assert all(tok.decode(i.output_ids).endswith(("</search>", "</answer>")) for e in eps for i in e.invocations)
        later = [m for x in _StandIn.bodies for m in x["messages"] if "Your memory" in m["content"]]
        assert later and all("<|im_start|>" not in m["content"] for m in later)


def test_llm_teacher_shards_send_the_one_process_seeds(tmp_path):
    """The LLM teacher (a stand-in server at teacher.llm.url) in 2 shards of chunks of 2 tasks: every call
    goes out with the seed it has in one process playing all 5 tasks, so a server that samples by the
    request's seed returns the same episodes; the merge then equals the one-process file."""
    from memopd.teachers.trajectories import merge_step

    cfg, files, tasks = _step_inputs(tmp_path, n=5)
    _StandIn.teacher, _StandIn.bodies = ScriptedTeacher(tokenizer(), tasks), []
    server = HTTPServer(("127.0.0.1", 0), _StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    llm = {**cfg["teacher"]["llm"], "model": "stand-in", "prompt": "ids", "url": url}
    one_cfg = {**cfg, "teacher": {**cfg["teacher"], "kind": "llm", "llm": llm}}
    sharded = {**one_cfg, "teacher": {**one_cfg["teacher"], "shards": 2, "chunk_tasks": 2}}
    try:
        one = _traj(one_cfg, files, tmp_path, tmp_path / "one.parquet")
        seeds_one = sorted(b["seed"] for b in _StandIn.bodies)
        _StandIn.bodies.clear()
        for i in range(2):
            _traj(sharded, files, tmp_path, tmp_path / f"shard_{i}.parquet", shard=i)
        seeds_sharded = sorted(b["seed"] for b in _StandIn.bodies)
    finally:
        server.shutdown()
    assert seeds_sharded == seeds_one and len(seeds_one) == one["turn_examples"]
    merged = merge_step([str(tmp_path / f"shard_{i}.parquet") for i in range(2)],
                        [str(tmp_path / f"shard_{i}_stats.json") for i in range(2)],
                        str(tmp_path / "merged.parquet"), str(tmp_path / "merged_stats.json"))
    assert load_episodes(tmp_path / "merged.parquet") == load_episodes(tmp_path / "one.parquet")
    assert merged["server"] == one["server"] == url and merged["model"] == "stand-in"


def test_vllm_server_runs_under_the_steps_own_interpreter(tmp_path, monkeypatch):
    """`vllm serve` is started as `sys.executable -m vllm.entrypoints.cli.main serve` (what the `vllm` script
    runs), whatever PATH holds: Snakemake run as .venv/bin/snakemake without activation has no vllm on PATH
    (so a lookup with shutil.which("vllm") would refuse to start). No server is started here."""
    import sys

    from memopd.teachers.llm import VLLMServer

    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH
    server = VLLMServer("openai/gpt-oss-120b", tmp_path / "vllm.log", seed=3, port=8123, max_model_len=4096)
    assert server.cmd[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "openai/gpt-oss-120b"]
    assert server.cmd[server.cmd.index("--port") + 1] == "8123" and "--max-model-len" in server.cmd
    if importlib.util.find_spec("vllm") is None:  # CPU install: refused when started, naming the interpreter
        with pytest.raises(RuntimeError, match=re.escape(sys.executable)):
            server.__enter__()
        assert server.proc is None and not (tmp_path / "vllm.log").exists()


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (envs/gpu.yaml)")


@pytest.mark.gpu
@needs_vllm
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("engine", ["server", "offline"])
def test_llm_teacher_real_vllm(tmp_path, engine):
    """A real vLLM (tiny student weights, same tokenizer: prompt ids) behind the LLM teacher: seeded,
    exact ids with log-probs, episodes valid through the rollout loop."""
    from memopd.teachers.llm import VLLMServer

    tok = tokenizer()
    random_student(0).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    srv = {"dtype": "float32", "gpu_memory_utilization": 0.3, "max_model_len": 1024}
    cfg = LLMConfig(model=str(tmp_path / "m"), engine=engine, prompt="ids",
                    sampling={"temperature": 1.0, "max_new_tokens": 16}, server=srv)
    tasks = nq_tasks(3, n_questions=2)

    def run(teacher):
        eps = rollout(tasks, teacher, tok, retriever(), replace(CFG, invalid_action="continue", turns={"default": 3}),
                      seed=2, progress=False)
        again = rollout(tasks, teacher, tok, retriever(), replace(CFG, invalid_action="continue", turns={"default": 3}),
                        seed=2, progress=False)
        assert [[i.output_ids for i in e.invocations] for e in eps] == [[i.output_ids for i in e.invocations] for e in again]
        for e in eps:
            e.validate()
            assert all(len(i.logprobs) == len(i.output_ids) for i in e.invocations)

    if engine == "offline":
        run(LLMTeacher(tok, cfg))
    else:
        with VLLMServer(cfg.model, tmp_path / "vllm.log", seed=0, **srv) as server:
            assert server.url.startswith("http://127.0.0.1:")
            run(LLMTeacher(tok, cfg, url=server.url))
