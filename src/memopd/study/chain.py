"""Design D's rule (docs/study.md "Third edition: the rules", rule D): the RL student is a snapshot of the SFT
chain that leads to the teacher (the student's SFT, then the teacher's continuation of it), the earliest one that

  (a) earns a training reward: its sampled EM on the first training tasks (temperature 1, RL's sampling) is at
      least REWARD_MIN, with its 95% BCa interval over the tasks above 0 (RL must have a signal);
  (b) acts at the long horizon: its greedy dev F1 there has a 95% BCa interval above 0,
  (c) and answers in at least ANSWERED of those episodes;
  (d) leaves the teacher room: the final teacher's greedy dev F1 minus its own is at least MARGIN, with the paired
      95% BCa interval over the dev tasks above 0, at the short and at the long horizon.

With no snapshot passing every condition, the fallback: the earliest one passing (a) and (d) at the short horizon;
the study then runs without the horizon claim among its primaries. With none passing those either: no-go.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

REWARD_MIN = 0.03  # sampled EM: about one answer in 16 tasks of two questions, a step of RL
ANSWERED = 0.5
MARGIN = 0.10


@dataclass(frozen=True)
class Condition:
    name: str
    figures: str
    passed: bool

    def line(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'}  {self.name}: {self.figures}"


@dataclass(frozen=True)
class Candidate:
    model: str
    conditions: dict[str, Condition]  # by letter: a, b, c, d_short, d_long

    @property
    def passes(self) -> bool:
        return all(c.passed for c in self.conditions.values())

    @property
    def passes_fallback(self) -> bool:
        return self.conditions["a"].passed and self.conditions["d_short"].passed


@dataclass(frozen=True)
class Benchmarks:
    reward: str = "q2_train"  # sampled, temperature 1 (eval.temperature of this benchmark)
    short: str = "q2_dev"
    long: str = "q8_dev"


def chain_models(sft: dict) -> list[str]:
    """The SFT chain's models in training order (the `sft` config section): the student's snapshots, the student,
    then the teacher's snapshots when the teacher continues the student (`sft.teacher.init: student_sft`). The
    final teacher is the teacher, not a candidate."""
    student = [f"student_sft_s{s}" for s in sft["student"].get("snapshots", [])] + ["student_sft"]
    if sft["teacher"].get("init") != "student_sft":
        return student
    return student + [f"teacher_sft_s{s}" for s in sft["teacher"].get("snapshots", [])]


def chain_config(sft: dict, teacher: str = "teacher_sft", b: Benchmarks = Benchmarks()) -> dict:
    """What the chain's table reads, as `memopd study chain` and the archive take it: the chain's models in order
    (the `sft` section), the final teacher and the three evaluations."""
    return {"models": chain_models(sft), "teacher": teacher, "benchmarks": asdict(b)}


def scores(path: Path, metric: str) -> tuple[dict, dict[str, float]]:
    """(summary JSON, {task_id: metric}) of one evaluation (path without suffix: its .json and .csv)."""
    from memopd.report.results import task_scores

    return json.loads(path.with_suffix(".json").read_text()), task_scores(path.with_suffix(".csv"), metric)


def _above_zero(name: str, scores: dict[str, float], minimum: float = 0.0) -> Condition:
    from memopd.report.results import paired_over_tasks

    pt = paired_over_tasks(dict.fromkeys(scores, 0.0), scores)
    need = f"needed >= {minimum} and interval above 0" if minimum else "needed interval above 0"
    return Condition(name, f"{pt['diff']:.3f} [{pt['ci_low']:+.3f}, {pt['ci_high']:+.3f}] over {pt['tasks']} tasks "
                     f"({need})", pt["ci_low"] > 0 and pt["diff"] >= minimum)


def _margin(name: str, model: dict[str, float], teacher: dict[str, float]) -> Condition:
    from memopd.report.results import paired_over_tasks

    pt = paired_over_tasks(model, teacher)
    return Condition(name, f"{pt['diff']:+.3f} [{pt['ci_low']:+.3f}, {pt['ci_high']:+.3f}] over {pt['tasks']} tasks "
                     f"(needed >= {MARGIN} and interval above 0)", pt["diff"] >= MARGIN and pt["ci_low"] > 0)


def candidate(eval_dir: Path, model: str, teacher: str, b: Benchmarks) -> Candidate:
    """One snapshot's conditions from its evaluations and the teacher's (eval_dir/{model}/{benchmark}.json|csv)."""
    _, reward = scores(eval_dir / model / b.reward, "em")
    _, short = scores(eval_dir / model / b.short, "f1")
    long_summary, long = scores(eval_dir / model / b.long, "f1")
    _, t_short = scores(eval_dir / teacher / b.short, "f1")
    _, t_long = scores(eval_dir / teacher / b.long, "f1")
    answered = long_summary["answered_rate"]
    return Candidate(model, {
        "a": _above_zero(f"sampled EM on {b.reward}", reward, REWARD_MIN),
        "b": _above_zero(f"greedy F1 on {b.long}", long),
        "c": Condition(f"answers on {b.long}", f"{answered:.3f} of {long_summary['episodes']} episodes (needed >= "
                       f"{ANSWERED})", answered >= ANSWERED),
        "d_short": _margin(f"teacher - it on {b.short}", short, t_short),
        "d_long": _margin(f"teacher - it on {b.long}", long, t_long),
    })


@dataclass(frozen=True)
class Choice:
    candidates: list[Candidate]
    model: str | None
    branch: str  # go | fallback | no-go


def choose(candidates: list[Candidate]) -> Choice:
    """The earliest candidate passing every condition (go), else the earliest passing the fallback's, else none."""
    for branch, ok in (("go", lambda c: c.passes), ("fallback", lambda c: c.passes_fallback)):
        chosen = next((c for c in candidates if ok(c)), None)
        if chosen:
            return Choice(candidates, chosen.model, branch)
    return Choice(candidates, None, "no-go")


def check(eval_dir: Path, models: list[str], teacher: str, b: Benchmarks = Benchmarks()) -> Choice:
    return choose([candidate(eval_dir, m, teacher, b) for m in models])


def report_lines(choice: Choice) -> list[str]:
    out = []
    for c in choice.candidates:
        out.append(f"{c.model}:")
        out += [f"  {'PASS' if x.passed else 'FAIL'} ({k}) {x.name}: {x.figures}" for k, x in c.conditions.items()]
    words = {"go": "passes every condition", "fallback": "passes (a) and (d) at the short horizon only (fallback: "
             "no horizon claim among the primaries)", "no-go": ""}
    out.append(f"chosen: {choice.model} ({choice.branch}: {words[choice.branch]})" if choice.model
               else "chosen: none (no-go: no snapshot passes (a) and (d) at the short horizon)")
    return out
