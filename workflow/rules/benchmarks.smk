# Benchmarks (Q_n, Wiki-RAG), the retrieval corpus and index, and the retrieval figures.

# results/benchmarks/{benchmark}_{split}.parquet for every configured task set (named as in data/compose.py)
BENCHMARK_FILES = [
    f"results/benchmarks/{name}.parquet"
    for name in [f"q{s['n']}_{s['split']}" for s in config["benchmarks"]["qn"]["sets"]]
    + [f"wikirag_{sp}" for sp in ("train", "test") if config["benchmarks"].get("wiki_rag", {}).get(sp)]
]
# the local files each step reads (hub sources have no path)
BENCHMARK_DATA = [
    os.path.join(config["data_dir"], e["path"])
    for es in config["benchmarks"]["sources"].values()
    for e in es
    if "path" in e
]
CORPUS_DATA = [os.path.join(config["data_dir"], e["path"]) for e in config["retrieval"]["corpus"]]
RECALL_DATA = [os.path.join(config["data_dir"], e["path"]) for e in config["retrieval"]["recall"]["sources"]]


rule benchmarks:
    input:
        src("data/__init__", "data/loaders", "data/hub", "data/compose", "data/steps", "cli"),
        data=BENCHMARK_DATA,
    output:
        tasks=BENCHMARK_FILES,
        stats="results/tables/benchmark_stats.csv",
    params:
        cfg=cfg_json("benchmarks"),
        seed=config["seed"],
        data_dir=lambda w: config["data_dir"],  # a lambda: the value is a path prefix the linter would flag
        outdir=lambda w, output: os.path.dirname(output.tasks[0]),
    conda:
        CPU_ENV
    log:
        f"{LOGS}/benchmarks.log",
    benchmark:
        f"{LOGS}/bench/benchmarks.tsv"
    shell:
        "memopd benchmarks --cfg {params.cfg:q} --seed {params.seed} --data-dir {params.data_dir} "
        "--out-dir {params.outdir} --stats {output.stats} > {log} 2>&1"


rule retrieval_corpus:
    input:
        src("data/loaders", "retrieval/__init__", "retrieval/corpus", "retrieval/steps", "cli"),
        data=CORPUS_DATA,
    output:
        "results/retrieval/corpus.parquet",
    params:
        cfg=cfg_json("retrieval"),
        data_dir=lambda w: config["data_dir"],  # a lambda: the value is a path prefix the linter would flag
    conda:
        CPU_ENV
    log:
        f"{LOGS}/retrieval_corpus.log",
    benchmark:
        f"{LOGS}/bench/retrieval_corpus.tsv"
    shell:
        "memopd retrieval corpus --cfg {params.cfg:q} --data-dir {params.data_dir} --out {output} > {log} 2>&1"


rule retrieval_index:
    input:
        src("retrieval/__init__", "retrieval/base", "retrieval/bm25", "retrieval/dense", "retrieval/steps", "cli"),
        corpus="results/retrieval/corpus.parquet",
    output:
        directory("results/retrieval/index"),
    params:
        cfg=cfg_json("retrieval"),
        online="--online" if config["online"] else "",
    conda:
        CPU_ENV
    log:
        f"{LOGS}/retrieval_index.log",
    benchmark:
        f"{LOGS}/bench/retrieval_index.tsv"
    shell:
        "memopd retrieval index --cfg {params.cfg:q} --corpus {input.corpus} {params.online} "
        "--out {output} > {log} 2>&1"


rule retrieval_recall:
    input:
        src("metrics", "retrieval/recall", "retrieval/steps", "cli"),
        index="results/retrieval/index",
        data=RECALL_DATA,
    output:
        recall="results/tables/retrieval_recall.csv",
        timing="results/tables/retrieval_timing.csv",
    params:
        cfg=cfg_json("retrieval"),
        seed=config["seed"],
        data_dir=lambda w: config["data_dir"],  # a lambda: the value is a path prefix the linter would flag
    conda:
        CPU_ENV
    log:
        f"{LOGS}/retrieval_recall.log",
    benchmark:
        f"{LOGS}/bench/retrieval_recall.tsv"
    shell:
        "memopd retrieval recall --cfg {params.cfg:q} --seed {params.seed} --index {input.index} "
        "--data-dir {params.data_dir} --out {output.recall} --timing {output.timing} > {log} 2>&1"
