# MemOPD pipeline. Embedded default: `snakemake -c 2 all`. Paper scale on SLURM: `snakemake --profile slurm all`
# (slurm/config.yaml selects config/paper.yaml). Every rule is a thin call of the `memopd` CLI; the rules
# live in workflow/rules/.


# The embedded default when no config file is given; a scale overlay (config/small.yaml, paper.yaml, smoke.yaml)
# names it as its base and states only what it changes. Jobs on a cluster receive the same --configfiles, so
# they build the same config.
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"

else:
    # A layer names its base and the keys it drops (config/README.md), which Snakemake's own merge ignores: the
    # config is rebuilt from the files as `memopd plan --config` builds it, then --config over it as Snakemake does.
    import os as _os
    import sys as _sys

    _sys.path.insert(0, _os.path.join(workflow.basedir, "src"))
    from memopd.schema import merge as _merge, merge_files as _merge_files

    _sys.path.pop(0)
    _layered = _merge(_merge_files(workflow.overwrite_configfiles), dict(workflow.config_settings.config))
    config.clear()
    config.update(_layered)


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
