"""The Snakemake workflow: config validation, the DAG, lint, and the RCE step through the real CLI."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from memopd.schema import merge_files

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}


def snakemake(*args, cwd=ROOT):
    return subprocess.run([str(BIN / "snakemake"), *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)


def _bad_config(tmp_path, mutate):
    cfg = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    mutate(cfg)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("mutate, needle", [
    (lambda c: c["rce"].__setitem__("dtype", "float8"), "float8"),
    (lambda c: c["rce"].__setitem__("backends", ["sdpa", "magic"]), "magic"),
    (lambda c: c.__setitem__("unknown_key", 1), "unknown_key"),
    (lambda c: c["models"].__setitem__("student", {"hidden_size": -5}), "hidden_size"),
    (lambda c: c["train"]["matched_control"].__setitem__("benchmark", "q4_test"), "q4_test"),  # not in eval.benchmarks
    (lambda c: c["train"]["matched_control"].__setitem__("methods", ["ppo"]), "methods"),  # fixed, not configurable
    (lambda c: c["train"]["matched_control"].__setitem__("seeds", [1, 1]), "matched_control"),
    (lambda c: c["train"].__setitem__("horizons", {b: None for b in c["train"]["horizons"]}), "every horizon is null"),
    (lambda c: c["resources"]["rules"].__setitem__("studdy", {"threads": 2}), "studdy"),  # a typo of a step
])
def test_bad_config_stops_the_run_naming_it(tmp_path, mutate, needle):
    res = snakemake("-n", "--configfile", str(_bad_config(tmp_path, mutate)))
    assert res.returncode != 0
    assert needle in res.stdout + res.stderr


def test_dry_run_lists_the_targets():
    res = snakemake("-n", "--forceall", "--quiet", "rules")  # --forceall: whatever results/ already holds
    assert res.returncode == 0, res.stderr
    for rule in ("model_base", "model_init", "rce_smoke"):
        assert rule in res.stdout + res.stderr


def _dry_run_blocks(text):
    """{rule: [job block, ...]} of a `snakemake -n` output (a block: `key: value` lines of one job)."""
    blocks, cur = {}, None
    for line in text.splitlines():
        if line.startswith(("rule ", "localrule ")) and line.endswith(":"):
            cur = {}
            blocks.setdefault(line.split()[1][:-1], []).append(cur)
        elif cur is not None and line.startswith("    ") and ": " in line:
            key, _, value = line.strip().partition(": ")
            cur[key] = value
        elif not line.startswith(" "):
            cur = None
    return blocks


def test_matched_control_target_needs_exactly_its_runs(tmp_path):
    """Control seeds [7] (train.seeds [0]): the table reads the three seed-7 runs on q2_test, and its
    target builds those runs only; `all` builds them next to the main runs."""
    cfg = _bad_config(tmp_path, lambda c: c["train"]["matched_control"].update(seeds=[7]))
    res = snakemake("results/tables/matched_control.csv", "-n", "--forceall", "--configfile", str(cfg))
    assert res.returncode == 0, res.stdout + res.stderr
    blocks = _dry_run_blocks(res.stdout)
    (job,) = blocks["matched_control"]
    evals = {f for f in job["input"].split(", ") if f.startswith("results/eval/")}
    assert evals == {f"results/eval/{m}_seed7/q2_test.json" for m in ("ppo", "memopd_persistent", "memopd")}
    assert job["output"] == "results/tables/matched_control.csv, results/tables/matched_control.md"
    assert job["log"] and job["benchmark"]
    assert sorted(b["wildcards"] for b in blocks["train"]) == sorted(f"method={m}, seed=7" for m in
                                                                      ("memopd", "memopd_persistent", "ppo"))
    assert sorted(b["wildcards"] for b in blocks["eval"]) == sorted(f"model={m}_seed7, benchmark=q2_test" for m in
                                                                     ("memopd", "memopd_persistent", "ppo"))
    assert "results_tables" not in blocks and "audit_episodes" not in blocks
    res = snakemake("all", "-n", "--forceall", "--configfile", str(cfg))
    assert res.returncode == 0, res.stdout + res.stderr
    blocks = _dry_run_blocks(res.stdout)
    assert len(blocks["train"]) == 6 and len(blocks["matched_control"]) == 1  # 3 main runs + 3 for the control


def test_parsing_the_workflow_imports_no_torch():
    """The Snakefile's parse and DAG (every input function, param and resource of `all`) run in the Snakemake
    process, on a login node too: they import memopd's light modules only (memopd.config, not a model stack)."""
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "snakemake", "all", "-n", "--forceall", "--quiet"],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")}
    assert "memopd.config" in imported and "memopd.codegraph" in imported  # the probe sees the workflow's imports
    heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "transformers"))
    assert not heavy, heavy[:10]


def test_all_includes_the_matched_control_and_reuses_the_main_runs():
    """Embedded default: the control's seeds are train.seeds, so `all` trains 3 runs (1 seed x 3 methods), not
    more, and results_tables (Tables 1-2) does not write the control's table."""
    res = snakemake("all", "-n", "--forceall")
    assert res.returncode == 0, res.stdout + res.stderr
    blocks = _dry_run_blocks(res.stdout)
    assert len(blocks["train"]) == 3 and len(blocks["matched_control"]) == 1
    (tables,) = blocks["results_tables"]
    assert "matched_control" not in tables["output"]
    cfg = yaml.safe_load((ROOT / "config/config.yaml").read_text())["train"]
    assert cfg["matched_control"]["seeds"] == cfg["seeds"]
    paper = merge_files([ROOT / "config/paper.yaml"])["train"]
    assert set(paper["matched_control"]["seeds"]) <= set(paper["seeds"])  # paper scale reuses its runs


def test_an_evaluation_reruns_only_when_what_it_reads_changes(tmp_path):
    """An eval job's params (Snakemake reruns a job whose params changed) hold eval's settings for its own
    benchmark only: adding a benchmark or a model leaves the other evaluations' commands as they were (the
    whole eval section would rerun every evaluation when a benchmark is added), and a budget given per
    benchmark reaches its job resolved."""
    def command(cfg=None):
        args = ["results/eval/student_sft/q2_test.json", "-n", "-p", "--forceall"]
        res = snakemake(*args, *(["--configfile", str(cfg)] if cfg else []))
        assert res.returncode == 0, res.stdout + res.stderr
        (line,) = [x for x in (res.stdout + res.stderr).splitlines() if " eval --cfg " in x]
        return line

    base = command()
    more = _bad_config(tmp_path, lambda c: (c["eval"]["benchmarks"].append("q16_test"),
                                             c["eval"]["models"].append("student_init")))
    assert command(more) == base
    budget = _bad_config(tmp_path, lambda c: c["eval"]["max_new_tokens"].__setitem__("q2_test", 64))
    assert command(budget) != base
    cfg = json.loads(base.split(" eval --cfg ")[1].split("' --seed")[0].lstrip("'"))
    assert cfg["eval"] == {"max_new_tokens": 96, "max_tasks": 20, "temperature": 0.0}


def test_lint_is_clean():
    res = snakemake("--lint")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Lints for" not in res.stdout + res.stderr


def test_rce_command_writes_the_contract(tmp_path):
    """`memopd rce` on a tiny model: the JSON keys other tools read, and a CSV beside it."""
    from itertools import islice

    from memopd.data import corpus_texts
    from memopd.models import init_model, train_tokenizer

    train_tokenizer(islice(corpus_texts(ROOT / "data"), 1000), 500, tmp_path / "tok", min_frequency=2)
    arch = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1}
    init_model(arch, tmp_path / "m", seed=0, tokenizer_path=tmp_path / "tok")
    cfg = {"dtype": "float32", "tolerance": None, "backends": ["sdpa", "eager", "prefix_shared"], "episodes": 5,
           "calls": 3, "prefix_tokens": 16, "observation_tokens": [4, 12], "response_tokens": [2, 8]}
    out = tmp_path / "rce.json"
    res = subprocess.run([str(BIN / "memopd"), "rce", "--cfg", json.dumps(cfg), "--model", str(tmp_path / "m"),
                          "--data-dir", str(ROOT / "data"), "--out", str(out), "--strict"],
                         env=ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    rep = json.loads(out.read_text())
    assert rep["dtype"] == "float32" and rep["tolerance"] == 1e-4 and rep["config"]["episodes"] == 5
    for name in cfg["backends"]:
        r = rep["backends"][name]
        assert set(r) >= {"max_abs_dlogp", "p99_abs_dlogp", "mean_abs_dlogp", "max_abs_dlogit", "top1_agreement",
                          "action_tokens", "passed"}
        assert r["passed"] and r["max_abs_dlogp"] <= 1e-5
    assert out.with_suffix(".csv").read_text().startswith("backend,episode,call,")


def test_every_output_of_rule_study_is_written_by_the_nested_workflow(tmp_path):
    """Rule study declares the nested workflow's tables, figures and Markdown tables as its outputs; each must be
    an output of some job of the nested DAG, or the job ends in a MissingOutputException after all its work."""
    outer = snakemake("-n", "--forceall", "all", "--configfile", "config/smoke.yaml")
    assert outer.returncode == 0, outer.stderr[-3000:]
    declared = {p.removeprefix("results/study/") for p in _dry_run_blocks(outer.stdout)["study"][0]["output"].split(", ")}
    assert {"results/tables/matched_control.md", "results/figures/training_curves.png"} <= declared
    nested = snakemake("-n", "--forceall", "-d", str(tmp_path), *sorted(declared),
                       "--configfile", str(ROOT / "config/study/base.yaml"), str(ROOT / "config/study/smoke.yaml"))
    jobs = [b for blocks in _dry_run_blocks(nested.stdout).values() for b in blocks]
    outputs = [{p for p in b.get("output", "").split(", ") if p} for b in jobs]
    assert declared <= set().union(*outputs), (sorted(declared - set().union(*outputs)), nested.stderr[-3000:])
    # Snakemake deletes a job's outputs before it runs: a rerun of rule study must cost the nested jobs that
    # write the declared files, never one whose other outputs later nested jobs read (the benchmarks' job)
    read = {p for b in jobs for p in b.get("input", "").split(", ") if p}
    for out in outputs:
        if out & declared:  # its declared outputs may be read (rule archive checks the tables): they rerun anyway
            assert not (out - declared) & read, sorted((out - declared) & read)


def test_the_documented_study_command_gives_the_nested_workflow_both_cores():
    """docs/study.md's command runs the study as one job of the default config: its nested workflow must get the
    cores of `-c 2` (the training runs go two side by side) and a SLURM time limit of hours, not the default's."""
    res = snakemake("-n", "-p", "--forceall", "-c", "2", "results/study/results/tables/matched_control.csv",
                    "--config", "study={configs: [config/study/base.yaml]}")
    assert res.returncode == 0, res.stderr[-3000:]
    job = _dry_run_blocks(res.stdout)["study"][0]
    assert "cpus_per_task=2" in job["resources"] and "runtime=480" in job["resources"], job
    shell = next(line for line in res.stdout.splitlines() if " -d results/study " in line)
    assert " -c 2 " in shell, shell


def _evaluated(dry_run_stdout):
    """{(model, benchmark)} of the eval jobs of a dry run."""
    return {tuple(b["output"].split(",")[0].split("/")[2:4]) for b in _dry_run_blocks(dry_run_stdout).get("eval", [])}


def test_a_layered_config_drops_a_horizon_by_null(tmp_path):
    """config/study/smoke.yaml sets the study's Q8/Q16 horizons to null: Snakemake merges the mapping key by key, so
    null is the only way a layered file removes one. The trained runs are then evaluated on Q2 and Wiki-RAG only."""
    base = ("--configfile", str(ROOT / "config/study/base.yaml"))
    full = snakemake("-n", "--forceall", "-d", str(tmp_path / "full"), "results/tables/multiobjective.csv", *base)
    small = snakemake("-n", "--forceall", "-d", str(tmp_path / "small"), "results/tables/multiobjective.csv",
                      *base, str(ROOT / "config/study/smoke.yaml"))
    assert full.returncode == 0 and small.returncode == 0, full.stderr[-2000:] + small.stderr[-2000:]
    assert ("ppo_seed0", "q8_test.json") in _evaluated(full.stdout)
    assert {b for _, b in _evaluated(small.stdout)} == {"q2_test.json", "wikirag_test.json"}
    assert ("memopd_persistent_seed0", "wikirag_test.json") in _evaluated(small.stdout)


def _cfg(shell_line):
    """The --cfg JSON of one job's shell line in a `snakemake -n -p` output."""
    return json.loads(shell_line.split("--cfg '")[1].split("' ")[0])


def _train_cfgs(dry_run_stdout):
    """{method: its `train` section} from the --cfg of each `memopd train` command of a `snakemake -n -p` output."""
    shells = [line for line in dry_run_stdout.splitlines() if " train --cfg " in line]
    return {line.split("--method ")[1].split()[0]: _cfg(line)["train"] for line in shells}


def _job_cfg(dry_run_stdout, command):
    """(the --cfg, the shell line) of the one `memopd COMMAND` job of a `snakemake -n -p` output."""
    (line,) = [x for x in dry_run_stdout.splitlines() if f" {command} --cfg " in x]
    return _cfg(line), line


def test_each_method_trains_on_its_own_seeds_and_settings(tmp_path):
    """train.per_method: ppo on seeds 0-1 at its own lr, memopd on 0-1, the two controls on seed 0. `all` trains those
    six runs; the matched control (no seeds of its own) reads each method's runs, the regularisation control's
    too; a run's --cfg holds its own settings and no other method's, so changing one method's reruns no other."""
    def mutate(c):
        c["train"].update(methods=["ppo", "memopd", "memopd_persistent", "memopd_self"], seeds=[0, 1],
                          per_method={"ppo": {"lr_actor": 3e-4}, "memopd_persistent": {"seeds": [0]},
                                      "memopd_self": {"seeds": [0]}})
        c["train"]["matched_control"]["seeds"] = None
    res = snakemake("all", "-n", "-p", "--forceall", "--configfile", str(_bad_config(tmp_path, mutate)))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    blocks = _dry_run_blocks(res.stdout)
    runs = {"ppo": [0, 1], "memopd": [0, 1], "memopd_persistent": [0], "memopd_self": [0]}
    assert sorted(b["wildcards"] for b in blocks["train"]) == sorted(f"method={m}, seed={s}" for m, ss in runs.items()
                                                                      for s in ss)
    (job,) = blocks["matched_control"]
    assert {f for f in job["input"].split(", ")} == {f"results/eval/{m}_seed{s}/q2_test.json" for m, ss in runs.items()
                                                     for s in ss}
    shells = [line for line in res.stdout.splitlines() if " train --cfg " in line]
    lr = {m: train["lr_actor"] for m, train in _train_cfgs(res.stdout).items()}
    base = yaml.safe_load((ROOT / "config/config.yaml").read_text())["train"]["lr_actor"]
    assert lr == {"ppo": 3e-4, "memopd": base, "memopd_persistent": base, "memopd_self": base}
    assert not any("per_method" in line for line in shells)


def _test_study_dry_run(tmp_path, names: tuple[str, ...], steps: int) -> str:
    """The dry run of a test study's stack (the config header's command): ppo and memopd on seeds 0-9, the two
    controls on 0-4, each run's --cfg with the rule-3 settings (ppo lr 1e-4, beta 0.001; the MemOPD variants lr 3e-4,
    lambda 1) and `steps`, and every trained run evaluated at Q2, the longer horizons and Wiki-RAG. Its stdout."""
    stack = [str(ROOT / f"config/{name}.yaml") for name in names]
    res = snakemake("-n", "-p", "--forceall", "-d", str(tmp_path), "results/archive/archive.json", "--configfile", *stack)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    runs = {"ppo": range(10), "memopd": range(10), "memopd_persistent": range(5), "memopd_self": range(5)}
    assert sorted(b["wildcards"] for b in _dry_run_blocks(res.stdout)["train"]) == sorted(
        f"method={m}, seed={s}" for m, ss in runs.items() for s in ss)
    cfgs = {m: (train["lr_actor"], train["ppo"]["beta"], train["ppo"]["opd_coef"], train["steps"])
            for m, train in _train_cfgs(res.stdout).items()}
    assert cfgs["ppo"][:2] == (1e-4, 0.001) and cfgs["ppo"][3] == steps
    assert all(cfgs[m][0] == 3e-4 and cfgs[m][2] == 1.0 and cfgs[m][3] == steps
               for m in ("memopd", "memopd_persistent", "memopd_self")), cfgs
    evaluated = _evaluated(res.stdout)
    for m, ss in runs.items():
        for s in ss:
            assert {b for model, b in evaluated if model == f"{m}_seed{s}"} >= {
                "q2_test.json", "q4_test.json", "q8_test.json", "q16_test.json", "wikirag_test.json"}, (m, s)
    return res.stdout


def test_the_second_editions_stack_trains_thirty_runs_at_their_fixed_settings(tmp_path):
    """config/study/second_edition.yaml over the Design B H = 2 stack: 30 runs of 150 steps."""
    _test_study_dry_run(tmp_path, ("study/base", "study/design_b", "study/design_b_h2", "study/second_edition"), 150)


def test_design_cs_test_stack_trains_thirty_runs_of_fifty_steps_and_evaluates_q8_on_a_hundred_tasks(tmp_path):
    """config/study/design_c_test.yaml over Design C's stack: 30 runs of 50 steps after the SFT on the 1-8 question
    curriculum, Q4 and Q8 on 100 test tasks each."""
    out = _test_study_dry_run(tmp_path, ("study/base", "study/design_b", "study/design_c", "study/design_c_test"), 50)
    sets = _job_cfg(out, "benchmarks")[0]["qn"]["sets"]
    assert {s["n"]: s["tasks"] for s in sets if s["split"] == "test"} == {2: 200, 4: 100, 8: 100, 16: 25}
    assert sorted(s["n"] for s in sets if s["split"] == "train") == list(range(1, 9))


def test_design_cs_dev_stack_trains_the_eight_question_curriculum_four_times_longer(tmp_path):
    """config/study/design_c.yaml over config/study/base.yaml and config/study/design_b.yaml (docs/study.md, Design C): the
    scripted teacher writes trajectories for 1-8 questions with a turn budget of n + 4 and 2 passages per search, the
    student's SFT runs 12,000 steps and the teacher's 9,600 at seq_len 2,560."""
    stack = [str(ROOT / f"config/{name}.yaml") for name in ("study/base", "study/design_b", "study/design_c", "study/dev")]
    res = snakemake("-n", "-p", "--forceall", "-d", str(tmp_path), "results/tables/sft_summary.csv",
                    "--configfile", *stack)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

    traj, line = _job_cfg(res.stdout, "sft trajectories")
    horizons = [f"q{n}_train" for n in range(1, 9)]
    assert traj["teacher"]["benchmarks"] == horizons and traj["teacher"]["max_tasks"] == 1000
    assert all(f"results/benchmarks/{b}.parquet" in line for b in horizons)
    assert {n: traj["agent"]["turns"][f"q{n}"] for n in range(1, 9)} == {n: n + 4 for n in range(1, 9)}
    assert traj["agent"]["top_k"] == 2
    sft, _ = _job_cfg(res.stdout, "sft train --role student")
    assert sft["seq_len"] == 2048 and sft["student"] == {"steps": 12000}
    assert {k: sft["teacher"][k] for k in ("steps", "seq_len", "init", "layouts")} == {
        "steps": 9600, "seq_len": 2560, "init": "student_sft", "layouts": ["exact", "persistent"]}
    # the teacher keeps the student's budget in tokens (Design B's amendment)
    assert sft["teacher"]["steps"] * sft["teacher"]["seq_len"] == sft["student"]["steps"] * sft["seq_len"]
    bench, _ = _job_cfg(res.stdout, "benchmarks")
    train_sets = {s["n"]: s["tasks"] for s in bench["qn"]["sets"] if s["split"] == "train"}
    assert train_sets == {1: 1000, 2: 4000, 3: 1000, 4: 1000, 5: 1000, 6: 1000, 7: 1000, 8: 1000}
