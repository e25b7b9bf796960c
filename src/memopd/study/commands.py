"""`memopd study ...`: the controlled study's decision rules, checked from a run's evaluations."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from memopd.inputs import existing, require
from memopd.outputs import write_json


def cmd_study_chain(args, cfg):
    """Design D's choice of the RL student along the SFT chain (memopd.study.chain), from the evaluations under
    --eval-dir; prints every condition of every snapshot and writes them with the choice to --out (JSON)."""
    from memopd.study.chain import Benchmarks, chain_models, check, report_lines

    require(cfg, "student", "teacher")
    existing(args.eval_dir)
    models = chain_models(cfg)
    choice = check(Path(args.eval_dir), models, args.teacher, Benchmarks(args.reward, args.short, args.long))
    lines = report_lines(choice)
    print("\n".join(lines))
    write_json(args.out, {"chosen": choice.model, "branch": choice.branch, "teacher": args.teacher,
                          "benchmarks": asdict(Benchmarks(args.reward, args.short, args.long)),
                          "candidates": [{"model": c.model, "passes": c.passes, "passes_fallback": c.passes_fallback,
                                          "conditions": {k: asdict(x) for k, x in c.conditions.items()}}
                                         for c in choice.candidates]})
    Path(args.out).with_suffix(".txt").write_text("\n".join(lines) + "\n")


def register(cli) -> None:
    sp = cli.add("study chain", cmd_study_chain, "Design D: the RL student chosen along the SFT chain (--cfg: the "
                 "`sft` section)")
    sp.add_argument("--eval-dir", required=True, help="results/eval: {model}/{benchmark}.json and .csv")
    sp.add_argument("--teacher", default="teacher_sft", help="the final teacher")
    sp.add_argument("--reward", default="q2_train", help="the sampled training-reward evaluation (temperature 1)")
    sp.add_argument("--short", default="q2_dev", help="the short horizon's dev tasks")
    sp.add_argument("--long", default="q8_dev", help="the long horizon's dev tasks")
    sp.add_argument("--out", required=True, help="JSON of every condition and the choice (and .txt beside it)")
