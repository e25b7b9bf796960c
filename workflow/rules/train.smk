# PPO / MemOPD training (one job per method x seed), evaluation of the trained policies, Tables 1-2, and
# the matched control (its own target, on its own seeds: a seed a method trains anyway reuses that run).

TRAIN = config["train"]
# What a training run sees: the train section without matched_control (which says which runs a table
# reads, not how to train), so that changing the control's seeds reruns no training and no Tables 1-2.
TRAIN_RUN = {k: v for k, v in TRAIN.items() if k != "matched_control"}
# Every method on its own seeds (train.per_method.{method}.seeds, else train.seeds).
TRAINED = [f"{m}_seed{s}" for m, s in RUNS.runs()]
# The matched control: methods fixed (memopd.methods.control_methods), runs {method}_seed{seed}.
CONTROL_SEEDS, CONTROL_BENCHMARK = RUNS.control()
CONTROL_RUNS = [f"{m}_seed{s}" for m, seeds in CONTROL_SEEDS.items() for s in seeds]
# What rule archive keeps: ([(model, benchmark)], [(method, seed)]) (memopd.report.archive.contents).
ARCHIVE_EVALS, ARCHIVE_RUNS = archive_contents(RUNS)


rule train:
    input:
        unpack(train_teacher),
        student=f"results/models/{RUNS.student}/model.safetensors",
        tasks=f"results/benchmarks/{RUNS.benchmark}.parquet",
        index=RETRIEVAL_INDEX,
        tracking=TRACKING_STORE,
    output:
        metrics="results/train/{method}/seed{seed}/metrics.jsonl",
        model="results/models/{method}_seed{seed}/model.safetensors",
    wildcard_constraints:
        method="|".join(METHODS),
        seed=r"\d+",
    params:
        code=code("train"),
        launch=launcher,  # torchrun (one rank per GPU, gradients summed over ranks) when the job has several GPUs
        tracking=cfg_json("tracking"),
        cfg=lambda w: json.dumps({"train": method_section(TRAIN_RUN, w.method), **{k: config[k] for k in ("agent", "rollout")}},
                                 sort_keys=True),
        student=lambda w, input: os.path.dirname(input.student),
        teacher=lambda w, input: f"--teacher {os.path.dirname(input.teacher)}" if "teacher" in input.keys() else "",
        run_dir=lambda w, output: os.path.dirname(output.metrics),
        export=lambda w, output: os.path.dirname(output.model),
    log:
        f"{LOGS}/train_{{method}}_seed{{seed}}.log",
    benchmark:
        f"{LOGS}/bench/train_{{method}}_seed{{seed}}.tsv"
    threads: job_threads("train")
    resources:
        **job_resources("train"),
    conda:
        ENV_GPU
    shell:
        "{params.launch} train --cfg {params.cfg:q} --method {wildcards.method} --seed {wildcards.seed} "
        "--student {params.student} {params.teacher} --tasks {input.tasks} --index {input.index} "
        "--out-dir {params.run_dir} --export {params.export} --tracking {params.tracking:q} --threads {threads} "
        "> {log} 2>&1"


rule results_tables:
    input:
        # the runs, and the SFT student and teacher (vs_student, and their rows in Tables 1-2)
        evals=expand("results/eval/{model}/{benchmark}.json", model=TRAINED + [RUNS.student, RUNS.teacher],
                     benchmark=list(RUNS.horizons)),
    output:
        multi=report("results/tables/multiobjective.csv", caption=caption("multiobjective"), category=REPORT_TRAINING,
                     subcategory="Tables 1-2"),
        wiki=report("results/tables/wikirag.csv", caption=caption("wikirag"), category=REPORT_TRAINING,
                    subcategory="Tables 1-2"),
        multi_md="results/tables/multiobjective.md",  # written beside each CSV: caption + table
        wiki_md="results/tables/wikirag.md",
        vs_student=report("results/tables/vs_student.csv", caption=caption("vs_student"), category=REPORT_TRAINING,
                          subcategory="Tables 1-2"),
        vs_student_md="results/tables/vs_student.md",
        figure=report("results/figures/f1_vs_horizon.png", caption=caption("f1_vs_horizon"), category=REPORT_TRAINING,
                      subcategory="Tables 1-2"),
    params:
        code=code("report results"),
        memopd=MEMOPD,
        cfg=json.dumps(TRAIN_RUN, sort_keys=True),
    log:
        f"{LOGS}/results_tables.log",
    benchmark:
        f"{LOGS}/bench/results_tables.tsv"
    threads: job_threads("results_tables")
    resources:
        **job_resources("results_tables"),
    conda:
        ENV_CPU
    shell:
        "{params.memopd} report results --cfg {params.cfg:q} --eval-dir results/eval --out-dir results/tables "
        "--figure {output.figure} > {log} 2>&1"


rule matched_control:
    # exactly the control's runs on its benchmark (the eval job of a run also writes its other benchmarks)
    input:
        evals=expand("results/eval/{model}/{benchmark}.json", model=CONTROL_RUNS, benchmark=CONTROL_BENCHMARK),
    output:
        csv=report("results/tables/matched_control.csv", caption=caption("matched_control"), category=REPORT_TRAINING,
                   subcategory="matched control"),
        md="results/tables/matched_control.md",
    params:
        code=code("report matched-control"),
        memopd=MEMOPD,
        cfg=cfg_json("train"),
    log:
        f"{LOGS}/matched_control.log",
    benchmark:
        f"{LOGS}/bench/matched_control.tsv"
    threads: job_threads("matched_control")
    resources:
        **job_resources("matched_control"),
    conda:
        ENV_CPU
    shell:
        "{params.memopd} report matched-control --cfg {params.cfg:q} --eval-dir results/eval --out {output.csv} "
        "> {log} 2>&1"


rule training_curves:
    # reward, invalid rate, OPD reverse KL and PPO clip fraction vs step of every (method, seed) run of
    # train.methods (each on its seeds), and each run's trend (did the reward rise, is it flat at the end); both are
    # also artifacts of the MLflow run `training-curves`
    input:
        metrics=[f"results/train/{m}/seed{s}/metrics.jsonl" for m, s in RUNS.runs()],
        tracking=TRACKING_STORE,
    output:
        figure=report("results/figures/training_curves.png", caption=caption("training_curves"),
                      category=REPORT_TRAINING, subcategory="training curves"),
        table=report("results/tables/training_curves.csv", caption=caption("training_curves_trend"),
                     category=REPORT_TRAINING, subcategory="training curves"),
        md="results/tables/training_curves.md",
    params:
        code=code("report curves"),
        memopd=MEMOPD,
        cfg=json.dumps(TRAIN_RUN, sort_keys=True),
        tracking=cfg_json("tracking"),
        seed=config["seed"],
        reward=config["agent"]["reward"],
    log:
        f"{LOGS}/training_curves.log",
    benchmark:
        f"{LOGS}/bench/training_curves.tsv"
    threads: job_threads("training_curves")
    resources:
        **job_resources("training_curves"),
    conda:
        ENV_CPU
    shell:
        "{params.memopd} report curves --cfg {params.cfg:q} --seed {params.seed} --metrics {input.metrics} "
        "--figure {output.figure} --table {output.table} --reward {params.reward} --tracking {params.tracking:q} "
        "> {log} 2>&1"


if config.get("claims"):

    rule claims:
        # the paper's claims over seeds, the primaries declared in config `claims` Holm-adjusted together
        input:
            evals=expand("results/eval/{model}/{benchmark}.json", model=TRAINED,
                         benchmark=[config["claims"]["short"], config["claims"]["long"]]),
        output:
            csv=report("results/tables/claims.csv", caption=caption("claims"), category=REPORT_TRAINING,
                       subcategory="claims"),
            md="results/tables/claims.md",
        params:
            code=code("study claims"),
            memopd=MEMOPD,
            cfg=json.dumps({"train": TRAIN_RUN, "claims": config["claims"]}, sort_keys=True),
        log:
            f"{LOGS}/claims.log",
        benchmark:
            f"{LOGS}/bench/claims.tsv"
        threads: job_threads("claims")
        resources:
            **job_resources("claims"),
        conda:
            ENV_CPU
        shell:
            "{params.memopd} study claims --cfg {params.cfg:q} --eval-dir results/eval --out {output.csv} > {log} 2>&1"


# What the archive keeps of the SFT summary, benchmark, recall and alignment tables
# (memopd.report.archived_tables.ArchivedTables), and the run's tables its rebuild is compared with.
ARCHIVED_TABLES = {"sft_models": SFT_MODELS, "sft_reference": SFT_REFERENCE, "sft_benchmark": SFT_BENCHMARK,
                   "benchmark_sets": [ts.name for ts in task_sets(BENCHMARKS)],
                   "audit": {k: AUDIT[k] for k in ("dtype", "clip", "backends")}}
# (one table of each job: the job writes its other tables with it)
ARCHIVE_CHECKED = [rules.results_tables.output.multi, rules.matched_control.output.csv,
                   rules.training_curves.output.table, rules.sft_summary.output.csv, rules.audit_alignment.output.csv,
                   rules.benchmarks.output.stats, rules.retrieval_recall.output.recall,
                   *([rules.claims.output.csv] if config.get("claims") else []),
                   *([rules.sft_chain.output.json] if SFT_SNAPSHOTS else [])]


rule archive:
    # what the result tables read (every run's evaluations and training metrics, the SFT models' evaluations, the
    # inputs of the SFT summary, benchmark, recall and alignment tables), small enough to commit:
    # `memopd report from-archive --archive results/archive --out-dir DIR` rebuilds the tables
    input:
        evals=[f"results/eval/{model}/{bench}.json" for model, bench in ARCHIVE_EVALS],
        chain=[f"results/eval/{model}/{bench}.json" for model, bench in chain_evals(CHAIN)],
        metrics=[f"results/train/{method}/seed{seed}/metrics.jsonl" for method, seed in ARCHIVE_RUNS],
        kept=[*rules.sft_summary.input, *BENCHMARK_FILES, rules.retrieval_recall.output.hits, AUDIT_EPISODES],
        checked=ARCHIVE_CHECKED,
    output:
        manifest="results/archive/archive.json",
    params:
        code=code("report archive"),
        memopd=MEMOPD,
        cfg=cfg_json("train"),
        reward=config["agent"]["reward"],
        claims=json.dumps(config.get("claims") or {}, sort_keys=True),
        chain=json.dumps(CHAIN, sort_keys=True),
        tables=json.dumps(ARCHIVED_TABLES, sort_keys=True),
    log:
        f"{LOGS}/archive.log",
    benchmark:
        f"{LOGS}/bench/archive.tsv"
    threads: job_threads("archive")
    resources:
        **job_resources("archive"),
    conda:
        ENV_CPU
    shell:
        "{params.memopd} report archive --cfg {params.cfg:q} --reward {params.reward} --claims {params.claims:q} "
        "--chain {params.chain:q} --tables {params.tables:q} --results results "
        "--eval-dir results/eval --train-dir results/train --out results/archive > {log} 2>&1"
