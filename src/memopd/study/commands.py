"""`memopd study ...`: the controlled study's decision rules, checked from a run's evaluations."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from memopd.config import ClaimsConfig, TrainRuns
from memopd.inputs import existing, require
from memopd.outputs import write_json


def cmd_study_chain(args, cfg):
    """Design D's choice of the RL student along the SFT chain (memopd.study.chain), from the evaluations under
    --eval-dir; prints every condition of every snapshot and writes them with the choice to --out (JSON)."""
    from memopd.study.chain import Benchmarks, chain_config

    require(cfg, "student", "teacher")
    existing(args.eval_dir)
    chain_table(chain_config(cfg, args.teacher, Benchmarks(args.reward, args.short, args.long)), args.eval_dir, args.out)


def chain_table(chain: dict, eval_dir: str | Path, out: str | Path) -> None:
    """sft_chain.json and .txt (every condition of every snapshot and the choice) from the evaluations."""
    from memopd.study.chain import Benchmarks, check, report_lines

    b = Benchmarks(**chain["benchmarks"])
    choice = check(Path(eval_dir), chain["models"], chain["teacher"], b)
    lines = report_lines(choice)
    print("\n".join(lines))
    write_json(out, {"chosen": choice.model, "branch": choice.branch, "teacher": chain["teacher"],
                     "benchmarks": asdict(b),
                     "candidates": [{"model": c.model, "passes": c.passes, "passes_fallback": c.passes_fallback,
                                     "conditions": {k: asdict(x) for k, x in c.conditions.items()}}
                                    for c in choice.candidates]})
    Path(out).with_suffix(".txt").write_text("\n".join(lines) + "\n")


def cmd_study_claims(args, cfg):
    """results/tables/claims.{csv,md}: the paper's claims over seeds (memopd.study.claims), the primaries of
    `claims.primary` Holm-adjusted together. --cfg: {"train": the train section, "claims": the claims section}."""
    require(cfg, "train", "claims")
    claims_table(TrainRuns.from_section(cfg["train"]), ClaimsConfig.from_dict(cfg["claims"]), args.eval_dir, args.out)


def claims_table(train: TrainRuns, claims: ClaimsConfig, eval_dir: str | Path, out: str | Path) -> list[dict]:
    from memopd.outputs import print_table, write_table
    from memopd.report.results import load_scores, seeds_words
    from memopd.stats import VERDICT_RULE
    from memopd.study.claims import claim_notes, claim_rows

    seeds = train.method_seeds()
    scores = load_scores(eval_dir, seeds, [claims.short, claims.long])
    f1 = {k: {s: r["f1"] for s, r in v.items()} for k, v in scores.items()}
    rows = claim_rows(f1, list(claims.primary), claims.short, claims.long)
    caption = (f"The paper's claims over seeds ({seeds_words(seeds)}; F1, greedy): the primaries declared before the "
               f"run ({', '.join(claims.primary)}) Holm-adjusted together (p_holm), the others secondary; each "
               f"claim's estimate with its 95% interval and exact two-sided p (the same seeds: paired t interval and "
               f"sign-flip p over the sign patterns; else Welch's interval and the permutation p over the splits; a "
               f"growth: per seed, long minus short horizon, t interval and sign-flip p); noise: {VERDICT_RULE}, "
               f"by p_holm for a primary; paper_pct: the paper's relative change where it reports one")
    write_table(rows, out, caption, notes=claim_notes(rows))
    print_table(rows, out)
    return rows


def cmd_study_design(args, cfg):
    """The design rules on a dev run's evaluations (memopd.study.design): printed, exit 0 whatever they say."""
    from memopd.study.design import checks

    existing(args.results, *(p for p in (args.long_results, args.persistent) if p))
    opt = (lambda p: Path(p) if p else None)
    for c in checks(Path(args.results), args.short, args.long, opt(args.long_results), opt(args.persistent)):
        print(c.line())


def cmd_study_probe_names(args, cfg):
    """How often a model copies question 1's names into its first search (memopd.study.probes.names_probe)."""
    from memopd.study.probes import names_probe

    existing(args.model_dir, args.episodes)
    print(json.dumps(names_probe(args.model_dir, args.episodes)))


def cmd_study_probe_induction(args, cfg):
    """How often a model copies a random token sequence's repeat (memopd.study.probes.induction_probe)."""
    from memopd.study.probes import induction_probe

    existing(args.model_dir)
    print(json.dumps(induction_probe(args.model_dir, args.sequences, tuple(args.length), args.seed)))


def register_probes(cli) -> None:
    sp = cli.add("study design", cmd_study_design, "the design rules (go/no-go, both states, horizons above 0) on a "
                 "dev run's evaluations")
    sp.add_argument("--results", required=True, help="the dev run's results/ directory")
    sp.add_argument("--short", default="q2_test", help="the training horizon's benchmark")
    sp.add_argument("--long", default="q8_test", help="the long horizon's benchmark")
    sp.add_argument("--long-results", help="the long horizon's results/ directory, when another run's (Design B)")
    sp.add_argument("--persistent", help="the teacher's evaluation directory with agent.view persistent")
    sp = cli.add("study probe-names", cmd_study_probe_names, "teacher-forced: a model's greedy tokens of question "
                 "1's names and template in its first search")
    sp.add_argument("model_dir")
    sp.add_argument("episodes", help="an evaluation's episodes (.episodes.parquet)")
    sp = cli.add("study probe-induction", cmd_study_probe_induction, "a model's greedy tokens over the repeat of "
                 "random token sequences (seeded by --seed)")
    sp.add_argument("model_dir")
    sp.add_argument("--sequences", type=int, default=64)
    sp.add_argument("--length", type=int, nargs=2, default=(16, 96))


def register(cli) -> None:
    register_tuning(cli)
    register_probes(cli)
    sp = cli.add("study claims", cmd_study_claims, "the paper's claims over seeds, the declared primaries Holm-"
                 "adjusted together (--cfg: {train, claims})")
    sp.add_argument("--eval-dir", required=True, help="results/eval: {method}_seed{seed}/{benchmark}.json")
    sp.add_argument("--out", required=True, help="CSV (and .md beside it)")
    sp = cli.add("study chain", cmd_study_chain, "Design D: the RL student chosen along the SFT chain (--cfg: the "
                 "`sft` section)")
    sp.add_argument("--eval-dir", required=True, help="results/eval: {model}/{benchmark}.json and .csv")
    sp.add_argument("--teacher", default="teacher_sft", help="the final teacher")
    sp.add_argument("--reward", default="q2_train", help="the sampled training-reward evaluation (temperature 1)")
    sp.add_argument("--short", default="q2_dev", help="the short horizon's dev tasks")
    sp.add_argument("--long", default="q8_dev", help="the long horizon's dev tasks")
    sp.add_argument("--out", required=True, help="JSON of every condition and the choice (and .txt beside it)")


def cmd_study_tuning(args, cfg):
    """The tuning rule's verdicts on a grid of dev runs (memopd.study.tuning): printed, exit 0 whatever they say."""
    from memopd.study.tuning import check

    existing(args.dev, args.out)
    print("\n".join(check(Path(args.dev), Path(args.out), args.reward, args.rule, args.benchmark, args.student)))


def register_tuning(cli) -> None:
    from memopd.study.tuning import RULES

    sp = cli.add("study tuning", cmd_study_tuning, "symmetric tuning: each grid run's figures, each method's choice "
                 "and the steps")
    sp.add_argument("--dev", required=True, help="the dev run's directory (with results/): the student's evaluation")
    sp.add_argument("--out", required=True, help="the grid's directory: one directory per grid point")
    sp.add_argument("--rule", default="second", choices=sorted(RULES), help="the edition of the rule")
    sp.add_argument("--benchmark", default="q2_test", help="the dev tasks' evaluation (q2_test of a dev-pool run)")
    sp.add_argument("--student", default="student_sft", help="the SFT student the runs start from")
    sp.add_argument("--reward", default="reward/em", help="the training reward's metric")
