# SFT teacher trajectories (src/memopd/agent/teacher.py, llm_teacher.py, trajectories.py): the configured
# teacher plays the benchmark tasks through the student's rollout loop; its episodes, in the student's
# token ids, are the input of the SFT data step.

TEACHER = config["teacher"]
# the tokenizer that defines the ids: the student's (a tiny model's is results/models/tokenizer; a
# pretrained student's is saved with its initial checkpoint)
TEACHER_TOKENIZER = ("results/models/student_init/model.safetensors" if "pretrained" in config["models"]["student"]
                     else "results/models/tokenizer/tokenizer.json")


rule sft_trajectories:
    input:
        src("agent/teacher", "agent/llm_teacher", "agent/trajectories", "agent/protocol", "agent/memory",
            "agent/rollout", "agent/backends", "records", "cli"),
        benchmarks=expand("results/benchmarks/{name}.parquet", name=TEACHER["benchmarks"]),
        index="results/retrieval/index",
        tokenizer=TEACHER_TOKENIZER,
    output:
        trajectories="results/sft/trajectories.parquet",
        stats="results/sft/trajectories_stats.json",
    params:
        memopd=MEMOPD,
        cfg=lambda w: json.dumps({k: config[k] for k in ("teacher", "agent", "rollout")}, sort_keys=True),
        seed=config["seed"],
        tokdir=lambda w, input: os.path.dirname(input.tokenizer),
        server_log=f"{LOGS}/sft_trajectories_vllm.log",
    log:
        f"{LOGS}/sft_trajectories.log",
    benchmark:
        f"{LOGS}/bench/sft_trajectories.tsv"
    threads: job_threads("sft_trajectories")
    resources:
        **job_resources("sft_trajectories"),
    conda:
        ENV_GPU  # the LLM teacher (vLLM) at paper scale
    shell:
        "{params.memopd} sft trajectories --cfg {params.cfg:q} --seed {params.seed} --benchmark {input.benchmarks} "
        "--index {input.index} --tokenizer {params.tokdir} --out {output.trajectories} --stats {output.stats} "
        "--server-log {params.server_log} > {log} 2>&1"
