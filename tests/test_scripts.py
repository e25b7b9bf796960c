"""The analysis scripts of workflow/scripts/ (not pipeline steps; docs/outputs.md "Analysis scripts")."""
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "workflow/scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # a dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


def _bench(path: Path, s: float, cpu: float, mtime: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"
                    f"{s}\t0:00:00\t1\t1\t1\t1\t0\t0\t50\t{cpu}\n")
    os.utime(path, (mtime, mtime))


def test_job_times_sums_each_rule_over_its_jobs(tmp_path):
    jt = _load("job_times")
    rules = jt.rules_in(str(ROOT / "workflow/rules"))
    # the workflow's rules, `use rule ... as` included
    assert {"sft_train", "sft_eval", "eval", "audit_episodes", "audit_rule_episodes", "train"} <= set(rules)
    assert "study" in rules  # defined under `if STUDY:`, indented
    jobs = {  # file -> (s, cpu, end time), with the rule each must count under
        "sft_train_student.tsv": (100.0, 90.0, 1000.0, "sft_train"),
        "sft_train_teacher.tsv": (150.0, 140.0, 1200.0, "sft_train"),
        "sft_eval_student_sft.tsv": (7.0, 6.0, 1010.0, "sft_eval"),  # not `eval`: a name, not a substring
        "sft_trajectories_0.tsv": (2.0, 2.0, 905.0, "sft_trajectories"),
        "sft_trajectories_merge.tsv": (1.0, 1.0, 906.0, "sft_trajectories_merge"),  # the longest rule name wins
        "eval_student_sft_q2_test.tsv": (30.0, 25.0, 1100.0, "eval"),
        "audit_episodes.tsv": (5.0, 4.0, 1300.0, "audit_episodes"),
        "audit_rule_episodes_sliding_window.tsv": (9.0, 8.0, 1320.0, "audit_rule_episodes"),
        "fetch_corpus/wiki/x.tsv": (3.0, 1.0, 950.0, "fetch_corpus"),  # a folder names its rule
    }
    for name, (s, cpu, end, _) in jobs.items():
        _bench(tmp_path / name, s, cpu, end)
    table, span = jt.summarise(str(tmp_path), rules)
    want = {}
    for name, (s, cpu, end, rule) in jobs.items():
        w = want.setdefault(rule, [0, 0.0, 0.0])
        w[0], w[1], w[2] = w[0] + 1, w[1] + s, w[2] + cpu
    got = {r.rule: [r.jobs, r.wall_s, r.cpu_s] for r in table.itertuples()}
    assert got == want
    assert table.rule.tolist()[0] == "sft_train" and table.longest_job.tolist()[0] == "sft_train_teacher"
    assert table.wall_s.is_monotonic_decreasing
    assert span == pytest.approx(1320.0 - (1000.0 - 100.0))  # first start (sft_train_student) to last end


def test_job_times_names_a_file_no_rule_explains(tmp_path):
    jt = _load("job_times")
    _bench(tmp_path / "no_such_rule.tsv", 1.0, 1.0, 10.0)
    with pytest.raises(ValueError, match="no_such_rule.tsv"):
        jt.summarise(str(tmp_path), jt.rules_in(str(ROOT / "workflow/rules")))
    with pytest.raises(ValueError, match="no benchmark files"):
        jt.summarise(str(tmp_path / "empty"), [])


def test_retrieval_vs_reading_counts_seen_right_and_title_copies(tmp_path):
    import pandas as pd
    from agent_support import tokenizer

    from memopd.agent.protocol import INFO, INFO_END

    rvr = _load("retrieval_vs_reading")
    tok = tokenizer()
    info = {  # task -> the passages its episode saw (one call each)
        "t1": "Doc 1 (Title: Paris) Paris is the capital of France.\nDoc 2 (Title: Seine) A river.",
        "t2": "Doc 1 (Title: Berlin) Berlin is in Germany.\nDoc 2 (Title: Thames) It flows through London.",
        "t3": "Doc 1 (Title: Symphony No. 5 (Haydn)) A symphony.",
    }
    pd.DataFrame([{"task_id": t, "input_ids": tok(f"Questions: ...\n{INFO}{text}{INFO_END}\nYou have 3 turns left.",
                                                   add_special_tokens=False)["input_ids"]}
                  for t, text in info.items()]).to_parquet(tmp_path / "q2_test.episodes.parquet")
    pd.DataFrame([{"task_id": "t1", "predictions": "Paris ; Doc 1", "gold": "Paris|paris ; Rome"},
                  {"task_id": "t2", "predictions": "berlin ; London", "gold": "Lyon ; London|the city of London"},
                  {"task_id": "t3", "predictions": "Rome ; Symphony No. 5 (Haydn) ; Doc 3 says Vienna",
                   "gold": "Rome ; Mozart ; Vienna"}]
                 ).to_csv(tmp_path / "q2_test.csv", index=False)
    tok.save_pretrained(tmp_path / "tok")
    got = rvr.main(str(tmp_path / "tok"), str(tmp_path / "q2_test"))
    # by hand: Paris seen and right (a title copy, right); Rome unseen, answered "Doc 1"; Lyon unseen, answered
    # the title "berlin" (wrong); London seen (in a passage's text) and right, not a title; t3: Rome unseen and
    # right; a title with parentheses copied (wrong); an answer that only starts with "Doc 3" (neither)
    assert got == {"questions": 7, "seen": 2, "seen_right": 2, "unseen_right": 1, "title_copies": 3,
                   "title_copies_right": 1, "doc_refs": 1}


def _tree(root: Path) -> list[str]:
    """A made-up complete results tree: each kind of output check_outputs.py looks at, well formed."""
    files = {
        "results/tables/alignment_audit.csv": b"backend,max_dlogp\nsdpa,1e-07\n",
        "results/tables/alignment_audit.md": b"# Alignment audit\n",
        "results/figures/packing_efficiency.png": b"\x89PNG\r\n\x1a\n" + b"\0" * 32,
        "results/audit/rce_smoke.json": b"{}",
        "results/retrieval/index/params.index.json": b"{}",  # a directory output with a file in it
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return sorted(n for n in files if not n.startswith("results/retrieval/")) + ["results/retrieval/index"]


def test_check_outputs_passes_a_complete_tree_and_names_each_bad_output(tmp_path):
    co = _load("check_outputs")
    paths = _tree(tmp_path)
    assert co.check(paths, tmp_path) == []

    (tmp_path / "results/audit/rce_smoke.json").write_bytes(b"")                      # truncated
    (tmp_path / "results/figures/packing_efficiency.png").unlink()                     # deleted
    (tmp_path / "results/tables/alignment_audit.csv").write_text("backend,max_dlogp\n")  # a header, no row
    for f in (tmp_path / "results/retrieval/index").iterdir():                           # an emptied directory
        f.unlink()
    assert co.check(paths, tmp_path) == [
        "results/audit/rce_smoke.json: empty (0 bytes)",
        "results/figures/packing_efficiency.png: missing",
        "results/tables/alignment_audit.csv: CSV with a header and no row",
        "results/retrieval/index: empty directory",
    ]
    (tmp_path / "results/figures/packing_efficiency.png").write_bytes(b"not an image")
    assert co.check(["results/figures/packing_efficiency.png"], tmp_path) == [
        "results/figures/packing_efficiency.png: not a PNG (no PNG signature)"]


def test_check_outputs_exits_1_naming_the_file(tmp_path, monkeypatch, capsys):
    co = _load("check_outputs")
    paths = _tree(tmp_path)
    monkeypatch.setattr(co, "dag_outputs", lambda *a, **k: paths)  # the list `snakemake --summary` would give
    assert co.main(["--directory", str(tmp_path)]) == 0
    assert f"all {len(paths)} outputs of `all` present" in capsys.readouterr().out
    (tmp_path / "results/tables/alignment_audit.md").write_bytes(b"")
    assert co.main(["--directory", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "results/tables/alignment_audit.md: empty (0 bytes)" in err and "1 of 5 outputs" in err


def test_name_copy_probe_scores_the_token_after_each_prefix(tmp_path):
    import json

    import pandas as pd
    import torch
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    from memopd.study import probes as ncp
    assert ncp.name_spans("Which river does Shaifei Doukraileil live by?") == [(17, 24), (25, 36)]
    assert ncp.name_spans("Who employs Netru Dashifai?") == [(12, 17), (18, 26)]  # the "?" is not the name's
    # a word keeps its leading space, as in the byte-level BPE of the study (" Netru" starts at the space)
    words = ["<think>Searching", " Q1.</think><search>", "Who", " employs", " Netru", " Dashifai?", "P", "[UNK]"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(" ?[^ ]+"), behavior="isolated")
    prompt = [6, 6, 6]
    row = {"call": 0, "input_ids": prompt, "metrics": json.dumps({"questions": ["Who employs Netru Dashifai?"]})}
    first = pd.DataFrame([row])
    prefix = tok.encode(ncp.PREFIX, add_special_tokens=False).ids
    assert prefix == [0, 1]
    question = [2, 3, 4, 5]                       # Who employs Netru Dashifai?
    start = len(prompt) + len(prefix)             # where question 1's first token sits

    def oracle(wrong_at):
        """Logits that predict the true next token except at the given absolute positions (P instead)."""
        def logits_of(ids):
            assert ids == prompt + prefix + question
            out = torch.zeros(len(ids), len(words))
            for i in range(len(ids) - 1):
                out[i, 6 if i + 1 in wrong_at else ids[i + 1]] = 1.0
            return out
        return logits_of

    assert ncp.count(oracle(set()), tok, first) == {"name": [2, 2], "template": [2, 2]}
    # the surname wrong: one name token of two; the token before the question's first word is not counted
    assert ncp.count(oracle({start + 3, start - 1}), tok, first) == {"name": [1, 2], "template": [2, 2]}
    assert ncp.count(oracle({start}), tok, first) == {"name": [2, 2], "template": [1, 2]}


def test_induction_probe_counts_the_repeat_only():
    import torch

    from memopd.study import probes as ip
    seqs = ip.sequences(list(range(10, 50)), 20, (3, 9), seed=1)
    assert seqs == ip.sequences(list(range(10, 50)), 20, (3, 9), seed=1)  # seeded
    assert all(3 <= len(s) <= 9 and set(s) <= set(range(10, 50)) for s in seqs)
    assert len({tuple(s) for s in seqs}) == 20
    total = sum(len(s) - 1 for s in seqs)

    def copier(wrong_first_half=False):
        """Logits of a perfect copy of the first half (and, if asked, the wrong token 0 everywhere before)."""
        def logits_of(ids):
            n = len(ids) // 2
            out = torch.zeros(len(ids), 60)
            for j in range(len(ids) - 1):
                out[j, ids[j + 1] if j >= n else (0 if wrong_first_half else ids[j + 1])] = 1.0
            return out
        return logits_of

    assert ip.repeat_accuracy(copier(), seqs) == (total, total)
    assert ip.repeat_accuracy(copier(wrong_first_half=True), seqs) == (total, total)  # the first half is not scored

    def constant(ids):
        out = torch.zeros(len(ids), 60)
        out[:, 0] = 1.0
        return out

    assert ip.repeat_accuracy(constant, seqs) == (0, total)

    def off_by_one(ids):  # predicts the token two ahead: right nowhere in a sequence of distinct tokens
        out = torch.zeros(len(ids), 60)
        for j in range(len(ids) - 2):
            out[j, ids[j + 2]] = 1.0
        return out

    distinct = [[10, 11, 12, 13], [20, 21, 22]]
    assert ip.repeat_accuracy(off_by_one, distinct) == (0, 5)


def test_flattened_eval_changes_only_the_view_and_resolves_per_benchmark_settings():
    import json

    import yaml

    fe = _load("flattened_eval")
    cfg = yaml.safe_load((ROOT / "config/study/base.yaml").read_text())
    got = json.loads(fe.eval_cfg(cfg, "q8_test"))
    assert got["agent"] == {**cfg["agent"], "view": "persistent"} and cfg["agent"]["rule"] == "summary_replacement"
    assert json.loads(fe.eval_cfg(cfg, "q8_test", "exact", "full_retention"))["agent"] == {
        **cfg["agent"], "view": "exact", "rule": "full_retention"}
    assert got["rollout"] == cfg["rollout"]
    # eval's per-benchmark settings resolved for q8_test, by hand from the config's maps
    assert got["eval"]["max_new_tokens"] == cfg["eval"]["max_new_tokens"]["q8_test"] == 160
    assert got["eval"]["max_tasks"] == cfg["eval"]["max_tasks"]["default"]
    assert got["eval"]["temperature"] == 0.0 and "models" not in got["eval"] and "benchmarks" not in got["eval"]


def test_flattened_eval_counts_each_episode_once_by_its_searches(tmp_path):
    import json

    import pandas as pd

    fe = _load("flattened_eval")
    # one row per call; every call of an episode carries the episode's metrics
    rows = [(0, 1), (0, 1), (1, 2), (1, 2), (1, 2), (2, 2), (2, 2), (2, 2), (3, 0)]
    pd.DataFrame({"episode": [e for e, _ in rows], "metrics": [json.dumps({"searches": s}) for _, s in rows]}
                 ).to_parquet(tmp_path / "q2_test.episodes.parquet")
    assert fe.searches_per_episode(tmp_path / "q2_test.episodes.parquet") == {0: 1, 1: 1, 2: 2}


def _evaluation(path: Path, f1: list[float], answered: float) -> None:
    """An evaluation's summary JSON and per-task CSV, as rule eval writes them."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps({"f1": sum(f1) / len(f1), "answered_rate": answered,
                                                     "episodes": len(f1)}))
    path.with_suffix(".csv").write_text("task_id,f1\n" + "".join(f"t{i},{v}\n" for i, v in enumerate(f1)))


def test_design_check_applies_each_threshold_at_its_edge(tmp_path):
    from memopd.study import design as dc
    res = tmp_path / "results"
    student_q2 = [0.4, 0.2, 0.6, 0.0] * 10
    _evaluation(res / "eval/student_sft/q2_test", student_q2, 1.0)
    teacher = [0.7, 0.6, 0.8, 0.4] * 10  # student + 0.3, 0.4, 0.2, 0.4
    _evaluation(res / "eval/teacher_sft/q2_test", teacher, 1.0)
    # long horizon: F1 exactly half of Q2's mean (0.3 -> 0.15), answered exactly half
    student_q8 = [0.3, 0.0] * 20
    _evaluation(res / "eval/student_sft/q8_test", student_q8, 0.5)
    _evaluation(res / "eval/teacher_sft/q8_test", student_q8, 0.5)  # no better at Q8
    got = {c.name: c.passed for c in dc.go_no_go(res, "q2_test", "q8_test")}
    assert got == {"student answers q8_test": True, "student F1 q8_test / q2_test": True,
                   "teacher - student F1 on q2_test": True, "teacher - student F1 on q8_test": False}
    _evaluation(res / "eval/student_sft/q8_test", [0.3, 0.0] * 19 + [0.29, 0.0], 0.49)
    got = {c.name: c.passed for c in dc.go_no_go(res, "q2_test", "q8_test")}
    assert not got["student answers q8_test"] and not got["student F1 q8_test / q2_test"]
    # Design B: the long horizon's models are another run's; its teacher there beats its student
    other = tmp_path / "h8"
    _evaluation(other / "eval/student_sft/q8_test", student_q8, 0.5)
    _evaluation(other / "eval/teacher_sft/q8_test", [v + 0.2 for v in student_q8], 0.5)
    got = {c.name: c.passed for c in dc.go_no_go(res, "q2_test", "q8_test", other)}
    assert all(got.values())
    # the no-go branch: a horizon enters when its student's F1 interval is above 0; one 0.3 among zeros is not
    assert dc.student_above_zero(other, "q8_test").passed
    _evaluation(other / "eval/student_sft/q8_test", [0.3] + [0.0] * 39, 0.5)
    assert not dc.student_above_zero(other, "q8_test").passed
    # persistent flattening: mean difference 0.019 passes, 0.021 fails (the same tasks, by hand)
    _evaluation(tmp_path / "flat/q2_test", [v - 0.019 for v in teacher], 1.0)
    got = {c.name: c.passed for c in dc.both_states(res, tmp_path / "flat", "q2_test")}
    assert got == {"teacher F1 persistent - own on q2_test": True,
                   "teacher on its own states - student on q2_test": True,
                   "teacher on the persistent flattening - student on q2_test": True}
    _evaluation(tmp_path / "flat/q2_test", [v - 0.021 for v in teacher], 1.0)
    assert not dc.both_states(res, tmp_path / "flat", "q2_test")[0].passed


def test_design_check_script_prints_what_memopd_study_design_prints(tmp_path):
    """The script the archived commands name is the CLI command: the same lines, FAIL ones included."""
    import subprocess

    res = tmp_path / "results"
    for model, f1 in (("student_sft", [0.4, 0.0] * 10), ("teacher_sft", [0.5, 0.3] * 10)):
        for bench in ("q2_test", "q8_test"):
            _evaluation(res / "eval" / model / bench, f1, 0.6)
    args = ["--results", str(res), "--persistent", str(res / "eval/teacher_sft")]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    run = [subprocess.run([sys.executable, *cmd, *args], capture_output=True, text=True, env=env, check=True).stdout
           for cmd in ([str(ROOT / "workflow/scripts/design_check.py")], ["-m", "memopd.cli", "study", "design"])]
    lines = run[0].splitlines()
    assert run[0] == run[1] and len(lines) == 9
    assert lines[0] == "PASS  student answers q8_test: 0.600 of 20 episodes (needed >= 0.5)"
    assert lines[6] == ("PASS  teacher F1 persistent - own on q2_test: 0.400 - 0.400 = +0.000 [+0.000, +0.000] over "
                        "20 tasks (needed within +-0.02)")


def test_tuning_picks_the_largest_admissible_lr_then_the_smaller_regulariser():
    from memopd.study import tuning as tu

    assert len(tu.points()) == 8 and {p.method for p in tu.points()} == {"ppo", "memopd"}
    assert tu.Point("memopd", 3e-4, 1.0).overlay()["train"] == {
        "methods": ["memopd"], "seeds": [100], "steps": 300, "lr_actor": 3e-4, "ppo": {"opd_coef": 1.0}}

    def out(lr, reg, inv_first=0.02, inv_last=0.02, ci=(-0.05, 0.05)):
        return tu.Outcome(tu.Point("ppo", lr, reg), inv_first, inv_last, 0.3, 0.0, *ci, [])

    runs = [out(1e-4, 0.001), out(1e-4, 0.01), out(3e-4, 0.01), out(3e-4, 0.001, inv_last=0.13)]
    assert runs[3].collapsed and not runs[2].collapsed  # +0.11 collapses, +0.0 does not
    assert tu.choose(runs).point == tu.Point("ppo", 3e-4, 0.01)
    runs[2] = out(3e-4, 0.01, ci=(-0.10, -0.01))  # greedy F1 below the student's: not admissible
    assert tu.choose(runs).point == tu.Point("ppo", 1e-4, 0.001)
    assert out(1e-4, 0.001, inv_first=0.0, inv_last=0.1).collapsed is False  # +0.10 exactly is the limit, kept
    assert tu.choose([out(1e-4, 0.001, ci=(-0.2, -0.1))]) is None


def test_tuning_steps_rule_finds_where_every_chosen_curve_flattens():
    import random

    from memopd.study import tuning as tu

    rng = random.Random(0)
    noise = [rng.gauss(0, 0.01) for _ in range(300)]
    # rises by 0.2 per block until step 100 (run a) / 150 (run b), flat after: the first block boundary with a
    # flat block on both sides is 150 (a) / 200 (b)
    a = [min(s, 100) / 50 * 0.2 + noise[s] for s in range(300)]
    b = [min(s, 150) / 50 * 0.2 + noise[s] for s in range(300)]
    assert tu.steps_rule([a]) == 150 and tu.steps_rule([b]) == 200
    assert tu.steps_rule([a, b]) == 200
    rising = [s / 300 + noise[s] for s in range(300)]  # never flat within 300 steps
    assert tu.steps_rule([rising]) == 300


def test_third_tuning_rule_takes_the_best_dev_f1_then_the_reward_then_the_smaller_lr():
    from memopd.study import tuning as tu

    grid = tu.points("third")
    assert len(grid) == 12 and {p.method for p in grid} == {"ppo", "memopd"}
    assert {p.reg for p in grid if p.method == "ppo"} == {0.001, 0.01, 0.1}
    assert tu.Point("ppo", 1e-4, 0.1, "third").overlay("teacher_sft_s600")["train"] == {
        "methods": ["ppo"], "seeds": [100], "steps": 150, "lr_actor": 1e-4, "ppo": {"beta": 0.1},
        "student": "teacher_sft_s600"}

    def out(lr, reg, f1, last=0.1, ci=(-0.05, 0.05), inv_last=0.02):
        return tu.Outcome(tu.Point("ppo", lr, reg, "third"), 0.02, inv_last, f1, 0.0, *ci, [0.0] * 50 + [last] * 50)

    runs = [out(1e-4, 0.001, 0.20), out(3e-4, 0.01, 0.25), out(1e-4, 0.1, 0.30, inv_last=0.2)]
    assert tu.choose(runs, "best_f1").point.reg == 0.01  # 0.30 collapsed: not admissible
    runs.append(out(1e-4, 0.01, 0.2504, last=0.2))  # the same F1 to three decimals, a higher final reward
    assert tu.choose(runs, "best_f1").point == tu.Point("ppo", 1e-4, 0.01, "third")
    runs.append(out(3e-4, 0.1, 0.2496, last=0.2))  # tied again, reward too: the smaller lr
    assert tu.choose(runs, "best_f1").point == tu.Point("ppo", 1e-4, 0.01, "third")
    below = [out(1e-4, 0.001, 0.1, ci=(-0.2, -0.1)), out(3e-4, 0.001, 0.05, ci=(-0.3, -0.2))]
    chosen = tu.choose(below, "best_f1")  # none admissible: the highest dev F1 anyway
    assert chosen.point.lr == 1e-4 and not chosen.admissible
    assert runs[0].blocks() == pytest.approx([0.0, 0.1])


def test_tuning_reads_an_archived_runs_gzipped_metrics(tmp_path):
    import gzip

    from memopd.study import tuning as tu

    steps = [{"step": i, "reward/em": i / 10} for i in range(3)]
    text = "".join(json.dumps(s) + "\n" for s in steps)
    (tmp_path / "metrics.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    assert tu.read_metrics(tmp_path / "metrics.jsonl") == steps
    (tmp_path / "metrics.jsonl").write_text(text[: text.index("\n") + 1])  # the plain file, when there, wins
    assert tu.read_metrics(tmp_path / "metrics.jsonl") == steps[:1]
