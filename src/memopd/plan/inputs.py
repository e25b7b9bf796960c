"""The config as the planner reads it: each section it sizes jobs from, parsed once into memopd.config's types."""
from __future__ import annotations

from dataclasses import dataclass

from memopd.config import (AgentConfig, AuditRollout, AuditScoring, EvalConfig, PackingAudit, PlanConfig,
                           PretrainedModelConfig, RCEConfig, RCERolloutsConfig, ResourcesConfig, RetrievalConfig,
                           RolloutConfig, TeacherConfig, TinyModelConfig, TokenizerConfig, TrainRuns, eval_config, model_config,
                           plan_config, retrieval_config, rollout_config, teacher_config)
from memopd.inputs import section


@dataclass(frozen=True)
class PlanInputs:
    raw: dict  # the whole config: train and sft, which their trainers' modules parse (stages.run_config, _sft_job)
    plan: PlanConfig
    resources: ResourcesConfig
    agent: AgentConfig
    rollout: RolloutConfig
    retrieval: RetrievalConfig
    teacher: TeacherConfig
    eval: EvalConfig
    rce: RCEConfig
    rce_rollouts: RCERolloutsConfig
    audit: AuditRollout  # the audit episodes' model, tasks and sampling
    audit_scoring: AuditScoring
    audit_teacher: str  # audit.teacher: the model whose flattened logits the divergence audit compares
    packing: PackingAudit
    models: dict[str, PretrainedModelConfig | TinyModelConfig]  # student, teacher
    tokenizer: TokenizerConfig
    runs: TrainRuns  # the train section's runs (which methods and seeds)

    @classmethod
    def parse(cls, cfg: dict) -> "PlanInputs":
        audit = section(cfg, "audit", "teacher", "packing")
        return cls(cfg, plan_config(cfg), ResourcesConfig.from_dict(cfg["resources"]),
                   AgentConfig.from_dict(section(cfg, "agent")), rollout_config(cfg), retrieval_config(cfg),
                   teacher_config(cfg), eval_config(cfg), RCEConfig.from_dict(cfg["rce"]),
                   RCERolloutsConfig.from_dict(cfg["rce_rollouts"]), AuditRollout.from_dict(audit),
                   AuditScoring.from_dict(audit), audit["teacher"], PackingAudit.from_dict(audit["packing"]),
                   {r: model_config(section(cfg, "models", r)[r], f"models.{r}") for r in ("student", "teacher")},
                   TokenizerConfig.from_dict(cfg["tokenizer"]), TrainRuns.from_section(section(cfg, "train")))
