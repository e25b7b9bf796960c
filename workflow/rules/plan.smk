# The resource plan (src/memopd/plan/): every job's peak GPU memory, host memory and disk, estimated from
# the config, against its resources. Two uses:
#  * checked before a run: the onstart handler below plans the rules of the jobs about to run and, with
#    plan.enforce (config/paper.yaml), refuses the run, naming each job and the number that does not fit,
#    before any job is submitted. Snakemake runs no handler in a dry run (`-n`) or inside a job.
#  * the table: results/plan/plan.{csv,md} (part of `all` at paper scale), written by a local job that no
#    other job depends on, so rewriting or deleting it never reruns a GPU job.
PLAN_TARGETS = ["results/plan/plan.csv", "results/plan/plan.md"] if config["scale"] == "paper" else []


localrules:
    plan,


rule plan:
    input:
    output:
        csv="results/plan/plan.csv",
        md="results/plan/plan.md",
    params:
        code=code("plan"),
        memopd=MEMOPD,
        cfg=json.dumps(config, sort_keys=True),
    log:
        f"{LOGS}/plan.log",
    benchmark:
        f"{LOGS}/bench/plan.tsv"
    threads: 1
    resources:
        **job_resources("plan"),
    conda:
        ENV_CPU
    shell:
        # --no-refuse: the table is written whatever it says (the onstart check is what refuses a run)
        "{params.memopd} plan --cfg {params.cfg:q} --no-refuse --out {output.csv} > {log} 2>&1"


onstart:
    check_plan()
