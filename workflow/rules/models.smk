# Tokenizer and model initialisation (tiny models from config, the packaged base model, or pretrained by
# name at paper scale).

# The files the tokenizer trains on: tokenizer.files, or the committed data directory as a whole.
TOKENIZER_DATA = ([os.path.join(config["data_dir"], f["path"]) for f in config["tokenizer"]["files"]]
                  if "files" in config["tokenizer"] else config["data_dir"])


rule tokenizer:
    input:
        data=TOKENIZER_DATA,
    output:
        "results/models/tokenizer/tokenizer.json",
    params:
        code=code("tokenizer"),
        memopd=MEMOPD,
        cfg=cfg_json("tokenizer"),
        data_dir=lambda w: config["data_dir"],  # a lambda: the value is a path prefix the linter would flag
        outdir=lambda w, output: os.path.dirname(output[0]),
    log:
        f"{LOGS}/tokenizer.log",
    benchmark:
        f"{LOGS}/bench/tokenizer.tsv"
    threads: job_threads("tokenizer")
    resources:
        **job_resources("tokenizer"),
    conda:
        ENV_CPU
    shell:
        "{params.memopd} tokenizer --cfg {params.cfg:q} --data-dir {params.data_dir} --out {params.outdir} > {log} 2>&1"


rule model_base:
    # the packaged pretrained LM (config models.base), hash-checked and de-quantised once
    input:
    output:
        "results/models/base/model.safetensors",
    params:
        code=code("model base"),
        memopd=MEMOPD,
        cfg=lambda w: cfg_json("models", "base"),
        outdir=lambda w, output: os.path.dirname(output[0]),
    log:
        f"{LOGS}/model_base.log",
    benchmark:
        f"{LOGS}/bench/model_base.tsv"
    threads: job_threads("model_base")
    resources:
        **job_resources("model_base"),
    conda:
        ENV_CPU
    shell:
        "{params.memopd} model base --cfg {params.cfg:q} --out {params.outdir} > {log} 2>&1"


rule model_init:
    input:
        unpack(model_init_inputs),
        hub=HUB_MANIFEST,  # paper scale: the pretrained model is prefetched
    output:
        "results/models/{role}_init/model.safetensors",
    wildcard_constraints:
        role="student|teacher",
    params:
        code=code("model init"),
        memopd=MEMOPD,
        cfg=lambda w: cfg_json("models", w.role),
        seed=config["seed"],
        outdir=lambda w, output: os.path.dirname(output[0]),
        tokenizer=lambda w, input: f"--tokenizer {os.path.dirname(input.tokenizer)}" if "tokenizer" in input.keys() else "",
    log:
        f"{LOGS}/model_init_{{role}}.log",
    benchmark:
        f"{LOGS}/bench/model_init_{{role}}.tsv"
    threads: job_threads("model_init")
    resources:
        **job_resources("model_init"),
    conda:
        ENV_CPU
    shell:
        "{params.memopd} model init --cfg {params.cfg:q} --seed {params.seed} {params.tokenizer} "
        "--out {params.outdir} > {log} 2>&1"
