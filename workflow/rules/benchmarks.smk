# Benchmarks (Q_n, Wiki-RAG), the retrieval corpus and index, and the retrieval figures.

BENCHMARKS = BenchmarksConfig.from_dict(config["benchmarks"])
# results/benchmarks/{benchmark}_{split}.parquet for every configured task set
BENCHMARK_FILES = [f"results/benchmarks/{ts.name}.parquet" for ts in task_sets(BENCHMARKS)]
# the local files each step reads (hub sources have no path)
BENCHMARK_DATA = [
    os.path.join(config["data_dir"], e.path) for es in BENCHMARKS.sources.values() for e in es if e.path is not None
]
CORPUS_DATA = [os.path.join(config["data_dir"], e["path"]) for e in config["retrieval"]["corpus"]]
# corpus files that a step downloads (paper scale: the full wiki-18 corpus); the rest are committed
# (JOB_CONFIG: with the pinned revision, read offline from the prefetched cache)
FETCHED = {os.path.join(config["data_dir"], e["path"]): e["fetch"] for e in JOB_CONFIG["retrieval"]["corpus"] if "fetch" in e}
# the controlled study (config `kb`): its data directory is written by rule kb
KB_FILES = [os.path.join(config["data_dir"], f) for f in ("passages.jsonl", "train.jsonl", "dev.jsonl", "test.jsonl", "kb.json")]
RECALL_DATA = [os.path.join(config["data_dir"], e["path"]) for e in config["retrieval"]["recall"]["sources"]]


if "kb" in config:

    rule kb:
        # the controlled study's synthetic knowledge base (src/memopd/data/kb.py): its data directory
        output:
            KB_FILES,
        params:
            code=code("kb"),
            memopd=MEMOPD,
            cfg=cfg_json("kb"),
            seed=config["seed"],
            outdir=lambda w: config["data_dir"],
        log:
            f"{LOGS}/kb.log",
        benchmark:
            f"{LOGS}/bench/kb.tsv"
        threads: job_threads("kb")
        resources:
            **job_resources("kb"),
        conda:
            ENV_CPU
        shell:
            "{params.memopd} kb --cfg {params.cfg:q} --seed {params.seed} --out-dir {params.outdir} > {log} 2>&1"


rule benchmarks:
    input:
        data=BENCHMARK_DATA,
        hub=HUB_MANIFEST,  # paper scale: the hub data sets are prefetched
    output:
        tasks=BENCHMARK_FILES,
        stats=report("results/tables/benchmark_stats.csv", caption=caption("benchmark_stats"),
                     category=REPORT_BENCHMARKS, subcategory="benchmarks"),
    params:
        code=code("benchmarks"),
        memopd=MEMOPD,
        cfg=cfg_json("benchmarks"),
        seed=config["seed"],
        data_dir=lambda w: config["data_dir"],  # a lambda: the value is a path prefix the linter would flag
        outdir=lambda w, output: os.path.dirname(output.tasks[0]),
    log:
        f"{LOGS}/benchmarks.log",
    benchmark:
        f"{LOGS}/bench/benchmarks.tsv"
    threads: job_threads("benchmarks")
    resources:
        **job_resources("benchmarks"),
    conda:
        ENV_CPU
    shell:
        "{params.memopd} benchmarks --cfg {params.cfg:q} --seed {params.seed} --data-dir {params.data_dir} "
        "--out-dir {params.outdir} --stats {output.stats} > {log} 2>&1"


rule fetch_corpus:
    input:
        hub=HUB_MANIFEST,
    output:
        "{path}",
    wildcard_constraints:
        path="|".join(re.escape(p) for p in FETCHED) or "(?!x)x",
    params:
        code=code("fetch"),
        memopd=MEMOPD,
        cfg=lambda w: json.dumps(FETCHED[w.path], sort_keys=True),
    log:
        f"{LOGS}/fetch_corpus/{{path}}.log",
    benchmark:
        f"{LOGS}/bench/fetch_corpus/{{path}}.tsv"
    threads: job_threads("fetch_corpus")
    resources:
        **job_resources("fetch_corpus"),
    conda:
        ENV_CPU
    shell:
        "{params.memopd} fetch --cfg {params.cfg:q} --out {output} > {log} 2>&1"


rule retrieval_corpus:
    input:
        data=CORPUS_DATA,
    output:
        "results/retrieval/corpus.parquet",
    params:
        code=code("retrieval corpus"),
        memopd=MEMOPD,
        cfg=cfg_json("retrieval"),
        data_dir=lambda w: config["data_dir"],  # a lambda: the value is a path prefix the linter would flag
    log:
        f"{LOGS}/retrieval_corpus.log",
    benchmark:
        f"{LOGS}/bench/retrieval_corpus.tsv"
    threads: job_threads("retrieval_corpus")
    resources:
        **job_resources("retrieval_corpus"),
    conda:
        ENV_CPU
    shell:
        "{params.memopd} retrieval corpus --cfg {params.cfg:q} --data-dir {params.data_dir} --out {output} > {log} 2>&1"


rule retrieval_index:
    input:
        corpus="results/retrieval/corpus.parquet",
        hub=HUB_MANIFEST,  # paper scale: the e5 encoder is prefetched
    output:
        directory("results/retrieval/index"),
    params:
        code=code("retrieval index"),
        memopd=MEMOPD,
        cfg=cfg_json("retrieval"),
    log:
        f"{LOGS}/retrieval_index.log",
    benchmark:
        f"{LOGS}/bench/retrieval_index.tsv"
    threads: job_threads("retrieval_index")
    resources:
        **job_resources("retrieval_index"),
    conda:
        ENV_GPU if config["retrieval"]["backend"] == "e5" else ENV_CPU
    shell:
        "{params.memopd} retrieval index --cfg {params.cfg:q} --corpus {input.corpus} "
        "--out {output} > {log} 2>&1"


rule retrieval_recall:
    input:
        index="results/retrieval/index",
        data=RECALL_DATA,
    output:
        recall=report("results/tables/retrieval_recall.csv", caption=caption("retrieval_recall"),
                      category=REPORT_BENCHMARKS, subcategory="retrieval"),
        timing=report("results/tables/retrieval_timing.csv", caption=caption("retrieval_timing"),
                      category=REPORT_EFFICIENCY, subcategory="retrieval"),
        hits="results/retrieval/recall_hits.csv",  # each sampled question's hit: what rule archive keeps
    params:
        code=code("retrieval recall"),
        memopd=MEMOPD,
        cfg=cfg_json("retrieval"),
        seed=config["seed"],
        data_dir=lambda w: config["data_dir"],  # a lambda: the value is a path prefix the linter would flag
    log:
        f"{LOGS}/retrieval_recall.log",
    benchmark:
        f"{LOGS}/bench/retrieval_recall.tsv"
    threads: job_threads("retrieval_recall")
    resources:
        **job_resources("retrieval_recall"),
    conda:
        ENV_CPU
    shell:
        "{params.memopd} retrieval recall --cfg {params.cfg:q} --seed {params.seed} --index {input.index} "
        "--data-dir {params.data_dir} --out {output.recall} --timing {output.timing} --hits {output.hits} > {log} 2>&1"
