# Tokenizer and model initialisation (tiny models from config, or pretrained by name at paper scale).


rule tokenizer:
    input:
        src("models", "data/__init__", "cli"),
        data=config["data_dir"],
    output:
        "results/models/tokenizer/tokenizer.json",
    params:
        cfg=cfg_json("tokenizer"),
        outdir=lambda w, output: os.path.dirname(output[0]),
    conda:
        CPU_ENV
    log:
        f"{LOGS}/tokenizer.log",
    benchmark:
        f"{LOGS}/bench/tokenizer.tsv"
    shell:
        "memopd tokenizer --cfg {params.cfg:q} --data-dir {input.data} --out {params.outdir} > {log} 2>&1"


rule model_init:
    input:
        src("models", "cli"),
        tokenizer="results/models/tokenizer/tokenizer.json",
    output:
        "results/models/{role}_init/model.safetensors",
    wildcard_constraints:
        role="student|teacher",
    params:
        cfg=lambda w: cfg_json("models", w.role),
        outdir=lambda w, output: os.path.dirname(output[0]),
        tokdir=lambda w, input: os.path.dirname(input.tokenizer),
        online="--online" if config["online"] else "",
        seed=config["seed"],
    conda:
        CPU_ENV
    log:
        f"{LOGS}/model_init_{{role}}.log",
    benchmark:
        f"{LOGS}/bench/model_init_{{role}}.tsv"
    shell:
        "memopd model init --cfg {params.cfg:q} --seed {params.seed} --tokenizer {params.tokdir} "
        "{params.online} --out {params.outdir} > {log} 2>&1"
