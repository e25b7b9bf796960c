# Exactness audits of the packed representation.


rule rce_smoke:
    input:
        src("records", "packing", "attention", "rce", "synthetic", "cli"),
        model="results/models/student_init/model.safetensors",
    output:
        json="results/audit/rce_smoke.json",
        csv="results/audit/rce_smoke.csv",
    params:
        cfg=cfg_json("rce"),
        model=lambda w, input: os.path.dirname(input.model),
        seed=config["seed"],
        data_dir=config["data_dir"],
    conda:
        CPU_ENV
    log:
        f"{LOGS}/rce_smoke.log",
    benchmark:
        f"{LOGS}/bench/rce_smoke.tsv"
    shell:
        "memopd rce --cfg {params.cfg:q} --seed {params.seed} --model {params.model} "
        "--data-dir {params.data_dir} --out {output.json} --strict > {log} 2>&1"
