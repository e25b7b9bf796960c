# Exactness audits of the packed representation.


rule rce_smoke:
    input:
        model="results/models/student_init/model.safetensors",
    output:
        json="results/audit/rce_smoke.json",
        csv=report("results/audit/rce_smoke.csv", caption=caption("rce_smoke"), category=REPORT_AUDITS,
                   subcategory="RCE"),
    params:
        code=code("rce"),
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


# --- Alignment audits and ablation tables (src/memopd/audit/steps.py): the audit episodes are rolled
# out once; every table and figure is its own target. The model, teacher and episode counts come from
# the `audit` config section; the captions name them.

AUDIT = config["audit"]
AUDIT_MODEL = f"results/models/{AUDIT['model']}/model.safetensors"
AUDIT_EPISODES = "results/audit/episodes.parquet"
AUDIT_RULES = list(RULES)  # the built-in rules (a user's agent.rule is audited through results/audit/episodes)
AUDIT_TABLES = [f"results/tables/{t}.{ext}" for t in ("alignment_audit", "state_corruption", "teacher_divergence",
                "action_domain", "context_updates", "packing_efficiency") for ext in ("csv", "md")] + [
               "results/figures/teacher_divergence.png", "results/figures/packing_efficiency.png"]
# Each step gets only the config it reads, so changing a knob reruns only the steps it affects.
AUDIT_ROLLOUT_KEYS = ("model", "benchmark", "episodes", "rule", "rule_episodes", "invalid_action", "temperature",
                      "max_new_tokens")
AUDIT_ROLLOUT_CFG = json.dumps({"agent": config["agent"], "rollout": config["rollout"],
                                "audit": {k: AUDIT[k] for k in AUDIT_ROLLOUT_KEYS if k in AUDIT}}, sort_keys=True)
AUDIT_TABLE_CFG = json.dumps({k: AUDIT[k] for k in ("dtype", "clip", "backends")}, sort_keys=True)
AUDIT_PACKING_CFG = json.dumps({k: AUDIT[k] for k in ("backends", "packing")}, sort_keys=True)


rule audit_episodes:
    input:
        model=AUDIT_MODEL,
        benchmark=f"results/benchmarks/{AUDIT['benchmark']}.parquet",
        index=RETRIEVAL_INDEX,
    output:
        episodes=AUDIT_EPISODES,
        meta="results/audit/episodes.json",
    params:
        code=code("audit rollouts"),
        memopd=MEMOPD,
        cfg=AUDIT_ROLLOUT_CFG,
        seed=config["seed"],
        model=lambda w, input: os.path.dirname(input.model),
        limit=AUDIT["episodes"],
        rule="",  # audit.rule (else agent.rule)
    log:
        f"{LOGS}/audit_episodes.log",
    benchmark:
        f"{LOGS}/bench/audit_episodes.tsv"
    threads: job_threads("audit_episodes")
    resources:
        **job_resources("audit_episodes"),
    conda:
        ENV_GPU
    shell:
        "{params.memopd} audit rollouts --cfg {params.cfg:q} --seed {params.seed} --model {params.model} "
        "--benchmark {input.benchmark} --index {input.index} --limit {params.limit} {params.rule} --threads {threads} "
        "--out {output.episodes} > {log} 2>&1"


use rule audit_episodes as audit_rule_episodes with:
    output:
        episodes="results/audit/episodes_{rule}.parquet",
        meta="results/audit/episodes_{rule}.json",
    wildcard_constraints:
        rule="|".join(AUDIT_RULES),
    params:
        cfg=AUDIT_ROLLOUT_CFG,
        seed=config["seed"],
        model=lambda w, input: os.path.dirname(input.model),
        limit=AUDIT["rule_episodes"],
        rule=lambda w: f"--rule {w.rule}",
    log:
        f"{LOGS}/audit_rule_episodes_{{rule}}.log",
    benchmark:
        f"{LOGS}/bench/audit_rule_episodes_{{rule}}.tsv"
    priority: 5  # audit_context_updates waits for all five: start them before the evaluations, so it does not end the run


rule audit_alignment:
    input:
        model=AUDIT_MODEL,
        episodes=AUDIT_EPISODES,
    output:
        csv=report("results/tables/alignment_audit.csv", caption=caption("alignment_audit"), category=REPORT_AUDITS,
                   subcategory="RCE"),
        md="results/tables/alignment_audit.md",
    params:
        code=code("audit alignment"),
        memopd=MEMOPD,
        cfg=AUDIT_TABLE_CFG,
        model=lambda w, input: os.path.dirname(input.model),
    log:
        f"{LOGS}/audit_alignment.log",
    benchmark:
        f"{LOGS}/bench/audit_alignment.tsv"
    threads: job_threads("audit_alignment")
    resources:
        **job_resources("audit_alignment"),
    conda:
        ENV_GPU
    shell:
        "{params.memopd} audit alignment --cfg {params.cfg:q} --model {params.model} --episodes {input.episodes} "
        "--threads {threads} --out {output.csv} > {log} 2>&1"


rule audit_batch_layouts:
    # other trainers' layouts of the same episodes beside our packer (its own target, outside `all`: docs/results.md
    # "Batch layouts of other trainers")
    input:
        model=AUDIT_MODEL,
        episodes=expand("results/audit/episodes_{rule}.parquet", rule=["summary_replacement", "sliding_window"]),
    output:
        csv=report("results/tables/batch_layouts.csv", caption=caption("batch_layouts"), category=REPORT_AUDITS,
                   subcategory="other trainers"),
        md="results/tables/batch_layouts.md",
    params:
        code=code("audit representations"),
        memopd=MEMOPD,
        model=lambda w, input: os.path.dirname(input.model),
    log:
        f"{LOGS}/audit_batch_layouts.log",
    benchmark:
        f"{LOGS}/bench/audit_batch_layouts.tsv"
    threads: job_threads("audit_batch_layouts")
    resources:
        **job_resources("audit_batch_layouts"),
    conda:
        ENV_GPU
    shell:
        "{params.memopd} audit representations --model {params.model} --episodes {input.episodes} --repeats 5 "
        "--threads {threads} --out {output.csv} > {log} 2>&1"


rule audit_state_corruption:
    input:
        model=AUDIT_MODEL,
        episodes=AUDIT_EPISODES,
    output:
        csv=report("results/tables/state_corruption.csv", caption=caption("state_corruption"), category=REPORT_AUDITS,
                   subcategory="RCE"),
        md="results/tables/state_corruption.md",
    params:
        code=code("audit state-corruption"),
        memopd=MEMOPD,
        cfg=AUDIT_TABLE_CFG,
        model=lambda w, input: os.path.dirname(input.model),
    log:
        f"{LOGS}/audit_state_corruption.log",
    benchmark:
        f"{LOGS}/bench/audit_state_corruption.tsv"
    threads: job_threads("audit_state_corruption")
    resources:
        **job_resources("audit_state_corruption"),
    conda:
        ENV_GPU
    shell:
        "{params.memopd} audit state-corruption --cfg {params.cfg:q} --model {params.model} --episodes {input.episodes} "
        "--threads {threads} --out {output.csv} > {log} 2>&1"


rule audit_teacher_divergence:
    input:
        teacher=f"results/models/{AUDIT['teacher']}/model.safetensors",
        episodes=AUDIT_EPISODES,
    output:
        csv=report("results/tables/teacher_divergence.csv", caption=caption("teacher_divergence"),
                   category=REPORT_AUDITS, subcategory="teacher"),
        md="results/tables/teacher_divergence.md",
        figure=report("results/figures/teacher_divergence.png", caption=caption("teacher_divergence_figure"),
                      category=REPORT_AUDITS, subcategory="teacher"),
    params:
        code=code("audit teacher-divergence"),
        memopd=MEMOPD,
        cfg=AUDIT_TABLE_CFG,
        teacher=lambda w, input: os.path.dirname(input.teacher),
    log:
        f"{LOGS}/audit_teacher_divergence.log",
    benchmark:
        f"{LOGS}/bench/audit_teacher_divergence.tsv"
    threads: job_threads("audit_teacher_divergence")
    resources:
        **job_resources("audit_teacher_divergence"),
    conda:
        ENV_GPU
    shell:
        "{params.memopd} audit teacher-divergence --cfg {params.cfg:q} --teacher {params.teacher} "
        "--episodes {input.episodes} --threads {threads} --out {output.csv} --figure {output.figure} > {log} 2>&1"


rule audit_action_domain:
    input:
        episodes=AUDIT_EPISODES,
    output:
        csv=report("results/tables/action_domain.csv", caption=caption("action_domain"), category=REPORT_AUDITS,
                   subcategory="training masks"),
        md="results/tables/action_domain.md",
    params:
        code=code("audit action-domain"),
        memopd=MEMOPD,
        cfg=AUDIT_TABLE_CFG,
    log:
        f"{LOGS}/audit_action_domain.log",
    benchmark:
        f"{LOGS}/bench/audit_action_domain.tsv"
    threads: job_threads("audit_action_domain")
    resources:
        **job_resources("audit_action_domain"),
    conda:
        ENV_CPU
    shell:
        "{params.memopd} audit action-domain --cfg {params.cfg:q} --episodes {input.episodes} --out {output.csv} > {log} 2>&1"


rule audit_context_updates:
    input:
        model=AUDIT_MODEL,
        episodes=expand("results/audit/episodes_{rule}.parquet", rule=AUDIT_RULES),
    output:
        csv=report("results/tables/context_updates.csv", caption=caption("context_updates"), category=REPORT_AUDITS,
                   subcategory="RCE"),
        md="results/tables/context_updates.md",
    params:
        code=code("audit context-updates"),
        memopd=MEMOPD,
        cfg=AUDIT_TABLE_CFG,
        model=lambda w, input: os.path.dirname(input.model),
    log:
        f"{LOGS}/audit_context_updates.log",
    benchmark:
        f"{LOGS}/bench/audit_context_updates.tsv"
    priority: 5
    threads: job_threads("audit_context_updates")
    resources:
        **job_resources("audit_context_updates"),
    conda:
        ENV_GPU
    shell:
        "{params.memopd} audit context-updates --cfg {params.cfg:q} --model {params.model} --episodes {input.episodes} "
        "--threads {threads} --out {output.csv} > {log} 2>&1"


rule audit_packing_efficiency:
    input:
        model=AUDIT_MODEL,
        episodes=AUDIT_EPISODES,
    output:
        csv=report("results/tables/packing_efficiency.csv", caption=caption("packing_efficiency"),
                   category=REPORT_EFFICIENCY, subcategory="packing"),
        md="results/tables/packing_efficiency.md",
        figure=report("results/figures/packing_efficiency.png", caption=caption("packing_efficiency_figure"),
                      category=REPORT_EFFICIENCY, subcategory="packing"),
    params:
        code=code("audit packing-efficiency"),
        memopd=MEMOPD,
        cfg=AUDIT_PACKING_CFG,
        model=lambda w, input: os.path.dirname(input.model),
        seed=config["seed"],
    log:
        f"{LOGS}/audit_packing_efficiency.log",
    benchmark:
        f"{LOGS}/bench/audit_packing_efficiency.tsv"
    threads: job_threads("audit_packing_efficiency")
    resources:
        **job_resources("audit_packing_efficiency"),
    conda:
        ENV_GPU
    shell:
        "{params.memopd} audit packing-efficiency --cfg {params.cfg:q} --seed {params.seed} --model {params.model} "
        "--episodes {input.episodes} --threads {threads} --out {output.csv} --figure {output.figure} > {log} 2>&1"


rule audit_all:
    input:
        AUDIT_TABLES,
