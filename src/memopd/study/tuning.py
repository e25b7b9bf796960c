"""Symmetric tuning of the controlled study (docs/study.md): each method's grid of dev runs (one dev seed, dev
tasks), which of them are admissible, each method's choice and the steps. Two editions of the rule, each written
before its runs:

- `second` (rule 3): lr x regulariser, 2 x 2 a method, 300 steps; the admissible run with the largest lr, then the
  smaller regulariser; the steps: the smallest multiple of BLOCK after which every chosen run's reward is flat.
- `third` (rule T): lr x regulariser, 2 x 3 a method, 150 steps, the budget of every run; the admissible run with
  the highest greedy dev F1 (ties to three decimals: the higher mean reward over the last BLOCK steps, then the
  smaller lr); with none admissible, the highest dev F1 anyway, reported as such.

Admissible (both): no collapse (invalid-action rate of the last BLOCK steps at most COLLAPSE above the first
BLOCK's) and the greedy dev F1 not below the SFT student's (paired 95% BCa interval over the dev tasks not entirely
below 0). The runs themselves are made by workflow/scripts/tuning.py (one copy of the dev run per grid point).
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

SEED = 100  # the dev seed
BLOCK = 50  # steps per block of the collapse and steps rules
COLLAPSE = 0.10  # invalid-action rate of the last block over the first's, at most


@dataclass(frozen=True)
class Rule:
    name: str
    grid: dict  # method -> ((train key, values), (train.ppo key, values))
    steps: int  # steps of every grid run
    select: str  # largest_lr | best_f1
    steps_rule: bool  # choose the test runs' steps by the flatness of the chosen runs' reward (else `steps`)


RULES = {
    "second": Rule("second", {"ppo": (("lr_actor", (1e-4, 3e-4)), ("beta", (0.001, 0.01))),
                              "memopd": (("lr_actor", (1e-4, 3e-4)), ("opd_coef", (0.2, 1.0)))}, 300, "largest_lr", True),
    "third": Rule("third", {"ppo": (("lr_actor", (1e-4, 3e-4)), ("beta", (0.001, 0.01, 0.1))),
                            "memopd": (("lr_actor", (1e-4, 3e-4)), ("opd_coef", (0.2, 1.0, 3.0)))}, 150, "best_f1", False),
}


@dataclass(frozen=True)
class Point:
    method: str
    lr: float
    reg: float  # beta for ppo, lambda (opd_coef) for memopd
    rule: str = "second"

    @property
    def reg_key(self) -> str:
        return RULES[self.rule].grid[self.method][1][0]

    @property
    def name(self) -> str:
        return f"{self.method}_lr{self.lr:g}_{self.reg_key}{self.reg:g}"

    def overlay(self, student: str | None = None) -> dict:
        """The config layered over the dev run's to make this grid point's run (seed SEED)."""
        train = {"methods": [self.method], "seeds": [SEED], "steps": RULES[self.rule].steps,
                 RULES[self.rule].grid[self.method][0][0]: self.lr, "ppo": {self.reg_key: self.reg}}
        return {"train": {**train, **({"student": student} if student else {})}}


def points(rule: str = "second") -> list[Point]:
    return [Point(m, lr, reg, rule) for m, ((_, lrs), (_, regs)) in RULES[rule].grid.items()
            for lr, reg in itertools.product(lrs, regs)]


def read_metrics(path: Path) -> list[dict]:
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

    @property
    def last_reward(self) -> float:
        return _mean(self.reward[-BLOCK:])

    def blocks(self) -> list[float]:
        return [_mean(self.reward[i:i + BLOCK]) for i in range(0, len(self.reward) - BLOCK + 1, BLOCK)]


def outcome(p: Point, dev: Path, out: Path, reward_key: str, benchmark: str, student: str) -> Outcome:
    """A grid run's figures: its metrics and dev evaluation (out/{point}/results/...) against the student's
    evaluation in the dev run (dev/results/eval/{student}/{benchmark})."""
    from memopd.report.results import paired_over_tasks, task_scores

    res = out / p.name / "results"
    steps = read_metrics(res / "train" / p.method / f"seed{SEED}" / "metrics.jsonl")
    invalid = [s["rollout/invalid_rate"] for s in steps]
    run_eval = res / "eval" / f"{p.method}_seed{SEED}" / benchmark
    pt = paired_over_tasks(task_scores(dev / "results" / "eval" / student / f"{benchmark}.csv", "f1"),
                           task_scores(run_eval.with_suffix(".csv"), "f1"))
    return Outcome(p, _mean(invalid[:BLOCK]), _mean(invalid[-BLOCK:]),
                   json.loads(run_eval.with_suffix(".json").read_text())["f1"], pt["diff"], pt["ci_low"],
                   pt["ci_high"], [s[reward_key] for s in steps])


def choose(outcomes: list[Outcome], select: str = "largest_lr") -> Outcome | None:
    """Each rule's choice among one method's runs (module docstring); None: no admissible run (`largest_lr`)."""
    ok = [o for o in outcomes if o.admissible]
    if select == "largest_lr":
        return min(ok, key=lambda o: (-o.point.lr, o.point.reg)) if ok else None
    if select != "best_f1":
        raise ValueError(f"unknown selection {select!r}")
    return max(ok or outcomes, key=lambda o: (round(o.f1, 3), o.last_reward, -o.point.lr)) if outcomes else None


def flat_after(reward: list[float], s: int) -> bool:
    """The mean reward of steps s..s+BLOCK-1 minus that of s-BLOCK..s-1 holds 0 in its 95% bootstrap interval."""
    from memopd.stats import unpaired_bootstrap

    _, lo, hi = unpaired_bootstrap(reward[s - BLOCK:s], reward[s:s + BLOCK], seed=s)
    return lo <= 0 <= hi


def steps_rule(rewards: list[list[float]], max_steps: int = 300) -> int:
    """The smallest multiple of BLOCK after which every chosen run's reward is flat (max_steps if none)."""
    n = min(len(r) for r in rewards)
    for s in range(BLOCK, min(n, max_steps) - BLOCK + 1, BLOCK):
        if all(flat_after(r, s) for r in rewards):
            return s
    return max_steps


def _line(o: Outcome, rule: Rule) -> str:
    line = (f"{o.point.name}: invalid {o.invalid_first:.3f} -> {o.invalid_last:.3f}"
            f"{' COLLAPSED' if o.collapsed else ''}; greedy dev F1 {o.f1:.3f}, minus the student "
            f"{o.diff:+.3f} [{o.ci_low:+.3f}, {o.ci_high:+.3f}]{' BELOW' if o.below_student else ''}; "
            f"{'admissible' if o.admissible else 'not admissible'}")
    if rule.select == "best_f1":
        line += f"; reward by block of {BLOCK} steps {' '.join(f'{r:.3f}' for r in o.blocks())}"
    return line


def check(dev: Path, out: Path, reward_key: str = "reward/em", rule: str = "second", benchmark: str = "q2_test",
          student: str = "student_sft") -> list[str]:
    """Every run's figures, each method's choice and the steps, as lines."""
    r, lines, chosen = RULES[rule], [], []
    for method in r.grid:
        outs = [outcome(p, dev, out, reward_key, benchmark, student) for p in points(rule) if p.method == method]
        lines += [_line(o, r) for o in outs]
        c = choose(outs, r.select)
        note = "" if c is None or c.admissible else " (no admissible run: the highest dev F1, not admissible)"
        lines.append(f"{method}: {c.point.name if c else 'no admissible run'}{note}")
        chosen += [c] if c else []
    if len(chosen) == len(r.grid):
        lines.append(f"steps: {steps_rule([c.reward for c in chosen], r.steps) if r.steps_rule else r.steps}")
    return lines
