# SFT teacher trajectories (src/memopd/teachers/scripted.py, llm.py, trajectories.py): the configured
# teacher plays the benchmark tasks through the student's rollout loop; its episodes, in the student's
# token ids, are the input of the SFT data step.

TEACHER = teacher_config(config)
# the tokenizer that defines the ids: the student's (a tiny model's is results/models/tokenizer; a
# pretrained student's is saved with its initial checkpoint)
TEACHER_TOKENIZER = ("results/models/student_init/model.safetensors" if "pretrained" in config["models"]["student"]
                     else "results/models/tokenizer/tokenizer.json")


# One job per shard (teacher.shards), each a slice of the tasks sampled as in one run (teachers/shards.py); a
# rerun of a preempted shard plays only the chunks (teacher.chunk_tasks) it had not written. The merge
# writes the one file the SFT data step reads.
TRAJECTORY_SHARDS = list(range(TEACHER.shards))


rule sft_trajectories:
    input:
        benchmarks=expand("results/benchmarks/{name}.parquet", name=TEACHER.benchmarks),
        index="results/retrieval/index",
        tokenizer=TEACHER_TOKENIZER,
        hub=HUB_MANIFEST,  # paper scale: the LLM teacher is prefetched (vllm serve opens its local snapshot)
    output:
        trajectories="results/sft/trajectories/shard_{shard}.parquet",
        stats="results/sft/trajectories/shard_{shard}_stats.json",
    wildcard_constraints:
        shard=r"\d+",
    params:
        code=code("sft trajectories"),
        memopd=MEMOPD,
        cfg=lambda w: json.dumps({k: JOB_CONFIG[k] for k in ("teacher", "agent", "rollout")}, sort_keys=True),
        seed=config["seed"],
        tokdir=lambda w, input: os.path.dirname(input.tokenizer),
        server_log=lambda w: f"{LOGS}/sft_trajectories_{w.shard}_vllm.log",
    log:
        f"{LOGS}/sft_trajectories_{{shard}}.log",
    benchmark:
        f"{LOGS}/bench/sft_trajectories_{{shard}}.tsv"
    threads: job_threads("sft_trajectories")
    resources:
        **job_resources("sft_trajectories"),
    conda:
        ENV_GPU  # the LLM teacher (vLLM) at paper scale
    shell:
        "{params.memopd} sft trajectories --cfg {params.cfg:q} --seed {params.seed} --benchmark {input.benchmarks} "
        "--index {input.index} --tokenizer {params.tokdir} --shard {wildcards.shard} --out {output.trajectories} "
        "--stats {output.stats} --server-log {params.server_log} > {log} 2>&1"


rule sft_trajectories_merge:
    input:
        shards=expand("results/sft/trajectories/shard_{shard}.parquet", shard=TRAJECTORY_SHARDS),
        stats=expand("results/sft/trajectories/shard_{shard}_stats.json", shard=TRAJECTORY_SHARDS),
    output:
        trajectories="results/sft/trajectories.parquet",
        stats="results/sft/trajectories_stats.json",
    params:
        code=code("sft merge-trajectories"),
        memopd=MEMOPD,
    log:
        f"{LOGS}/sft_trajectories_merge.log",
    benchmark:
        f"{LOGS}/bench/sft_trajectories_merge.tsv"
    threads: job_threads("sft_trajectories_merge")
    resources:
        **job_resources("sft_trajectories_merge"),
    conda:
        ENV_CPU
    shell:
        "{params.memopd} sft merge-trajectories --shards {input.shards} --shard-stats {input.stats} "
        "--out {output.trajectories} --stats {output.stats} > {log} 2>&1"
