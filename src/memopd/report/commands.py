"""`memopd report results | matched-control | sft | curves`: the tables and figures of the trained runs."""
from __future__ import annotations

from pathlib import Path

from memopd.config import TrainRuns
from memopd.inputs import UsageError, existing, parse_cfg
from memopd.outputs import print_table, write_table


def cmd_report_results(args, cfg):
    """Tables 1-2 (multiobjective, wikirag), vs_student and the F1-vs-horizon figure; every evaluation is read
    before anything is written. The matched control is its own command (report matched-control)."""
    results_tables(TrainRuns.from_section(cfg), args.eval_dir, args.out_dir, args.figure)


def results_tables(runs: TrainRuns, eval_dir: str | Path, out_dir: str | Path, figure: str | Path) -> None:
    """cmd_report_results' tables and figure from the evaluations of the `train` section's runs under `eval_dir`."""
    from memopd.report.results import (FAMILY_RULE, METRICS, budget_note, horizon_figure, horizon_order,
                                       load_reference, load_scores, seeds_words, settings_words, table_notes,
                                       table_rows, trained_horizon, vs_student_notes, vs_student_rows)
    from memopd.stats import VERDICT_RULE

    methods, seeds = list(runs.methods), runs.method_seeds()
    horizons = horizon_order(runs.horizons)  # {benchmark: label}, Q2 before Q16
    primary = trained_horizon(runs.benchmark, horizons)
    caption = (f"{{}}: mean +- std over {seeds_words(seeds)} with the 95% t interval of the mean, change vs PPO in %, the "
               f"difference vs PPO over seeds with its 95% interval and exact p (paired t interval and sign-flip p "
               f"over the 2^n sign patterns when both have the same seeds, else Welch's interval and the "
               f"permutation p over the splits of the seeds), the smallest p these seeds allow, {FAMILY_RULE}; "
               f"noise: {VERDICT_RULE}; the paper's change of MemOPD vs PPO in % where it reports one; student "
               f"{runs.student}, teacher {runs.teacher}, {runs.steps} steps x {runs.batch_tasks} tasks"
               f"{settings_words(runs)}; EM/F1 "
               f"= per-task mean over questions; rows {runs.student} and {runs.teacher}: the SFT student every "
               f"run starts from and the teacher, one greedy evaluation each (change vs PPO in %; no seeds, so no "
               f"std, interval or test)")
    q = {b: h for b, h in horizons.items() if h != "wikirag"}
    wiki = {b: h for b, h in horizons.items() if h == "wikirag"}
    scores = load_scores(eval_dir, seeds, list(horizons))
    ref = load_reference(eval_dir, list(dict.fromkeys([runs.student, runs.teacher])), list(horizons))
    multi = table_rows(scores, methods, q, METRICS["multiobjective"], ref, primary)
    rows = vs_student_rows(eval_dir, runs.student, seeds, horizons, primary=primary)
    write_table(multi, Path(out_dir) / "multiobjective.csv",
                f"{caption.format('Multi-objective (Q2 train)')}; {budget_note(scores, q)}", notes=table_notes(multi))
    if wiki:
        wrows = table_rows(scores, methods, wiki, METRICS["wikirag"], ref, primary)
        write_table(wrows, Path(out_dir) / "wikirag.csv", f"{caption.format('Wiki-RAG')}; "
                    f"{budget_note(scores, wiki)}", notes=table_notes(wrows))
    horizon_figure([r for r in multi if r["method"] in methods], figure)
    write_table(rows, Path(out_dir) / "vs_student.csv",
                f"Each method against the SFT student it started from ({runs.student}), on the same tasks: method "
                f"(mean over its seeds; {seeds_words(seeds)}) - student, the mean difference over tasks with its 95% interval (a "
                f"two-level bootstrap, seeds then tasks, with several seeds; BCa over tasks with one); the test over "
                f"seeds: per seed the mean difference, its t interval (seed_ci) and exact sign-flip p, {FAMILY_RULE}; "
                f"noise: {VERDICT_RULE}; {runs.steps} steps x {runs.batch_tasks} tasks; "
                f"{budget_note(scores, horizons)}", notes=vs_student_notes(rows))


def cmd_report_matched_control(args, cfg):
    """results/tables/matched_control.{csv,md}: its own runs (train.matched_control seeds) on its benchmark."""
    from memopd.report.results import matched_control_table

    print_table(matched_control_table(TrainRuns.from_section(cfg), args.eval_dir, args.out), args.out)


def cmd_report_sft(args, cfg):
    from memopd.report.sft import summary, write_summary

    existing(*args.heldout, *args.eval, *args.info)
    rows, notes = summary(args.names, args.heldout, args.eval, args.info, args.reference)
    write_summary(rows, notes, args.eval[0], args.reference, args.out)


def cmd_report_curves(args, cfg):
    """results/figures/training_curves.png from every run's metrics.jsonl; logged to MLflow (a `report`
    run holding the figure) when --tracking is given."""
    from memopd.tracking import tracked

    existing(*args.metrics)
    # --cfg: the workflow's whole `train` section (its runs name the caption), or only the training tasks' benchmark
    train = TrainRuns.from_section(cfg) if set(cfg) - {"benchmark"} else None
    runs, rows, bench = curves_table(train, args.metrics, args.figure, args.table, args.reward, cfg.get("benchmark", ""))
    first = next(iter(next(iter(runs.values())).values()))[0]
    with tracked(args.tracking, "training-curves", {"train": cfg, "metrics": list(args.metrics)}, stage="report",
                 model="all", seed=args.seed, tags={"method": "report", "benchmark": bench or first.get("benchmark", "")}) as run:
        for path in (args.figure, args.table, Path(args.table).with_suffix(".md")):
            run.log_artifact(path)
    print_table(rows, args.table)


def curves_table(train: TrainRuns | None, metrics: list, figure: str | Path, table: str | Path, reward: str,
                 bench: str = ""):
    """The training-curve figure and trend table of the runs' metrics files, captioned with the `train` section's
    runs when given, titled with the training tasks `bench` (train.benchmark when given); returns (runs, rows,
    benchmark)."""
    from memopd.report.curves import (curves_figure, load_runs, ordered, panel_titles, trend_caption, trend_notes,
                                      trend_rows)

    from memopd.report.results import seeds_words

    runs = load_runs(metrics)
    bench = train.benchmark if train else bench
    seeds = seeds_words({m: sorted(runs[m]) for m in ordered(runs)})
    n_seeds = ", ".join(f"{m} ({len(runs[m])} seed{'s' if len(runs[m]) > 1 else ''})" for m in ordered(runs))
    title = (f"Training curves{' on ' + bench if bench else ''}: {n_seeds}; line = mean over {seeds}, "
             "band = min-max")
    drawn = curves_figure(runs, figure, title, reward)
    rows = trend_rows(runs)
    write_table(rows, table, trend_caption(train, reward, seeds), notes=trend_notes(rows))
    for key, per_method in drawn.items():
        print(f"{key:22s} " + "  ".join(f"{m} {c['mean'][0]:.3g} -> {c['mean'][-1]:.3g}" for m, c in per_method.items()))
    print(f"panels: {'; '.join(panel_titles(reward))}\n-> {figure}")
    return runs, rows, bench


def cmd_report_archive(args, cfg):
    """An archive of the runs' evaluations and training metrics (memopd.report.archive), to commit; with --tables,
    also what the SFT summary, benchmark, recall and alignment tables read. With --results, every table the archive
    rebuilds is compared with the run's own (--results/tables) before the archive stands."""
    import os

    from memopd.report.archive import MANIFEST, git_commit, write_archive
    from memopd.report.archived_tables import ArchivedTables
    from memopd.outputs import LABEL_VAR

    spec = parse_cfg(args.tables, "--tables")
    if spec and not args.results:
        raise UsageError("--tables reads the run's outputs: give its results folder (--results)")
    m = write_archive(cfg, args.reward, args.eval_dir, args.train_dir, args.out, git_commit(Path(__file__).parent),
                      os.environ.get(LABEL_VAR, ""), parse_cfg(args.claims, "--claims") or None,
                      parse_cfg(args.chain, "--chain") or None, ArchivedTables.from_dict(spec) if spec else None,
                      args.results)
    print(f"{len(m['files'])} files, commit {m['commit']} -> {args.out}")
    if args.results:
        try:
            same = _same_tables(args.out, Path(args.results) / "tables")
        except UsageError:
            (Path(args.out) / MANIFEST).unlink()  # no archive of this run
            raise
        print(f"rebuilt from the archive alone, byte for byte: {len(same)} of the run's tables ({', '.join(same)})")


def _same_tables(archive: str | Path, run_tables: Path) -> list[str]:
    """The archive's tables rebuilt in a scratch folder, each compared with the run's file of that name; the first
    that differs is named (UsageError). Returns the names compared."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        rebuild_archive(archive, tmp)
        same = []
        for f in sorted((Path(tmp) / "tables").iterdir()):
            if (run_tables / f.name).is_file():
                if f.read_bytes() != (run_tables / f.name).read_bytes():
                    raise UsageError(f"{f.name} rebuilt from the archive differs from the run's {run_tables / f.name}")
                same.append(f.name)
    return same


def cmd_report_from_archive(args, cfg):
    """Tables 1-2, vs_student, the F1-vs-horizon figure, the matched control, the training-curve table, the claims
    table (when the run declared its claims), the SFT chain's (when it chose its student on the chain) and the SFT
    summary, benchmark, recall and alignment tables (when it kept their inputs) from an archive alone (its files
    checked against their SHA-256 first), captioned with the run's label."""
    manifest = rebuild_archive(args.archive, args.out_dir)
    print(f"archive {args.archive} (commit {manifest['commit']}, {manifest['created']}) -> {args.out_dir}/tables, "
          f"{args.out_dir}/figures")


def rebuild_archive(archive: str | Path, out_dir: str | Path) -> dict:
    """cmd_report_from_archive's tables and figures of the archive at `archive` under `out_dir`; returns its
    manifest."""
    import os

    from memopd.report.archive import metrics_files, read_archive
    from memopd.report.results import matched_control_table
    from memopd.outputs import LABEL_VAR

    manifest = read_archive(archive)
    train, out, eval_dir = TrainRuns.from_section(manifest["train"]), Path(out_dir), Path(archive) / "eval"
    before = os.environ.get(LABEL_VAR)
    os.environ[LABEL_VAR] = manifest["label"]  # the archived run's captions, whatever this shell's label
    try:
        results_tables(train, eval_dir, out / "tables", out / "figures" / "f1_vs_horizon.png")
        matched_control_table(train, eval_dir, out / "tables" / "matched_control.csv")
        curves_table(train, metrics_files(archive, train), out / "figures" / "training_curves.png",
                     out / "tables" / "training_curves.csv", manifest["reward"])
        if manifest.get("claims"):
            from memopd.config import ClaimsConfig
            from memopd.study.commands import claims_table

            claims_table(train, ClaimsConfig.from_dict(manifest["claims"]), eval_dir, out / "tables" / "claims.csv")
        if manifest.get("chain"):
            from memopd.study.commands import chain_table

            chain_table(manifest["chain"], eval_dir, out / "tables" / "sft_chain.json")
        if manifest.get("tables"):
            from memopd.report.archived_tables import ArchivedTables, rebuild

            rebuild(ArchivedTables.from_dict(manifest["tables"]), archive, out / "tables")
    finally:
        if before is None:
            os.environ.pop(LABEL_VAR, None)
        else:
            os.environ[LABEL_VAR] = before
    return manifest


def register(cli) -> None:
    sp = cli.add("report results", cmd_report_results, "Tables 1-2 (multi-objective, Wiki-RAG) from the evaluations")
    sp.add_argument("--eval-dir", default="results/eval")
    sp.add_argument("--out-dir", default="results/tables")
    sp.add_argument("--figure", default="results/figures/f1_vs_horizon.png")
    sp = cli.add("report matched-control", cmd_report_matched_control, "the matched control (ppo, memopd_persistent, "
                 "memopd) on the seeds and benchmark of --cfg's matched_control")
    sp.add_argument("--eval-dir", default="results/eval", help="reads {eval-dir}/{method}_seed{seed}/{benchmark}.json")
    sp.add_argument("--out", default="results/tables/matched_control.csv", help="CSV (a Markdown table beside it)")
    sp = cli.add("report archive", cmd_report_archive, "archive the runs' evaluations and training metrics (small, "
                 "to commit) with the config and commit; `report from-archive` rebuilds the tables from it")
    sp.add_argument("--eval-dir", default="results/eval")
    sp.add_argument("--train-dir", default="results/train", help="reads {train-dir}/{method}/seed{seed}/metrics.jsonl")
    sp.add_argument("--reward", required=True, help="the score the runs were trained on (agent.reward: em, f1)")
    sp.add_argument("--out", default="results/archive", help="the archive's folder (archive.json: its manifest)")
    sp.add_argument("--claims", default="{}", help="JSON of config `claims` (the claims table's), kept in the manifest")
    sp.add_argument("--chain", default="{}", help="JSON of the SFT chain's table (models, teacher, benchmarks): its "
                    "evaluations archived, the JSON kept in the manifest")
    sp.add_argument("--tables", default="{}", help="JSON of what the SFT summary, benchmark, recall and alignment "
                    "tables read (memopd.report.archived_tables.ArchivedTables: sft_models, sft_reference, "
                    "sft_benchmark, benchmark_sets, audit): their inputs archived from --results, then every table the "
                    "archive rebuilds compared with the run's --results/tables")
    sp.add_argument("--results", help="the run's results folder: what --tables reads, and its tables/, which the "
                    "tables the archive rebuilds must equal byte for byte (else no archive, exit 2)")
    sp = cli.add("report from-archive", cmd_report_from_archive, "every table an archive keeps the inputs of (Tables "
                 "1-2, vs_student, the matched control, the training curves; the claims, SFT chain, SFT summary, "
                 "benchmark, recall and alignment tables when kept) from the archive alone (written by `report "
                 "archive`)")
    sp.add_argument("--archive", required=True, help="the archive's folder")
    sp.add_argument("--out-dir", required=True, help="writes {out-dir}/tables/*.csv|md and {out-dir}/figures/*.png")
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
