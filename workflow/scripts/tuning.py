"""Symmetric tuning of the controlled study (docs/study.md; the rules: memopd.study.tuning): runs each method's grid
on dev tasks and a dev seed, then prints the rule's verdicts (`memopd study tuning`).

    # one directory per grid point, each a copy of the dev run's results (its models and data, nothing rerun but
    # the run's training and evaluation), run two at a time:
    python workflow/scripts/tuning.py run --dev results/study_dev --out results/tuning \
        --configfile config/study/base.yaml config/study/design_a.yaml config/study/dev.yaml
    python workflow/scripts/tuning.py check --dev results/study_dev --out results/tuning
    # the third edition's rule T: its grid, its dev tasks and the student rule D chose
    python workflow/scripts/tuning.py run --rule third --benchmark q2_dev --student STUDENT ...

`check` prints each run's figures, whether it is admissible, each method's choice and the steps, and exits 0
whatever they say.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from memopd.study.tuning import RULES, SEED, Point, check, points


def _run_one(p: Point, dev: Path, out: Path, configfiles: list[str], benchmark: str, student: str | None) -> int:
    d = out / p.name
    if not d.exists():  # the dev run's directory, mtimes kept: Snakemake reruns only what the overlay changes
        shutil.copytree(dev, d, symlinks=True, ignore=shutil.ignore_patterns("mlartifacts"))
    (d / "overlay.yaml").write_text(yaml.safe_dump(p.overlay(student), sort_keys=True))
    target = f"results/eval/{p.method}_seed{SEED}/{benchmark}.json"
    cmd = [sys.executable, "-m", "snakemake", "-s", str(Path("Snakefile").resolve()), "-d", str(d), "-c", "1",
           "--rerun-incomplete", target, "--configfile", *[str(Path(c).resolve()) for c in configfiles],
           str((d / "overlay.yaml").resolve())]
    with open(d / "tuning.log", "a") as log:
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode


def run(dev: Path, out: Path, configfiles: list[str], parallel: int, rule: str, benchmark: str,
        student: str | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(parallel) as pool:
        codes = list(pool.map(lambda p: (p.name, _run_one(p, dev, out, configfiles, benchmark, student)),
                              points(rule)))
    for name, code in codes:
        print(f"{name}: exit {code}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("run", "check"))
    ap.add_argument("--dev", required=True, help="the dev run's directory (the nested workflow's, with results/)")
    ap.add_argument("--out", required=True, help="a directory per grid point goes here")
    ap.add_argument("--rule", default="second", choices=sorted(RULES), help="the edition of the rule")
    ap.add_argument("--benchmark", default="q2_test", help="the dev tasks' evaluation")
    ap.add_argument("--student", help="the SFT student the runs start from (default: the config's train.student)")
    ap.add_argument("--configfile", nargs="+", help="run: the dev run's config files, in order")
    ap.add_argument("--parallel", type=int, default=2, help="run: grid points at a time (one thread each)")
    ap.add_argument("--reward", default="reward/em", help="check: the training reward's metric")
    a = ap.parse_args()
    if a.action == "run":
        if not a.configfile:
            ap.error("run needs --configfile")
        run(Path(a.dev), Path(a.out), a.configfile, a.parallel, a.rule, a.benchmark, a.student)
    else:
        print("\n".join(check(Path(a.dev), Path(a.out), a.reward, a.rule, a.benchmark, a.student or "student_sft")))


if __name__ == "__main__":
    main()
