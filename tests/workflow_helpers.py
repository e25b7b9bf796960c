"""Helpers of the workflow tests: a scratch copy of the workflow, Snakemake runs, dry-run parsing."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What a run of the workflow reads; results/, .snakemake/ and an untracked slurm/site.yaml stay behind.
WORKFLOW_FILES = ["Snakefile", "workflow", "config", "envs", "src", "slurm/config.yaml", "slurm/site.example.yaml"]


def workflow_copy(dest: Path) -> Path:
    """A fresh copy of the workflow in `dest` (data/ linked, read only by the steps)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in WORKFLOW_FILES:
        src, dst = REPO / name, dest / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(src, dst)
    (dest / "data").symlink_to(REPO / "data", target_is_directory=True)
    return dest


def snakemake_env() -> dict:
    """The environment of a Snakemake run, without settings of the caller's own runs (site file,
    profile). The steps need nothing from PATH: they run under Snakemake's interpreter."""
    return {k: v for k, v in os.environ.items()
            if k not in ("MEMOPD_SLURM_SITE", "MEMOPD_SRC", "MEMOPD_PYTHON") and not k.startswith("SNAKEMAKE_")}


def snakemake(cwd: Path, *args: str, timeout: int = 120, check: bool = True) -> subprocess.CompletedProcess:
    """Run Snakemake in `cwd` under `timeout -s INT` (Snakemake cancels its jobs on SIGINT, not SIGTERM)."""
    cmd = ["timeout", "-s", "INT", "-k", "30", str(timeout), sys.executable, "-m", "snakemake", *args]
    r = subprocess.run(cmd, cwd=cwd, env=snakemake_env(), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {r.returncode}\n--- stdout\n{r.stdout[-6000:]}\n--- stderr\n{r.stderr[-6000:]}")
    return r


def parse_resources(text: str) -> dict:
    """'tmpdir=/tmp, mem_mb=2000, mem=2 GB, gpu=0' -> {'tmpdir': '/tmp', 'mem_mb': 2000, ...}."""
    out = {}
    for item in text.split(", "):
        key, _, value = item.partition("=")
        out[key.strip()] = int(value) if re.fullmatch(r"-?\d+", value) else value
    return out


def dry_run_jobs(output: str) -> list[dict]:
    """The jobs that `snakemake -n` prints: one dict per job with rule, wildcards, resources."""
    jobs, job = [], None
    for line in output.splitlines():
        m = re.match(r"^(?:local)?rule (\w+):$", line)
        if m:
            job = {"rule": m.group(1), "wildcards": "", "resources": {}}
            jobs.append(job)
        elif job is not None and (m := re.match(r"^\s+(wildcards|resources): (.*)$", line)):
            job[m.group(1)] = parse_resources(m.group(2)) if m.group(1) == "resources" else m.group(2)
        elif not line.startswith(" "):
            job = None
    return jobs


def rule_kinds() -> dict[str, dict]:
    """Rule name -> {'kind': 'gpu' / 'cpu' / None, 'command': bool} from the rule sources. The kind is
    what a rule declares through its conda environment (ENV_GPU: runs on GPUs at paper scale)."""
    kinds = {}
    for path in [REPO / "Snakefile", *sorted((REPO / "workflow" / "rules").glob("*.smk"))]:
        text = path.read_text()
        starts = [(m.start(), m.group(1)) for m in re.finditer(r"^rule (\w+):", text, re.M)]
        for i, (pos, name) in enumerate(starts):
            block = text[pos:starts[i + 1][0] if i + 1 < len(starts) else len(text)]
            kind = "gpu" if re.search(r"conda:\s*ENV_GPU\b", block) else "cpu" if re.search(r"conda:\s*ENV_CPU\b", block) else None
            command = bool(re.search(r"^\s+(shell|run|script|notebook|wrapper):", block, re.M))
            kinds[name] = {"kind": kind, "command": command}
        for base, name in re.findall(r"^use rule (\w+) as (\w+)", text, re.M):  # inherits kind and command
            kinds[name] = kinds[base]
    return kinds
