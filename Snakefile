# MemOPD pipeline. Embedded default: `snakemake -c 2 all`. Paper scale on SLURM: `snakemake --profile slurm all`
# (slurm/config.yaml selects config/paper.yaml). Every rule is a thin call of the `memopd` CLI; the rules
# live in workflow/rules/.


# The embedded default applies only when no config file is given: Snakemake would otherwise deep-merge
# a --configfile (config/paper.yaml) into it, mixing the two scales. Jobs on a cluster receive the same
# --configfiles, so they make the same choice.
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


# `snakemake --report results/report.html` (after a run): every table and figure, with captions and
# categories by paper section (workflow/report/).
report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/prefetch.smk"
include: "workflow/rules/tracking.smk"
include: "workflow/rules/models.smk"
include: "workflow/rules/benchmarks.smk"
include: "workflow/rules/teacher.smk"
include: "workflow/rules/sft.smk"
include: "workflow/rules/eval.smk"
include: "workflow/rules/audit.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/plan.smk"
include: "workflow/rules/study.smk"


rule all:
    default_target: True
    input:
        "results/models/student_init/model.safetensors",
        "results/models/teacher_init/model.safetensors",
        "results/audit/rce_smoke.json",
        rules.benchmarks.output,
        "results/tables/retrieval_recall.csv",
        "results/audit/rce_rollouts.json",
        "results/tables/sft_data_stats.csv",
        "results/tables/sft_summary.csv",
        rules.eval_all.input,
        rules.results_tables.output,
        rules.matched_control.output,
        rules.training_curves.output,
        AUDIT_TABLES,
        PLAN_TARGETS,  # paper scale: results/plan/plan.{csv,md}
        rules.study.output if STUDY else [],  # the controlled study (config `study`)


check_resources_config()
check_eval_config()
check_tokenizers_config()
