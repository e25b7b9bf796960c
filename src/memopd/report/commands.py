"""`memopd report results | matched-control | sft | curves`: the tables and figures of the trained runs."""
from __future__ import annotations

from pathlib import Path

from memopd.inputs import existing, require
from memopd.report.tables import print_table, write_table

RESULTS_KEYS = ("methods", "seeds", "horizons", "student", "teacher", "steps", "batch_tasks")  # the `train` section
MATCHED_KEYS = ("seeds", "student", "teacher", "benchmark", "steps", "batch_tasks")


def cmd_report_results(args, cfg):
    """Tables 1-2 (multiobjective, wikirag), vs_student and the F1-vs-horizon figure; every evaluation is read
    before anything is written. The matched control is its own command (report matched-control)."""
    from memopd.report.results import (METRICS, budget_note, horizon_figure, horizon_order, load_reference,
                                       load_scores, table_notes, table_rows, vs_student_rows)

    require(cfg, *RESULTS_KEYS)
    methods, seeds = cfg["methods"], cfg["seeds"]
    horizons = horizon_order(cfg["horizons"])  # {benchmark: label}, Q2 before Q16
    caption = (f"{{}}: mean +- std over seeds {seeds}, 95% bootstrap CI over seeds, change vs PPO in %, paired "
               f"per-seed difference vs PPO with its 95% bootstrap CI and whether it contains 0, the paper's "
               f"change of MemOPD vs PPO in % where it reports one; student {cfg['student']}, teacher "
               f"{cfg['teacher']}, {cfg['steps']} steps x {cfg['batch_tasks']} tasks; EM/F1 = per-task mean over "
               f"questions; rows {cfg['student']} and {cfg['teacher']}: the SFT student every run starts from and the "
               f"teacher, one greedy evaluation each (change vs PPO in %; no seeds, so no std or intervals)")
    q = {b: h for b, h in horizons.items() if h != "wikirag"}
    wiki = {b: h for b, h in horizons.items() if h == "wikirag"}
    scores = load_scores(args.eval_dir, methods, seeds, list(horizons))
    ref = load_reference(args.eval_dir, list(dict.fromkeys([cfg["student"], cfg["teacher"]])), list(horizons))
    multi = table_rows(scores, methods, q, METRICS["multiobjective"], ref)
    rows = vs_student_rows(args.eval_dir, cfg["student"], methods, seeds, horizons)
    write_table(multi, Path(args.out_dir) / "multiobjective.csv",
                f"{caption.format('Multi-objective (Q2 train)')}; {budget_note(scores, q)}", notes=table_notes(multi))
    if wiki:
        wrows = table_rows(scores, methods, wiki, METRICS["wikirag"], ref)
        write_table(wrows, Path(args.out_dir) / "wikirag.csv", f"{caption.format('Wiki-RAG')}; "
                    f"{budget_note(scores, wiki)}", notes=table_notes(wrows))
    horizon_figure([r for r in multi if r["method"] in methods], args.figure)
    write_table(rows, Path(args.out_dir) / "vs_student.csv",
                f"Each method against the SFT student it started from ({cfg['student']}), per task: method (mean "
                f"over seeds {seeds}) - student, mean difference with a 95% paired bootstrap CI over tasks; "
                f"{cfg['steps']} steps x {cfg['batch_tasks']} tasks; {budget_note(scores, horizons)}",
                notes=[f"{r['method']} on {r['horizon']}, {r['metric']}: {r['mean']:.3f} vs the student's {r['student']:.3f}, "
                       f"difference {r['diff']:+.3f} (95% CI {r['ci_low']:+.3f} to {r['ci_high']:+.3f}, {r['tasks']} tasks): "
                       f"{r['noise']}" for r in rows])


def cmd_report_matched_control(args, cfg):
    """results/tables/matched_control.{csv,md}: its own runs (train.matched_control seeds) on its benchmark."""
    from memopd.report.results import matched_control_table

    require(cfg, *MATCHED_KEYS)
    print_table(matched_control_table(cfg, args.eval_dir, args.out), args.out)


def cmd_report_sft(args, cfg):
    from memopd.report.sft import summary, write_summary

    existing(*args.heldout, *args.eval, *args.info)
    rows, notes = summary(args.names, args.heldout, args.eval, args.info, args.reference)
    write_summary(rows, notes, args.eval[0], args.reference, args.out)


def cmd_report_curves(args, cfg):
    """results/figures/training_curves.png from every run's metrics.jsonl; logged to MLflow (a `report`
    run holding the figure) when --tracking is given."""
    from memopd.report.curves import (curves_figure, load_runs, ordered, panel_titles, trend_caption, trend_notes,
                                      trend_rows)
    from memopd.tracking import tracked

    existing(*args.metrics)
    runs = load_runs(args.metrics)
    first = next(iter(next(iter(runs.values())).values()))[0]
    bench = cfg.get("benchmark", "")
    seeds = sorted({s for r in runs.values() for s in r})
    n_seeds = ", ".join(f"{m} ({len(runs[m])} seed{'s' if len(runs[m]) > 1 else ''})" for m in ordered(runs))
    title = (f"Training curves{' on ' + bench if bench else ''}: {n_seeds}; line = mean over seeds {seeds}, "
             "band = min-max")
    drawn = curves_figure(runs, args.figure, title, args.reward)
    rows = trend_rows(runs)
    write_table(rows, args.table, trend_caption(cfg, args.reward, seeds), notes=trend_notes(rows))
    with tracked(args.tracking, "training-curves", {"train": cfg, "metrics": list(args.metrics)}, stage="report",
                 model="all", seed=args.seed, tags={"method": "report", "benchmark": bench or first.get("benchmark", "")}) as run:
        for path in (args.figure, args.table, Path(args.table).with_suffix(".md")):
            run.log_artifact(path)
    for key, per_method in drawn.items():
        print(f"{key:22s} " + "  ".join(f"{m} {c['mean'][0]:.3g} -> {c['mean'][-1]:.3g}" for m, c in per_method.items()))
    print(f"panels: {'; '.join(panel_titles(args.reward))}\n-> {args.figure}")
    print_table(rows, args.table)


def register(cli) -> None:
    sp = cli.add("report results", cmd_report_results, "Tables 1-2 (multi-objective, Wiki-RAG) from the evaluations")
    sp.add_argument("--eval-dir", default="results/eval")
    sp.add_argument("--out-dir", default="results/tables")
    sp.add_argument("--figure", default="results/figures/f1_vs_horizon.png")
    sp = cli.add("report matched-control", cmd_report_matched_control, "the matched control (ppo, memopd_persistent, "
                 "memopd) on the seeds and benchmark of --cfg's matched_control")
    sp.add_argument("--eval-dir", default="results/eval", help="reads {eval-dir}/{method}_seed{seed}/{benchmark}.json")
    sp.add_argument("--out", default="results/tables/matched_control.csv", help="CSV (a Markdown table beside it)")
    sp = cli.add("report sft", cmd_report_sft, "the SFT summary table")
    sp.add_argument("--names", nargs="+", required=True)
    sp.add_argument("--heldout", nargs="+", required=True, help="results/sft/heldout_{name}.json, in --names order")
    sp.add_argument("--eval", nargs="+", required=True, help="results/eval/{name}/q2_test.json, in --names order")
    sp.add_argument("--info", nargs="+", required=True, help="results/models/{name}/memopd_model.json")
    sp.add_argument("--reference", default="student_sft", help="the model every other is compared with, task by task")
    sp.add_argument("--out", default="results/tables/sft_summary.csv")
    sp = cli.add("report curves", cmd_report_curves, "training curves (reward, invalid rate, OPD KL, PPO clip fraction "
                 "vs step; mean over seeds with a min-max band) from the runs' metrics.jsonl")
    sp.add_argument("--metrics", nargs="+", required=True, help="results/train/{method}/seed{seed}/metrics.jsonl")
    sp.add_argument("--figure", default="results/figures/training_curves.png")
    sp.add_argument("--table", default="results/tables/training_curves.csv", help="each run's trend (a Markdown "
                    "table beside it): did the reward rise, is it flat at the end")
    sp.add_argument("--reward", default="", help="the score the runs were trained on (agent.reward: em, f1)")
    sp.add_argument("--tracking", help="JSON of the `tracking` config section (uri, experiment); omit: no MLflow")
