# MemOPD pipeline. Embedded default: `snakemake -c 2 all`. Paper scale: `snakemake --profile slurm all`.
# Every rule is a thin call of the `memopd` CLI; the rules live in workflow/rules/.


configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/models.smk"
include: "workflow/rules/audit.smk"
include: "workflow/rules/eval.smk"


rule all:
    default_target: True
    input:
        "results/models/student_init/model.safetensors",
        "results/models/teacher_init/model.safetensors",
        "results/audit/rce_smoke.json",
