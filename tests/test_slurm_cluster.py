"""A real SLURM run: the embedded default's RCE smoke target (tokenizer -> student init -> RCE, three
jobs) through `snakemake --profile slurm` with snakemake-executor-plugin-slurm on the one-node test
cluster of tests/slurm/start_cluster.sh. Jobs must be submitted, run and complete in SLURM, and their
outputs must equal a local run's byte for byte. Skipped when no such cluster is up."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from workflow_helpers import snakemake, workflow_copy

pytestmark = [pytest.mark.slurm, pytest.mark.slow]  # minutes: SLURM polling

TARGET = "results/audit/rce_smoke.json"
OUTPUTS = ["results/models/tokenizer/tokenizer.json", "results/models/student_init/model.safetensors",
           "results/audit/rce_smoke.json", "results/audit/rce_smoke.csv"]
RULES = ("tokenizer", "model_init", "rce_smoke")   # the jobs the target submits
HOW_TO_START = "start one with `bash tests/slurm/start_cluster.sh` (root, Debian/Ubuntu; .ci/run does)"


def _test_cluster_problem() -> str | None:
    """Why the one-node test cluster cannot be used, or None. Only that cluster (ClusterName
    memopd-test): the test must not submit to a real cluster it happens to run on."""
    for tool in ("sbatch", "squeue", "scontrol", "sinfo"):
        if not shutil.which(tool):
            return f"`{tool}` not installed"
    try:
        conf = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=20)
        nodes = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "slurmctld does not answer"
    if conf.returncode != 0:
        return f"slurmctld not reachable ({(conf.stderr.strip().splitlines() or ['?'])[-1][:200]})"
    if not re.search(r"^ClusterName\s*=\s*memopd-test\s*$", conf.stdout, re.M):
        return "the reachable SLURM is not the memopd-test cluster"
    if not {"idle", "mixed"} & set(nodes.stdout.split()):
        return f"no idle node (sinfo: {nodes.stdout.split()})"
    return None


def _tiny(wd):
    """wd/config/tiny.yaml: config/config.yaml with tiny random student and teacher (tests/agent_support)."""
    from agent_support import TINY_MODELS

    cfg = yaml.safe_load((wd / "config/config.yaml").read_text())
    cfg["models"].update({role: dict(arch) for role, arch in TINY_MODELS.items()})
    (wd / "config/tiny.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return wd


@pytest.fixture(scope="module")
def cluster():
    problem = _test_cluster_problem()
    if problem:
        pytest.skip(f"no one-node SLURM test cluster: {problem}; {HOW_TO_START}")


def _expected_resources(wd) -> dict:
    """rule -> (CPUs, mem_mb) that config/config.yaml gives it: resources.default overlaid by rules.<rule>."""
    res = yaml.safe_load((wd / "config/config.yaml").read_text())["resources"]
    spec = {rule: {**res["default"], **res.get("rules", {}).get(rule, {})} for rule in RULES}
    return {rule: (s["threads"], s["mem_mb"]) for rule, s in spec.items()}


def _job_fields(jobid: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", jobid], capture_output=True, text=True, timeout=20).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def test_smoke_target_through_slurm_matches_local_run(cluster, tmp_path):
    # the embedded default with the unit tests' tiny models (a tokenizer, a random model and its RCE in ~1 min; the
    # default's SmolLM2 would spend minutes de-quantising and scoring the same DAG shape)
    local = _tiny(workflow_copy(tmp_path / "local"))
    snakemake(local, "-c", "2", TARGET, "--configfile", "config/tiny.yaml", timeout=600)  # --configfile takes several

    wd = _tiny(workflow_copy(tmp_path / "slurm"))
    # This cluster's settings, through the same untracked site file a user writes: no accounting
    # database, so job status comes from squeue (slurm.conf keeps finished jobs, MinJobAge); keep the
    # SLURM logs of successful jobs to check them.
    (wd / "slurm" / "site.yaml").write_text(yaml.safe_dump({
        "slurm-status-command": "squeue",
        "slurm-init-seconds-before-status-checks": 2,
        "slurm-keep-successful-logs": True,
        "latency-wait": 5,
    }))
    r = snakemake(wd, TARGET, "--profile", "slurm", "--configfile", "config/tiny.yaml", timeout=540)
    log = r.stdout + r.stderr

    # Every step went through sbatch: "Job 2 has been submitted with SLURM jobid 17 (log: ...)", and
    # slurmctld (which keeps finished jobs, MinJobAge) saw it complete with the requested resources.
    expected = _expected_resources(wd)
    submitted = re.findall(r"Job \d+ has been submitted with SLURM jobid (\d+) \(log: (\S+)\)", log)
    assert len(submitted) == len(expected), log[-4000:]
    seen = {}
    for jobid, slurm_log in submitted:
        fields = _job_fields(jobid)
        # The executor's job comment: rule_<name>[_wildcards_<values>].
        rule = re.sub(r"^rule_|_wildcards_.*$", "", fields.get("Comment", ""))
        seen[rule] = fields
        assert fields.get("JobState") == "COMPLETED" and fields.get("ExitCode") == "0:0", (rule, fields)
        assert fields.get("WorkDir") == str(wd), (rule, fields)
        cpus, mem_mb = expected[rule]
        assert int(fields["NumCPUs"]) == cpus and f"mem={mem_mb}M" in fields.get("TRES", ""), (rule, fields)
        assert (wd / slurm_log).is_file(), slurm_log    # the job's own Snakemake log, kept by the site file
        assert f"rule {rule}:" in (wd / slurm_log).read_text()
    assert set(seen) == set(expected), seen.keys()
    assert "3 of 3 steps (100%) done" in log, log[-4000:]

    for path in OUTPUTS:
        assert (wd / path).read_bytes() == (local / path).read_bytes(), f"{path} differs from the local run"
