"""`memopd eval` end to end on a benchmark parquet: the output contract of results/eval/."""
from __future__ import annotations

import json

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import memopd.evaluation.evaluate as evaluate
from agent_support import nq_tasks, random_student, retriever, tokenizer
from memopd.evaluation.evaluate import aggregate
from memopd.agent.protocol import load_tasks
from memopd.cli import main
from memopd.records import load_episodes
from memopd.schema import merge_files

CONTRACT = {"episodes", "em", "f1", "peak_context_tokens", "inference_time_s", "dependency", "calls_per_episode",
            "invalid_action_rate"}


def _benchmark(path, n=5):
    tasks = nq_tasks(n, n_questions=2, benchmark="q2_test")
    pq.write_table(pa.table({"task_id": [t.task_id for t in tasks], "questions": [t.questions for t in tasks],
                             "answers": [t.answers for t in tasks], "benchmark": [t.benchmark for t in tasks]}), path)
    return tasks


def test_load_tasks_roundtrip(tmp_path):
    tasks = _benchmark(tmp_path / "b.parquet")
    assert load_tasks(tmp_path / "b.parquet") == tasks
    assert load_tasks(tmp_path / "b.parquet", limit=2) == tasks[:2]


def test_eval_cli_writes_contract(tmp_path):
    model_dir = tmp_path / "student"
    random_student(0).save_pretrained(model_dir)
    tokenizer().save_pretrained(model_dir)
    _benchmark(tmp_path / "q2_test.parquet", n=5)
    retriever().save(tmp_path / "index")  # a saved BM25 index, opened by memopd.retrieval as the step does
    cfg = {"agent": {"rule": "summary_replacement", "turns": {"default": 3}, "invalid_action": "continue",
                     "max_observation_tokens": 32},
           "rollout": {"backend": "hf", "dtype": "float32", "batch_size": 4, "max_new_tokens": 8, "temperature": 1.0},
           "eval": {"max_tasks": 4, "temperature": 0.0, "max_new_tokens": None}}  # null: the rollout's budget
    out = tmp_path / "eval/student/q2_test.json"
    main(["eval", "--cfg", json.dumps(cfg), "--seed", "1", "--model", str(model_dir), "--benchmark",
          str(tmp_path / "q2_test.parquet"), "--index", str(tmp_path / "index"), "--out-dir", str(out.parent)])
    res = json.loads(out.read_text())
    assert CONTRACT <= set(res) and res["episodes"] == 4
    assert 0 <= res["em"] <= 1 and 0 <= res["f1"] <= 1 and res["calls_per_episode"] == 3  # random init: no answers
    assert res["invalid_action_rate"] == 1.0 and res["inference_time_s"] > 0
    assert res["max_new_tokens"] == 8 and res["temperature"] == 0.0  # the protocol it used
    eps = load_episodes(out.with_suffix(".episodes.parquet"))
    assert len(eps) == 4 and res == {**res, **aggregate(eps, res["inference_time_total_s"])}
    rows = out.with_suffix(".csv").read_text().splitlines()
    assert len(rows) == 5 and rows[0].startswith("task_id,reward,em,f1")


def test_eval_several_benchmarks_equal_separate_runs(tmp_path, monkeypatch):
    """One job over several benchmarks (the pipeline's eval step) gives each benchmark exactly what a run
    on it alone gives: its own task limit and sampling (here greedy on one, sampled on the other)."""
    model_dir = tmp_path / "student"
    random_student(0).save_pretrained(model_dir)
    tokenizer().save_pretrained(model_dir)
    _benchmark(tmp_path / "q2_test.parquet", n=4)
    _benchmark(tmp_path / "q8_test.parquet", n=5)
    monkeypatch.setattr(evaluate, "load_retriever", lambda path: retriever())
    cfg = {"agent": {"rule": "summary_replacement", "turns": {"default": 2}, "invalid_action": "continue",
                     "max_observation_tokens": 16},
           "rollout": {"backend": "hf", "dtype": "float32", "batch_size": 4, "max_new_tokens": 8, "temperature": 1.0},
           "eval": {"max_tasks": {"default": 2, "q8_test": 3}, "temperature": {"default": 0.0, "q8_test": 1.0},
                    "max_new_tokens": {"default": 6, "q8_test": 9}}}

    def run(out, *benches):
        main(["eval", "--cfg", json.dumps(cfg), "--seed", "3", "--model", str(model_dir), "--benchmark",
              *(str(tmp_path / f"{b}.parquet") for b in benches), "--index", "unused", "--out-dir", str(out)])

    run(tmp_path / "both", "q8_test", "q2_test")
    for b, n, max_new in (("q2_test", 2, 6), ("q8_test", 3, 9)):
        run(tmp_path / f"alone_{b}", b)
        both, alone = (load_episodes(tmp_path / d / f"{b}.episodes.parquet") for d in ("both", f"alone_{b}"))
        assert len(both) == n and [e.invocations for e in both] == [e.invocations for e in alone]
        assert max(len(i.output_ids) for e in both for i in e.invocations) == max_new  # its own budget
        assert json.loads((tmp_path / "both" / f"{b}.json").read_text())["max_new_tokens"] == max_new  # recorded


def _budgets(cfg: dict) -> dict[str, int]:
    """Effective evaluation response budget per benchmark (what memopd eval samples with)."""
    from memopd.generation.backends import make_sampling
    from memopd.config import eval_config, rollout_config

    return {b: make_sampling(rollout_config(cfg), **eval_config(cfg).at(b).sampling()).max_new_tokens
            for b in cfg["eval"]["benchmarks"]}


def test_evaluation_uses_the_training_rollout_budget_unless_the_config_says_otherwise():
    """Paper scale: every benchmark is evaluated with rollout.max_new_tokens, the budget the policies were
    trained with (failed before: 64 on Q2 and Wiki-RAG against 1,024 in training, so answers were cut and
    counted invalid). A config value still wins, per benchmark, and the embedded default keeps its numbers."""
    import yaml

    from agent_support import ROOT

    paper = merge_files([ROOT / "config/paper.yaml"])
    assert set(_budgets(paper).values()) == {paper["rollout"]["max_new_tokens"]} == {1024}
    override = {**paper, "eval": {**paper["eval"], "max_new_tokens": {"default": None, "q8_test": 320}}}
    assert _budgets(override) == {"q2_test": 1024, "q8_test": 320, "q16_test": 1024, "wikirag_test": 1024}
    embedded = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    assert _budgets(embedded) == {"q2_test": 96, "q8_test": 320, "wikirag_test": 96}
    embedded["eval"]["benchmarks"].append("q16_test")  # config/cpu_full.yaml's
    assert _budgets(embedded)["q16_test"] == 512


RESULTS_CFG = {"methods": ["ppo", "memopd"], "seeds": [0, 1], "horizons": {"q16_test": "Q16", "q2_test": "Q2",
                                                                     "wikirag_test": "wikirag"},
               "student": "student_sft", "teacher": "teacher_sft", "steps": 2, "batch_tasks": 4, "benchmark": "q2_train"}
# the level each evaluation's scores are made of: a run's is its seed, the SFT models' their own
LEVELS = {"student_sft": 0, "teacher_sft": 5}


def _evaluations(eval_dir, train=RESULTS_CFG):
    """Every evaluation `report results` reads, with scores made of a level per model (LEVELS)."""
    for model in [f"{m}_seed{s}" for m in train["methods"] for s in train["seeds"]] + list(LEVELS):
        for b in train["horizons"]:
            d = eval_dir / model
            d.mkdir(parents=True, exist_ok=True)
            s = LEVELS.get(model, int(model[-1]) if model[-1].isdigit() else 0)
            (d / f"{b}.json").write_text(json.dumps({"em": 0.1 * s, "f1": 0.2, "peak_context_tokens": 100,
                                                     "inference_time_s": 1.0, "dependency": 5.0,
                                                     "invalid_action_rate": 0.05 * s, "calls_per_episode": 3.0 + s,
                                                     "max_new_tokens": 1024}))
            (d / f"{b}.csv").write_text("task_id,em,f1\n" + "".join(f"t{i},{0.1 * s},{0.2}\n" for i in range(5)))


def _report_results(tmp_path, train=RESULTS_CFG):
    main(["report", "results", "--cfg", json.dumps(train), "--eval-dir", str(tmp_path / "eval"), "--out-dir",
          str(tmp_path / "tables"), "--figure", str(tmp_path / "f1.png")])


def test_result_tables_state_the_evaluation_budget(tmp_path, monkeypatch):
    """Tables 1-2 captions name the response budget the evaluations recorded (one number, or per horizon)."""
    from memopd.report.results import budget_note

    _evaluations(tmp_path / "eval")
    monkeypatch.setenv("MEMOPD_LABEL", "Controlled study")
    _report_results(tmp_path)
    from PIL import Image

    assert Image.open(tmp_path / "f1.png").text["Title"] == "Controlled study: F1 by horizon"  # the label, as captions
    for table in ("multiobjective", "wikirag", "vs_student"):
        caption = (tmp_path / "tables" / f"{table}.md").read_text().splitlines()[0]
        assert "response budget 1024 new tokens per call" in caption, caption
    multi = pd.read_csv(tmp_path / "tables" / "multiobjective.csv")
    assert list(dict.fromkeys(multi["horizon"])) == ["Q2", "Q16"]  # by questions per task, not as the config lists them
    multi = multi.set_index(["method", "horizon", "metric"])
    assert multi.loc[("memopd", "Q2", "invalid_action_rate"), "mean"] == pytest.approx((0.0 + 0.05) / 2)  # seeds 0, 1
    assert multi.loc[("ppo", "Q16", "calls_per_episode"), "mean"] == pytest.approx((3.0 + 4.0) / 2)
    mixed = {("ppo", "q2_test"): {0: {"max_new_tokens": 64}}, ("ppo", "q8_test"): {0: {"max_new_tokens": 320}},
             ("memopd", "q8_test"): {0: {}}}
    assert budget_note(mixed, {"q2_test": "Q2", "q8_test": "Q8"}) == \
        "response budget (new tokens per call) Q2 64, Q8 320/not recorded"


def test_result_tables_put_the_sft_student_and_teacher_above_the_methods(tmp_path, capsys):
    """Tables 1-2 carry the SFT student and teacher on every horizon, each (horizon, metric) block opening with
    them: their own value, its change vs PPO's mean in %, and blank seed columns (one evaluation each)."""
    _evaluations(tmp_path / "eval")
    _report_results(tmp_path)
    for table, horizons in (("multiobjective", ["Q2", "Q16"]), ("wikirag", ["wikirag"])):
        rows = pd.read_csv(tmp_path / "tables" / f"{table}.csv")
        for (horizon, metric), block in rows.groupby(["horizon", "metric"], sort=False):
            assert list(block["method"]) == ["student_sft", "teacher_sft", "ppo", "memopd"], (table, horizon, metric)
        assert sorted(rows["horizon"].unique()) == sorted(horizons)
        teacher = rows[(rows["method"] == "teacher_sft") & (rows["horizon"] == horizons[-1])].set_index("metric")
        ppo_em = (0.1 * 0 + 0.1 * 1) / 2  # seeds 0 and 1
        assert teacher.loc["em", "mean"] == pytest.approx(0.5)
        assert teacher.loc["em", "rel_to_ppo_pct"] == pytest.approx(100 * (0.5 - ppo_em) / ppo_em)
        assert teacher.loc["calls_per_episode", "mean"] == pytest.approx(8.0)
        assert teacher[["std", "ci_low", "ci_high", "seeds", "diff_vs_ppo", "p", "noise"]].isna().all().all()
    md = (tmp_path / "tables" / "multiobjective.md").read_text()
    assert "rows student_sft and teacher_sft" in md.splitlines()[0]
    assert not [line for line in md.splitlines() if line.startswith("Finding") and "_sft" in line]
    (tmp_path / "eval" / "teacher_sft" / "q16_test.json").unlink()
    with pytest.raises(SystemExit):
        _report_results(tmp_path)
    err = capsys.readouterr().err
    assert "missing evaluation" in err and "teacher_sft/q16_test.json" in err, err
    (tmp_path / "eval" / "memopd_seed1" / "q2_test.json").unlink()  # a run's, read first
    with pytest.raises(SystemExit):
        _report_results(tmp_path)
    err = capsys.readouterr().err
    assert "memopd_seed1/q2_test.json (method memopd, seed 1, benchmark q2_test)" in err, err


@pytest.mark.parametrize("cfg_file", ["config/config.yaml", "config/paper.yaml"])
def test_config_sections_build(cfg_file):
    from agent_support import ROOT
    from memopd.config import AgentConfig, RolloutConfig, rollout_config
    from memopd.generation.backends import make_sampling

    cfg = merge_files([ROOT / cfg_file])
    agent = AgentConfig.from_dict(cfg["agent"], batch_size=cfg["rollout"]["batch_size"])
    assert agent.max_turns("q16_test") > agent.max_turns("q8_test") > agent.max_turns("q2_test")
    ro = rollout_config(cfg)
    assert ro.engine == cfg["rollout"]["backend"] and ro.batch_size == cfg["rollout"]["batch_size"]
    assert make_sampling(ro).max_new_tokens == cfg["rollout"]["max_new_tokens"]
    with pytest.raises(ValueError):
        AgentConfig.from_dict({**cfg["agent"], "bogus": 1})
    with pytest.raises(ValueError, match="bogus"):
        RolloutConfig.from_dict({**cfg["rollout"], "bogus": 1})
    with pytest.raises(ValueError, match="backend"):
        RolloutConfig.from_dict({**cfg["rollout"], "backend": "tgi"})


def test_rce_rollouts_cli(tmp_path, monkeypatch):
    model_dir = tmp_path / "student"
    random_student(0).save_pretrained(model_dir)
    tokenizer().save_pretrained(model_dir)
    _benchmark(tmp_path / "q2_train.parquet", n=3)
    monkeypatch.setattr(evaluate, "load_retriever", lambda path: retriever())
    cfg = {"agent": {"rule": "summary_replacement", "turns": {"default": 3}, "max_observation_tokens": 16},
           "rollout": {"backend": "hf", "dtype": "float32", "batch_size": 4, "max_new_tokens": 64, "temperature": 1.0},
           "rce_rollouts": {"benchmark": "q2_train", "tasks": 2, "max_new_tokens": 6, "invalid_action": "continue",
                            "dtype": "float32", "backends": ["sdpa", "prefix_shared"],
                            "rules": ["full_retention", "sliding_window"]}}
    out = tmp_path / "rce_rollouts.json"
    main(["rce-rollouts", "--cfg", json.dumps(cfg), "--model", str(model_dir), "--benchmark",
          str(tmp_path / "q2_train.parquet"), "--index", "unused", "--out", str(out), "--strict"])
    rep = json.loads(out.read_text())
    assert rep["passed"] and set(rep["rules"]) == {"full_retention", "sliding_window"}
    for r in rep["rules"].values():
        assert set(r["backends"]) == {"sdpa", "prefix_shared"} and r["episodes"] == 2 and r["calls"] == 6
        assert r["retained_tokens"] > 0 and r["behaviour_vs_recomputed"]["tokens"] == 36


def test_model_steps_load_on_the_jobs_gpu_when_it_has_one(tmp_path, monkeypatch):
    """rce-rollouts re-loads its audit model (another dtype than the rollout's): on the job's GPU too, not
    on the CPU. With a GPU reported, every load asks for it: the rollout model, the re-load, and
    `memopd rce` without --device. The test needs no GPU: the loads record the device and load on the
    CPU; the re-load (and then every load) stops the step once recorded."""
    import torch

    import memopd.models as models

    real_load, asked, stop = models.load_model, [], {"all": False}

    def load_model(path, dtype="float32", device="cpu", **kw):
        asked.append((dtype, device))
        if dtype == "bfloat16" or stop["all"]:
            raise RuntimeError("stop: load recorded")
        return real_load(path, dtype=dtype, device="cpu", **kw)

    model_dir = tmp_path / "student"
    random_student(0).save_pretrained(model_dir)
    tokenizer().save_pretrained(model_dir)
    _benchmark(tmp_path / "q2_train.parquet", n=1)
    monkeypatch.setattr(evaluate, "load_retriever", lambda path: retriever())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(models, "load_model", load_model)
    cfg = {"agent": {"rule": "summary_replacement", "turns": {"default": 2}, "max_observation_tokens": 16},
           "rollout": {"backend": "hf", "dtype": "float32", "batch_size": 1, "max_new_tokens": 4, "temperature": 1.0},
           "rce_rollouts": {"benchmark": "q2_train", "tasks": 1, "max_new_tokens": 4, "dtype": "bfloat16",
                            "backends": ["sdpa"]}}
    with pytest.raises(RuntimeError, match="stop"):
        main(["rce-rollouts", "--cfg", json.dumps(cfg), "--model", str(model_dir), "--benchmark",
              str(tmp_path / "q2_train.parquet"), "--index", "unused", "--out", str(tmp_path / "rr.json")])
    stop["all"] = True
    with pytest.raises(RuntimeError, match="stop"):
        main(["rce", "--cfg", json.dumps({"dtype": "float32", "backends": ["sdpa"], "episodes": 1, "calls": 1,
                                         "prefix_tokens": 4, "observation_tokens": [4, 4],
                                         "response_tokens": [4, 4]}),
              "--model", str(model_dir), "--data-dir", "data", "--out", str(tmp_path / "r.json")])
    assert asked == [("float32", "cuda"), ("bfloat16", "cuda"), ("float32", "cuda")], asked
