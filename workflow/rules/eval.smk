# Agent evaluation and the RCE audit of real rollouts (src/memopd/agent).
# Inputs from the benchmarks/retrieval steps: results/benchmarks/{benchmark}.parquet and the
# index directory results/retrieval/index.

RETRIEVAL_INDEX = "results/retrieval/index"
EVAL_BENCHMARKS = config["eval"]["benchmarks"]


rule eval:
    # one job per (model, benchmark): a target asks only for the evaluations it reads (the trained runs are
    # evaluated on train.horizons, the SFT models on eval.benchmarks)
    input:
        model="results/models/{model}/model.safetensors",
        benchmark="results/benchmarks/{benchmark}.parquet",
        index=RETRIEVAL_INDEX,
        tracking=TRACKING_STORE,
    output:
        json="results/eval/{model}/{benchmark}.json",
        csv="results/eval/{model}/{benchmark}.csv",
        episodes="results/eval/{model}/{benchmark}.episodes.parquet",
    wildcard_constraints:
        benchmark="|".join(EVAL_BENCHMARKS),
    params:
        code=code("eval"),
        memopd=MEMOPD,
        tracking=cfg_json("tracking"),
        cfg=lambda w: eval_cfg(w.benchmark),
        seed=config["seed"],
        model=lambda w, input: os.path.dirname(input.model),
        outdir=lambda w: f"results/eval/{w.model}",
    log:
        f"{LOGS}/eval_{{model}}_{{benchmark}}.log",
    benchmark:
        f"{LOGS}/bench/eval_{{model}}_{{benchmark}}.tsv"
    threads: job_threads("eval")
    resources:
        **job_resources("eval"),
    conda:
        ENV_GPU
    shell:
        "{params.memopd} eval --cfg {params.cfg:q} --seed {params.seed} --model {params.model} "
        "--benchmark {input.benchmark} --index {input.index} --out-dir {params.outdir} "
        "--tracking {params.tracking:q} > {log} 2>&1"


rule eval_all:
    input:
        expand("results/eval/{model}/{benchmark}.json", model=config["eval"]["models"],
               benchmark=config["eval"]["benchmarks"]),


rule rce_rollouts:
    input:
        model="results/models/student_init/model.safetensors",
        benchmark=f"results/benchmarks/{config['rce_rollouts']['benchmark']}.parquet",
        index=RETRIEVAL_INDEX,
    output:
        "results/audit/rce_rollouts.json",
    params:
        code=code("rce-rollouts"),
        memopd=MEMOPD,
        cfg=lambda w: json.dumps({k: config[k] for k in ("agent", "rollout", "rce_rollouts")}, sort_keys=True),
        seed=config["seed"],
        model=lambda w, input: os.path.dirname(input.model),
    log:
        f"{LOGS}/rce_rollouts.log",
    benchmark:
        f"{LOGS}/bench/rce_rollouts.tsv"
    threads: job_threads("rce_rollouts")
    resources:
        **job_resources("rce_rollouts"),
    conda:
        ENV_GPU
    shell:
        "{params.memopd} rce-rollouts --cfg {params.cfg:q} --seed {params.seed} --model {params.model} "
        "--benchmark {input.benchmark} --index {input.index} --out {output} --strict > {log} 2>&1"
