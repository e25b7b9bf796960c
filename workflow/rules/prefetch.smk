# Paper scale: the one step that reaches the Hugging Face hub (src/memopd/prefetch.py; see HUB_MANIFEST in
# common.smk). A local rule: it runs where Snakemake runs (the login node, which has the network), never on a
# compute node. It downloads every repository of HUB_REPOS at its pinned commit into hub.home, then writes the
# manifest that the steps reading the hub take as an input. Not part of the embedded default's DAG.


rule prefetch:
    localrule: True
    # no code() param: a change of the downloader must not rerun the whole pipeline; the repositories and their
    # revisions (params.cfg) decide what the manifest holds, and a change of them reruns it and what reads it
    output:
        "results/prefetch/manifest.json",
    params:
        # without HF_HUB_OFFLINE, and without HF_HOME: the download finds the login's token in its own HF_HOME
        memopd=f"{PYTHON_ONLINE} -m memopd.cli",
        cfg=json.dumps({"home": HUB.home if HUB else None, "repos": HUB_REPOS}, sort_keys=True),
    log:
        f"{LOGS}/prefetch.log",
    benchmark:
        f"{LOGS}/bench/prefetch.tsv"
    threads: 1
    resources:
        **job_resources("prefetch"),
    conda:
        ENV_CPU
    shell:
        "{params.memopd} prefetch --cfg {params.cfg:q} --out {output} > {log} 2>&1"
