# Exactness audits of the packed representation.


rule rce_smoke:
    input:
        src("records", "packing", "attention", "rce", "synthetic", "cli"),
        model="results/models/student_init/model.safetensors",
    output:
        json="results/audit/rce_smoke.json",
        csv="results/audit/rce_smoke.csv",
    params:
        memopd=MEMOPD,
        cfg=cfg_json("rce"),
        seed=config["seed"],
        data=config["data_dir"],
        model=lambda w, input: os.path.dirname(input.model),
        # The step's GPU when it has one (paper scale), the CPU otherwise.
        device=lambda w, resources: "cuda" if resources.gpu else "cpu",
    log:
        f"{LOGS}/rce_smoke.log",
    benchmark:
        f"{LOGS}/bench/rce_smoke.tsv"
    threads: job_threads("rce_smoke")
    resources:
        **job_resources("rce_smoke"),
    conda:
        ENV_GPU
    shell:
        "{params.memopd} rce --cfg {params.cfg:q} --seed {params.seed} --model {params.model} "
        "--device {params.device} --data-dir {params.data} --out {output.json} --strict > {log} 2>&1"
