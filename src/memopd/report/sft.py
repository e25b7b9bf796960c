"""The SFT summary table (results/tables/sft_summary.csv): one row per model (student_init, student_sft,
teacher_sft), and each model's F1 and EM against a reference model (the SFT student) task by task: the mean
difference with a 95% paired BCa bootstrap interval over tasks (the per-task CSV beside each evaluation's JSON),
and whether it excludes 0: is the teacher measurably better than the student, does SFT beat zero-shot."""
from __future__ import annotations

import json
from pathlib import Path

from memopd.inputs import UsageError
from memopd.report.results import paired_over_tasks, task_scores
from memopd.outputs import write_table


def model_row(name: str, heldout: dict, ev: dict, info: dict) -> dict:
    # train_seconds: SFT only (a snapshot of an SFT run: that run's seconds up to it); pretrain_seconds: the LM
    # pre-training stage before it (0: none)
    sft = info["snapshot"] if "snapshot" in info else info.get("sft", {})
    return {"model": name, "params": heldout["params"], "train_seconds": sft.get("train_seconds", 0.0),
            "heldout_target_loss": heldout["heldout_target_loss"], "invalid_action_rate": ev["invalid_action_rate"],
            "em": ev["em"], "f1": ev["f1"], "pretrain_seconds": info.get("pretrain", {}).get("train_seconds", 0.0),
            "calls_per_episode": ev["calls_per_episode"], "answered_rate": ev["answered_rate"],
            "copy_f1": ev.get("copy_f1", float("nan"))}


def summary(names: list[str], heldout: list[str], evals: list[str], infos: list[str],
            reference: str) -> tuple[list[dict], list[str]]:
    """(rows, findings) of the models `names`, their files given in the same order."""
    if not len(names) == len(heldout) == len(evals) == len(infos):
        raise UsageError(f"{len(names)} names, {len(heldout)} held-out, {len(evals)} eval and {len(infos)} info "
                         "files: one of each per model")
    if reference not in names:
        raise UsageError(f"--reference {reference} is not among --names {names}")
    rows, scores = [], {}
    for name, h, e, i in zip(names, heldout, evals, infos):
        rows.append(model_row(name, *(json.loads(Path(p).read_text()) for p in (h, e, i))))
        scores[name] = {m: task_scores(Path(e).with_suffix(".csv"), m) for m in ("f1", "em")}
    notes, ref = [], scores[reference]
    for row in rows:
        for m in ("f1", "em"):
            try:
                pt = paired_over_tasks(ref[m], scores[row["model"]][m])
            except ValueError as e:
                raise UsageError(f"{row['model']} and {reference} were {e}") from None
            row.update({f"{m}_vs_ref": pt["diff"], f"{m}_vs_ref_ci_low": pt["ci_low"],
                        f"{m}_vs_ref_ci_high": pt["ci_high"]})
            if m == "f1" and row["model"] != reference:
                notes.append(f"Finding: {row['model']} - {reference}: F1 {pt['diff']:+.3f} "
                             f"[{pt['ci_low']:+.3f}, {pt['ci_high']:+.3f}] over {pt['tasks']} tasks, {pt['noise']}")
    return rows, notes


def write_summary(rows: list[dict], notes: list[str], first_eval: str, reference: str, out: str | Path) -> None:
    bench, n = Path(first_eval).stem, json.loads(Path(first_eval).read_text())["episodes"]
    write_table(rows, out, f"SFT summary: held-out target loss on the held-out turn examples; EM/F1, "
                f"invalid-action rate, calls per episode, answered rate and the copy probe on {bench} "
                f"({n} tasks, greedy); *_vs_ref: the model minus {reference}, task by task, with a 95% paired "
                f"BCa bootstrap interval over tasks", notes=notes)
