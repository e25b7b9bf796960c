"""Symmetric tuning of the controlled study's second edition (docs/study.md "Second edition: the design rules",
rule 3), on dev tasks and a dev seed: each method's grid of four runs, then the rule that picks each method's
setting and the number of steps.

    # one directory per grid point, each a copy of the dev run's results (its models and data, nothing rerun but
    # the run's training and evaluation), run two at a time:
    python workflow/scripts/tuning.py run --dev results/study_dev --out results/tuning \
        --configfile config/study.yaml config/study_design_a.yaml config/study_dev.yaml
    python workflow/scripts/tuning.py check --dev results/study_dev --out results/tuning

`check` prints each run's figures, whether it is admissible, each method's choice and the steps, and exits 0
whatever they say.
"""
from __future__ import annotations

import argparse
import itertools
import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml

# method -> ((train key, values), (train.ppo key, values)); the larger lr first, then the smaller regulariser
GRID = {
    "ppo": (("lr_actor", (1e-4, 3e-4)), ("beta", (0.001, 0.01))),
    "memopd": (("lr_actor", (1e-4, 3e-4)), ("opd_coef", (0.2, 1.0))),
}
SEED = 100  # the dev seed
BENCHMARK = "q2_test"  # dev Q2 tasks under config/study_dev.yaml
BLOCK = 50  # steps per block of the collapse and steps rules
COLLAPSE = 0.10  # invalid-action rate of the last block over the first's, at most
MAX_STEPS = 300


@dataclass(frozen=True)
class Point:
    method: str
    lr: float
    reg: float  # beta for ppo, lambda for memopd

    @property
    def name(self) -> str:
        return f"{self.method}_lr{self.lr:g}_{GRID[self.method][1][0]}{self.reg:g}"

    def overlay(self) -> dict:
        lr_key, (reg_key, _) = GRID[self.method][0][0], GRID[self.method][1]
        return {"train": {"methods": [self.method], "seeds": [SEED], "steps": MAX_STEPS, lr_key: self.lr,
                          "ppo": {reg_key: self.reg}}}


def points() -> list[Point]:
    return [Point(m, lr, reg) for m, ((_, lrs), (_, regs)) in GRID.items() for lr, reg in itertools.product(lrs, regs)]


def _run_one(p: Point, dev: Path, out: Path, configfiles: list[str]) -> int:
    d = out / p.name
    if not d.exists():  # the dev run's directory, mtimes kept: Snakemake reruns only what the overlay changes
        shutil.copytree(dev, d, symlinks=True, ignore=shutil.ignore_patterns("mlartifacts"))
    (d / "overlay.yaml").write_text(yaml.safe_dump(p.overlay(), sort_keys=True))
    target = f"results/eval/{p.method}_seed{SEED}/{BENCHMARK}.json"
    cmd = [sys.executable, "-m", "snakemake", "-s", str(Path("Snakefile").resolve()), "-d", str(d), "-c", "1",
           "--rerun-incomplete", target, "--configfile", *[str(Path(c).resolve()) for c in configfiles],
           str((d / "overlay.yaml").resolve())]
    with open(d / "tuning.log", "a") as log:
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode


def run(dev: Path, out: Path, configfiles: list[str], parallel: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(parallel) as pool:
        codes = list(pool.map(lambda p: (p.name, _run_one(p, dev, out, configfiles)), points()))
    for name, code in codes:
        print(f"{name}: exit {code}")


def _metrics(path: Path) -> list[dict]:
    """A run's metrics.jsonl, or its gzip beside it (an archived run: metrics.jsonl.gz)."""
    from memopd.report.curves import read_steps

    gz = path.with_name(path.name + ".gz")
    return read_steps(gz if not path.exists() and gz.exists() else path)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


@dataclass
class Outcome:
    point: Point
    invalid_first: float
    invalid_last: float
    f1: float
    diff: float
    ci_low: float
    ci_high: float
    reward: list[float]

    @property
    def collapsed(self) -> bool:
        return self.invalid_last - self.invalid_first > COLLAPSE

    @property
    def below_student(self) -> bool:
        return self.ci_high < 0

    @property
    def admissible(self) -> bool:
        return not self.collapsed and not self.below_student


def outcome(p: Point, dev: Path, out: Path, reward_key: str) -> Outcome:
    from memopd.report.results import paired_over_tasks, task_scores

    res = out / p.name / "results"
    steps = _metrics(res / "train" / p.method / f"seed{SEED}" / "metrics.jsonl")
    invalid = [s["rollout/invalid_rate"] for s in steps]
    run_eval = res / "eval" / f"{p.method}_seed{SEED}" / BENCHMARK
    pt = paired_over_tasks(task_scores(dev / "results" / "eval" / "student_sft" / f"{BENCHMARK}.csv", "f1"),
                           task_scores(run_eval.with_suffix(".csv"), "f1"))
    return Outcome(p, _mean(invalid[:BLOCK]), _mean(invalid[-BLOCK:]),
                   json.loads(run_eval.with_suffix(".json").read_text())["f1"], pt["diff"], pt["ci_low"],
                   pt["ci_high"], [s[reward_key] for s in steps])


def choose(outcomes: list[Outcome]) -> Outcome | None:
    """The admissible run with the largest lr, then the smaller regulariser; None: no admissible run."""
    ok = [o for o in outcomes if o.admissible]
    return min(ok, key=lambda o: (-o.point.lr, o.point.reg)) if ok else None


def flat_after(reward: list[float], s: int) -> bool:
    """The mean reward of steps s..s+BLOCK-1 minus that of s-BLOCK..s-1 holds 0 in its 95% bootstrap interval."""
    from memopd.stats import unpaired_bootstrap

    _, lo, hi = unpaired_bootstrap(reward[s - BLOCK:s], reward[s:s + BLOCK], seed=s)
    return lo <= 0 <= hi


def steps_rule(rewards: list[list[float]]) -> int:
    """The smallest multiple of BLOCK after which every chosen run's reward is flat (MAX_STEPS if none)."""
    n = min(len(r) for r in rewards)
    for s in range(BLOCK, min(n, MAX_STEPS) - BLOCK + 1, BLOCK):
        if all(flat_after(r, s) for r in rewards):
            return s
    return MAX_STEPS


def check(dev: Path, out: Path, reward_key: str) -> None:
    chosen = []
    for method in GRID:
        outs = [outcome(p, dev, out, reward_key) for p in points() if p.method == method]
        for o in outs:
            print(f"{o.point.name}: invalid {o.invalid_first:.3f} -> {o.invalid_last:.3f}"
                  f"{' COLLAPSED' if o.collapsed else ''}; greedy dev F1 {o.f1:.3f}, minus the student "
                  f"{o.diff:+.3f} [{o.ci_low:+.3f}, {o.ci_high:+.3f}]{' BELOW' if o.below_student else ''}; "
                  f"{'admissible' if o.admissible else 'not admissible'}")
        c = choose(outs)
        print(f"{method}: {c.point.name if c else 'no admissible run'}")
        chosen += [c] if c else []
    if len(chosen) == len(GRID):
        print(f"steps: {steps_rule([c.reward for c in chosen])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("run", "check"))
    ap.add_argument("--dev", required=True, help="the dev run's directory (the nested workflow's, with results/)")
    ap.add_argument("--out", required=True, help="a directory per grid point goes here")
    ap.add_argument("--configfile", nargs="+", help="run: the dev run's config files, in order")
    ap.add_argument("--parallel", type=int, default=2, help="run: grid points at a time (one thread each)")
    ap.add_argument("--reward", default="reward/em", help="check: the training reward's metric")
    a = ap.parse_args()
    if a.action == "run":
        if not a.configfile:
            ap.error("run needs --configfile")
        run(Path(a.dev), Path(a.out), a.configfile, a.parallel)
    else:
        check(Path(a.dev), Path(a.out), a.reward)


if __name__ == "__main__":
    main()
