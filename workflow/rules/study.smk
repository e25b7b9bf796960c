# The controlled memory study (docs/study.md): this same workflow, every rule and command unchanged, run on a
# synthetic knowledge base (rule kb) with tiny models trained from random weights, in its own directory
# results/study/ with its own config files (config `study.configs`, merged in order): its results, logs and MLflow store
# (results/study/results/mlflow.db) never mix with the real model's. One job runs the nested workflow on this
# job's cores; its own jobs keep their logs and benchmark files (results/study/results/logs/), so
# `workflow/scripts/job_times.py results/study/results/logs/bench` splits its time by rule.

STUDY = StudyConfig.from_dict(config["study"]) if config.get("study") else None

STUDY_CONFIG = merge_files(list(STUDY.configs)) if STUDY else {}  # the nested workflow's config (as Snakemake merges it)
STUDY_DIR = "results/study"
# What the study reports, relative to STUDY_DIR (the nested workflow's targets).
STUDY_TABLES = ["results/tables/sft_summary.csv",
                "results/tables/multiobjective.csv", "results/tables/wikirag.csv", "results/tables/vs_student.csv",
                "results/tables/matched_control.csv", "results/tables/alignment_audit.csv",
                "results/tables/training_curves.csv"]
if STUDY_CONFIG.get("claims"):
    STUDY_TABLES.append("results/tables/claims.csv")  # the claims its config files declare (rule claims)
if any((STUDY_CONFIG.get("sft", {}).get(r) or {}).get("snapshots") for r in ("student", "teacher")):
    STUDY_TABLES.append("results/tables/sft_chain.json")  # Design D's choice along the SFT chain (rule sft_chain)
# Built by the nested workflow but not declared an output of rule study: Snakemake deletes a job's outputs before
# it runs, and the nested jobs writing these tables also write what later nested jobs read (the benchmarks, which
# every job reads: a rerun of rule study would rebuild the whole study; the recall hits, which rule archive keeps).
# No other output of a job that writes a declared output is read by any job.
STUDY_UNDECLARED = ["results/tables/benchmark_stats.csv", "results/tables/retrieval_recall.csv"]
# Every table but this also has a Markdown rendering.
STUDY_CSV_ONLY = {"results/tables/sft_chain.json"}
STUDY_MD = [t.removesuffix(".csv") + ".md" for t in STUDY_TABLES if t not in STUDY_CSV_ONLY]
STUDY_FIGURES = ["results/figures/f1_vs_horizon.png", "results/figures/training_curves.png"]
# The runs' evaluations and training metrics, small enough to commit (rule archive; docs/outputs.md "Archives").
STUDY_ARCHIVE = ["results/archive/archive.json"]


if STUDY:

    rule study:
        input:
            configs=list(STUDY.configs),
        output:
            tables=[report(f"{STUDY_DIR}/{t}", caption=caption("study"), category=REPORT_STUDY) for t in STUDY_TABLES],
            md=[f"{STUDY_DIR}/{t}" for t in STUDY_MD],
            figures=[report(f"{STUDY_DIR}/{f}", caption=caption("study"), category=REPORT_STUDY) for f in STUDY_FIGURES],
            archive=[f"{STUDY_DIR}/{a}" for a in STUDY_ARCHIVE],
        params:
            code=f"memopd@{package_hash(Path(SRC))}",  # the nested jobs may run any command
            snakemake=f"{shlex.quote(sys.executable)} -m snakemake",
            snakefile=workflow.main_snakefile,
            configfiles=lambda w, input: " ".join(shlex.quote(os.path.abspath(f)) for f in input.configs),
            targets=" ".join(STUDY_TABLES + STUDY_FIGURES + STUDY_ARCHIVE + STUDY_UNDECLARED),
            dir=lambda w: STUDY_DIR,  # a lambda: the value is a path prefix the linter would flag
        log:
            f"{LOGS}/study.log",
        benchmark:
            f"{LOGS}/bench/study.tsv"
        threads: job_threads("study")
        resources:
            **job_resources("study"),
        conda:
            ENV_CPU
        shell:
            # --rerun-incomplete: a study killed mid-job (hours long) resumes when its rule is rerun; each
            # training run restarts from its last checkpoint
            "{params.snakemake} -s {params.snakefile} -d {params.dir} -c {threads} --rerun-incomplete "
            "{params.targets} --configfile {params.configfiles} > {log} 2>&1"
