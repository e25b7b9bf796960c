# MLflow: the store and the experiment are created once, here; every tracking job depends on this
# rule's output, so parallel jobs never race the SQLite schema migration.

TRACKING_STORE = "results/tracking/store.json"


rule tracking_init:
    input:
    output:
        TRACKING_STORE,
    params:
        code=code("tracking init"),
        memopd=MEMOPD,
        cfg=cfg_json("tracking"),
    log:
        f"{LOGS}/tracking_init.log",
    benchmark:
        f"{LOGS}/bench/tracking_init.tsv"
    threads: job_threads("tracking_init")
    resources:
        **job_resources("tracking_init"),
    conda:
        ENV_CPU
    shell:
        "{params.memopd} tracking init --cfg {params.cfg:q} --out {output} > {log} 2>&1"
