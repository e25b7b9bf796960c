"""Resource plan: every job's peak GPU memory, host memory and disk, estimated from the config and checked
against the job's resources before anything runs (`memopd plan`; the workflow's onstart check).

Units: GB = 1e9 bytes. Limits are read conservatively: plan.gpu_memory_gb per GPU (an "80 GB" H100 holds
85.5e9 bytes), resources mem_mb x 1e6 bytes (SLURM's MB is a MiB), plan.disk_gb for results/ + data/.

Modules, each importing only those listed before it: inputs (the config's sections the planner reads, parsed
once), models (model sizes), memory (the bytes of each term, with their formulas, and the sequence bounds), jobs
(one job's estimate and the terms several jobs share), stages (one planner per group of rules, and `plan`), report
(the table, the Markdown plan, what does not fit); `memopd plan` is plan.commands.
"""
from memopd.plan.inputs import PlanInputs
from memopd.plan.jobs import Job
from memopd.plan.memory import (COMPARE_CHUNK, DIVERGENCE_BYTES, RCE_BYTES, STATE_BYTES, TOKEN_BYTES, act_per_token,
                                attention_scores, call_input, episode_tokens, kv_per_token, new_tokens,
                                resolve_backend)
from memopd.plan.models import (BYTES, GB, Spec, cached_config, load_config, model_role, qwen2_params, resolve,
                                role_spec, spec_from_config)
from memopd.plan.report import disk_need, failures, markdown, rows
from memopd.plan.stages import PLANNERS, plan, plan_data, plan_rollouts, plan_scoring, plan_sft, plan_train

__all__ = [
    "BYTES", "COMPARE_CHUNK", "DIVERGENCE_BYTES", "GB", "PLANNERS", "RCE_BYTES", "STATE_BYTES",
    "TOKEN_BYTES", "Job", "PlanInputs", "Spec", "act_per_token", "attention_scores", "cached_config", "call_input",
    "disk_need", "episode_tokens", "failures", "kv_per_token", "load_config", "markdown",
    "model_role", "new_tokens", "plan", "plan_data", "plan_rollouts", "plan_scoring", "plan_sft", "plan_train",
    "qwen2_params", "resolve", "resolve_backend", "role_spec", "rows", "spec_from_config",
]
