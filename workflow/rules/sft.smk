# Supervised fine-tuning: turn-level examples from the kept trajectories, SFT of the student and the
# teacher (resumable: a rerun continues from results/models/{role}_sft/checkpoint), held-out target
# loss of every model, and the packed-vs-padded SFT benchmark. Every job is an MLflow run.

# which teacher played the trajectories: a column of results/tables/sft_data_stats.csv
TRAJECTORY_TEACHER = teacher_config(config).kind


rule sft_examples:
    input:
        episodes="results/sft/trajectories.parquet",
        tracking=TRACKING_STORE,
    output:
        examples="results/sft/examples.parquet",
        stats="results/sft/examples_stats.json",
        table=report("results/tables/sft_data_stats.csv", caption=caption("sft_data_stats"), category=REPORT_SFT,
                     subcategory="data"),
    params:
        code=code("sft examples"),
        memopd=MEMOPD,
        cfg=cfg_json("sft"),
        tracking=cfg_json("tracking"),
        seed=config["seed"],
        teacher=TRAJECTORY_TEACHER,
    log:
        f"{LOGS}/sft_examples.log",
    benchmark:
        f"{LOGS}/bench/sft_examples.tsv"
    priority: 10  # on the SFT chain (the critical path): before the evaluations and RCE checks that are ready with it
    threads: job_threads("sft_examples")
    resources:
        **job_resources("sft_examples"),
    conda:
        ENV_CPU
    shell:
        "{params.memopd} sft examples --cfg {params.cfg:q} --tracking {params.tracking:q} --seed {params.seed} "
        "--teacher {params.teacher} --episodes {input.episodes} --out {output.examples} "
        "--stats {output.stats} --table {output.table} > {log} 2>&1"


rule sft_lm_data:
    input:
        corpus="results/retrieval/corpus.parquet",
        tokenizer="results/models/tokenizer/tokenizer.json",
    output:
        examples="results/sft/lm.parquet",
        stats="results/sft/lm_stats.json",
    params:
        code=code("sft lm-data"),
        memopd=MEMOPD,
        cfg=cfg_json("sft"),
        seed=config["seed"],
        tokdir=lambda w, input: os.path.dirname(input.tokenizer),
    log:
        f"{LOGS}/sft_lm_data.log",
    benchmark:
        f"{LOGS}/bench/sft_lm_data.tsv"
    threads: job_threads("sft_lm_data")
    resources:
        **job_resources("sft_lm_data"),
    conda:
        ENV_CPU
    shell:
        "{params.memopd} sft lm-data --cfg {params.cfg:q} --seed {params.seed} --corpus {input.corpus} "
        "--tokenizer {params.tokdir} --out {output.examples} --stats {output.stats} > {log} 2>&1"


rule sft_pretrain:
    input:
        examples="results/sft/lm.parquet",
        init="results/models/{role}_init/model.safetensors",
        tracking=TRACKING_STORE,
    output:
        "results/models/{role}_lm/model.safetensors",
    wildcard_constraints:
        role="student|teacher",
    params:
        code=code("sft train"),
        launch=launcher,
        cfg=cfg_json("sft"),
        tracking=cfg_json("tracking"),
        seed=config["seed"],
        initdir=lambda w, input: os.path.dirname(input.init),
        outdir=lambda w, output: os.path.dirname(output[0]),
    log:
        f"{LOGS}/sft_pretrain_{{role}}.log",
    benchmark:
        f"{LOGS}/bench/sft_pretrain_{{role}}.tsv"
    priority: 10  # the longest chain of the DAG (the teacher's): start it before anything that can wait
    threads: job_threads("sft_pretrain")
    resources:
        **job_resources("sft_pretrain"),
    conda:
        ENV_GPU
    shell:
        "{params.launch} sft train --stage pretrain --role {wildcards.role} --cfg {params.cfg:q} "
        "--tracking {params.tracking:q} --seed {params.seed} --threads {threads} --examples {input.examples} "
        "--init {params.initdir} --out {params.outdir} > {log} 2>&1"


rule sft_train:
    input:
        examples="results/sft/examples.parquet",
        init=sft_init,
        tracking=TRACKING_STORE,
    output:
        "results/models/{role}_sft/model.safetensors",
    wildcard_constraints:
        role="student|teacher",
    params:
        code=code("sft train"),
        launch=launcher,  # torchrun (DDP) when the job has several GPUs
        cfg=cfg_json("sft"),
        tracking=cfg_json("tracking"),
        seed=config["seed"],
        initdir=lambda w, input: os.path.dirname(input.init),
        outdir=lambda w, output: os.path.dirname(output[0]),
    log:
        f"{LOGS}/sft_train_{{role}}.log",
    benchmark:
        f"{LOGS}/bench/sft_train_{{role}}.tsv"
    priority: 10  # the longest chain of the DAG (the teacher's): start it before anything that can wait
    threads: job_threads("sft_train")
    resources:
        **job_resources("sft_train"),
    conda:
        ENV_GPU
    shell:
        "{params.launch} sft train --role {wildcards.role} --cfg {params.cfg:q} --tracking {params.tracking:q} "
        "--seed {params.seed} --threads {threads} --examples {input.examples} --init {params.initdir} "
        "--out {params.outdir} > {log} 2>&1"


rule sft_snapshot:
    # a snapshot of a role's SFT chain (sft.<role>.snapshots: the weights after that step) as a model of its own
    input:
        model="results/models/{role}_sft/model.safetensors",
    output:
        "results/models/{role}_sft_s{step}/model.safetensors",
    wildcard_constraints:
        role="student|teacher",
        step=r"\d+",
    params:
        code=code("sft snapshot"),
        memopd=MEMOPD,
        modeldir=lambda w, input: os.path.dirname(input.model),
        outdir=lambda w, output: os.path.dirname(output[0]),
    log:
        f"{LOGS}/sft_snapshot_{{role}}_{{step}}.log",
    benchmark:
        f"{LOGS}/bench/sft_snapshot_{{role}}_{{step}}.tsv"
    threads: job_threads("sft_snapshot")
    resources:
        **job_resources("sft_snapshot"),
    conda:
        ENV_CPU
    shell:
        "{params.memopd} sft snapshot --model {params.modeldir} --step {wildcards.step} --out {params.outdir} "
        "> {log} 2>&1"


rule sft_eval:
    input:
        examples="results/sft/examples.parquet",
        model="results/models/{name}/model.safetensors",
        tracking=TRACKING_STORE,
    output:
        "results/sft/heldout_{name}.json",
    wildcard_constraints:
        name=r"student_init|student_sft|teacher_sft|(student|teacher)_sft_s\d+",
    params:
        code=code("sft eval"),
        memopd=MEMOPD,
        cfg=cfg_json("sft"),
        tracking=cfg_json("tracking"),
        seed=config["seed"],
        role=lambda w: w.name.split("_")[0],
        modeldir=lambda w, input: os.path.dirname(input.model),
    log:
        f"{LOGS}/sft_eval_{{name}}.log",
    benchmark:
        f"{LOGS}/bench/sft_eval_{{name}}.tsv"
    threads: job_threads("sft_eval")
    resources:
        **job_resources("sft_eval"),
    conda:
        ENV_GPU
    shell:
        "{params.memopd} sft eval --role {params.role} --name {wildcards.name} --cfg {params.cfg:q} "
        "--tracking {params.tracking:q} --seed {params.seed} --threads {threads} --model {params.modeldir} "
        "--examples {input.examples} --out {output} > {log} 2>&1"


rule bench_sft:
    input:
        model="results/models/student_init/model.safetensors",
        data=config["data_dir"],
        tracking=TRACKING_STORE,
    output:
        report("results/bench/sft_packed_vs_padded.csv", caption=caption("sft_packed_vs_padded"),
               category=REPORT_EFFICIENCY, subcategory="SFT"),
    params:
        code=code("bench sft"),
        memopd=MEMOPD,
        cfg=cfg_json("sft"),
        tracking=cfg_json("tracking"),
        seed=config["seed"],
        modeldir=lambda w, input: os.path.dirname(input.model),
    log:
        f"{LOGS}/bench_sft.log",
    benchmark:
        f"{LOGS}/bench/bench_sft.tsv"
    threads: job_threads("bench_sft")
    resources:
        **job_resources("bench_sft"),
    conda:
        ENV_GPU
    shell:
        "{params.memopd} bench sft --cfg {params.cfg:q} --tracking {params.tracking:q} --seed {params.seed} "
        "--threads {threads} --model {params.modeldir} --data-dir {input.data} --examples 2000 "
        "--out {output} > {log} 2>&1"


# the RL student (train.student) too when it is a snapshot of an SFT chain
SFT_MODELS = ["student_init", "student_sft", "teacher_sft"]
SFT_MODELS += [m for m in [RUNS.student] if m not in SFT_MODELS]
SFT_REFERENCE, SFT_BENCHMARK = "student_sft", "q2_test"  # the summary's rows are compared with the SFT student on it


rule sft_summary:
    input:
        heldout=expand("results/sft/heldout_{name}.json", name=SFT_MODELS),
        evals=expand("results/eval/{name}/{bench}.json", name=SFT_MODELS, bench=SFT_BENCHMARK),
        tasks=expand("results/eval/{name}/{bench}.csv", name=SFT_MODELS, bench=SFT_BENCHMARK),  # the paired intervals
        info=expand("results/models/{name}/model.safetensors", name=SFT_MODELS),
    output:
        csv=report("results/tables/sft_summary.csv", caption=caption("sft_summary"), category=REPORT_SFT,
                   subcategory="models"),
        md="results/tables/sft_summary.md",
    params:
        code=code("report sft"),
        memopd=MEMOPD,
        names=SFT_MODELS,
        reference=SFT_REFERENCE,
        info=lambda w, input: [os.path.join(os.path.dirname(p), "memopd_model.json") for p in input.info],
    log:
        f"{LOGS}/sft_summary.log",
    benchmark:
        f"{LOGS}/bench/sft_summary.tsv"
    threads: job_threads("sft_summary")
    resources:
        **job_resources("sft_summary"),
    conda:
        ENV_CPU
    shell:
        "{params.memopd} report sft --names {params.names} --heldout {input.heldout} --eval {input.evals} "
        "--info {params.info} --reference {params.reference} --out {output.csv} > {log} 2>&1"


# Design D of the controlled study (memopd.study.chain): the RL student chosen along the SFT chain's snapshots
SFT_SNAPSHOTS = any(config["sft"][r].get("snapshots") for r in ("student", "teacher"))
CHAIN = chain_config(config["sft"]) if SFT_SNAPSHOTS else {}  # what its table reads (and rule archive keeps)

if SFT_SNAPSHOTS:

    rule sft_chain:
        input:
            evals=[f"results/eval/{model}/{bench}.json" for model, bench in chain_evals(CHAIN)],
        output:
            json="results/tables/sft_chain.json",
            txt="results/tables/sft_chain.txt",
        params:
            code=code("study chain"),
            memopd=MEMOPD,
            cfg=cfg_json("sft"),
            bench=" ".join(f"--{k} {v}" for k, v in CHAIN["benchmarks"].items()),
        log:
            f"{LOGS}/sft_chain.log",
        benchmark:
            f"{LOGS}/bench/sft_chain.tsv"
        threads: job_threads("sft_chain")
        resources:
            **job_resources("sft_chain"),
        conda:
            ENV_CPU
        shell:
            "{params.memopd} study chain --cfg {params.cfg:q} --eval-dir results/eval --teacher teacher_sft "
            "{params.bench} --out {output.json} > {log} 2>&1"
