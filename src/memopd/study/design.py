"""The controlled study's design rules on dev tasks (docs/study.md "Second edition: the design rules"), checked
from a dev run's evaluations (RESULTS/eval/{model}/{benchmark}.json and its per-task .csv) by `memopd study design`:

- go/no-go of a design: the SFT student answers in >= 50% of the long horizon's episodes, with F1 there >= 0.5x
  its F1 on the training horizon; the teacher beats the student on both (paired 95% BCa interval over tasks
  above 0);
- the teacher that knows both states (`--persistent DIR`: the teacher's evaluation with `agent.view: persistent`,
  written by workflow/scripts/flattened_eval.py): its F1 on the persistent flattening minus its F1 on its own
  states within +-0.02 (the mean over the same tasks), and above the student's on both;
- for a no-go (Design B's rule): each horizon's SFT student F1 with its 95% BCa interval over tasks, above 0 or not.

    memopd study design --results results/study_dev/results \
        [--short q2_test] [--long q8_test] [--long-results DIR] [--persistent /tmp/flattened/teacher_sft]

It prints each condition with its figures and PASS/FAIL, and exits 0 whatever they say (a failed rule is a result).
"""
from __future__ import annotations

from pathlib import Path

from memopd.report.results import paired_over_tasks
from memopd.study.chain import Condition, scores

ANSWERED = 0.5  # share of the long horizon's episodes the student answers
RATIO = 0.5  # student's long-horizon F1 over its short-horizon F1
TOLERANCE = 0.02  # teacher's F1 on the persistent flattening minus its own, at most this far from 0


def _beats(name: str, base: dict[str, float], other: dict[str, float]) -> Condition:
    pt = paired_over_tasks(base, other)
    return Condition(name, f"{pt['diff']:+.3f} [{pt['ci_low']:+.3f}, {pt['ci_high']:+.3f}] over {pt['tasks']} tasks",
                     pt["ci_low"] > 0)


def go_no_go(results: Path, short: str, long: str, long_results: Path | None = None) -> list[Condition]:
    """The design's go/no-go conditions on the student (student_sft) and teacher (teacher_sft). `long_results`:
    the long horizon's models and evaluations when they are another run's (Design B trains at each horizon)."""
    long_results = long_results or results
    s_short, f_s_short = scores(results / "eval" / "student_sft" / short, "f1")
    s_long, f_s_long = scores(long_results / "eval" / "student_sft" / long, "f1")
    _, f_t_short = scores(results / "eval" / "teacher_sft" / short, "f1")
    _, f_t_long = scores(long_results / "eval" / "teacher_sft" / long, "f1")
    ratio = s_long["f1"] / s_short["f1"] if s_short["f1"] > 0 else float("nan")
    return [
        Condition(f"student answers {long}", f"{s_long['answered_rate']:.3f} of {s_long['episodes']} episodes "
                  f"(needed >= {ANSWERED})", s_long["answered_rate"] >= ANSWERED),
        Condition(f"student F1 {long} / {short}", f"{s_long['f1']:.3f} / {s_short['f1']:.3f} = {ratio:.2f} "
                  f"(needed >= {RATIO})", ratio >= RATIO),
        _beats(f"teacher - student F1 on {short}", f_s_short, f_t_short),
        _beats(f"teacher - student F1 on {long}", f_s_long, f_t_long),
    ]


def student_above_zero(results: Path, bench: str) -> Condition:
    """The no-go branch's horizon rule: a horizon enters the study when its SFT student's F1 has a 95% BCa interval
    over the dev tasks above 0."""
    _, f1 = scores(results / "eval" / "student_sft" / bench, "f1")
    pt = paired_over_tasks(dict.fromkeys(f1, 0.0), f1)
    return Condition(f"student F1 on {bench} above 0", f"{pt['diff']:.3f} [{pt['ci_low']:+.3f}, {pt['ci_high']:+.3f}] "
                     f"over {pt['tasks']} tasks", pt["ci_low"] > 0)


def both_states(results: Path, persistent: Path, short: str) -> list[Condition]:
    """The teacher acting on the persistent flattening against its own states and against the student."""
    t_own, f_own = scores(results / "eval" / "teacher_sft" / short, "f1")
    t_per, f_per = scores(persistent / short, "f1")
    _, f_student = scores(results / "eval" / "student_sft" / short, "f1")
    pt = paired_over_tasks(f_own, f_per)
    return [
        Condition(f"teacher F1 persistent - own on {short}",
                  f"{t_per['f1']:.3f} - {t_own['f1']:.3f} = {pt['diff']:+.3f} [{pt['ci_low']:+.3f}, "
                  f"{pt['ci_high']:+.3f}] over {pt['tasks']} tasks (needed within +-{TOLERANCE})",
                  abs(pt["diff"]) <= TOLERANCE),
        _beats(f"teacher on its own states - student on {short}", f_student, f_own),
        _beats(f"teacher on the persistent flattening - student on {short}", f_student, f_per),
    ]


def checks(results: Path, short: str, long: str, long_results: Path | None = None,
           persistent: Path | None = None) -> list[Condition]:
    """Every condition of the design rules, in the order `memopd study design` prints them."""
    conds = go_no_go(results, short, long, long_results)
    conds += [student_above_zero(results, short), student_above_zero(long_results or results, long)]
    if persistent:
        conds += both_states(results, persistent, short)
    return conds
