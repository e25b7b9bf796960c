# MemOPD pipeline. Embedded default: `snakemake -c 2 all`. Paper scale: `snakemake --profile slurm all`.
# Every rule is a thin call of the `memopd` CLI; the rules live in workflow/rules/.


# The embedded default, unless a config file is given (`--configfile config/paper.yaml`, or the slurm
# profile): given files replace it instead of being deep-merged into it, so a pretrained model spec
# never inherits the tiny model's keys.
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/models.smk"
include: "workflow/rules/benchmarks.smk"
include: "workflow/rules/eval.smk"
include: "workflow/rules/audit.smk"


rule all:
    default_target: True
    input:
        "results/models/student_init/model.safetensors",
        "results/models/teacher_init/model.safetensors",
        "results/audit/rce_smoke.json",
        rules.benchmarks.output,
        "results/tables/retrieval_recall.csv",
        AUDIT_TABLES,
