"""The `train` config section of a run, typed once at the run's entry (`RunConfig.from_section`).

Every default of the section is a default of these dataclasses (`train.ppo` and `train.dtype`: PPOConfig's),
the ones workflow/schemas/config.schema.yaml states included; the one rule across keys (prefix_shared cannot
run activation-checkpointed models: `parallel.check_backend`) is checked here, before any model loads. Keys
the workflow reads and a run does not (memopd.config.TrainRuns) are accepted and ignored; any other key is refused.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields

from memopd.config import (AgentConfig, ColocatedEngineConfig, RolloutConfig, TrainRuns, agent_config, method_section,
                           rollout_config)
from memopd.dist import TIMEOUT_MIN
from memopd.inputs import ConfigError, section
from memopd.parallel import SHARDING, check_backend
from memopd.train.update import PPOConfig

# PPOConfig fields that are not keys of train.ppo: the run's method and seed, train.dtype, the tokenizer's size
PPO_RUN_FIELDS = ("method", "seed", "dtype", "vocab")
# train.ppo keys spelled otherwise in PPOConfig: each lambda named for what it weighs, the attention path for what it is
PPO_FIELD_OF_KEY = {"lam": "gae_lambda", "opd_coef": "opd_lambda", "backend": "attention"}


@dataclass(frozen=True)
class RunConfig:
    steps: int  # optimizer steps of the run
    batch_tasks: int  # episodes per step (all ranks); at least one per rank
    lr_actor: float
    lr_critic: float
    ppo: PPOConfig  # train.ppo, with the run's method and seed and train.dtype
    critic_layers: int | None = None  # the critic's decoder layers: the student's first N (None: all)
    checkpoint_every: int = 1  # steps between checkpoints (the last step always writes one)
    keep_checkpoint: bool = False  # keep checkpoint/ after a finished run
    shard: str = "none"  # none (a replica per rank) | fsdp (FSDP2 shards of policy, critic, reference)
    activation_checkpointing: bool = False  # recompute every decoder layer of policy and critic in the backward
    vllm: ColocatedEngineConfig = field(default_factory=ColocatedEngineConfig)  # train.vllm
    dist_timeout_min: float = TIMEOUT_MIN  # how long a rank waits in a collective (rank 0 writing a checkpoint)

    def __post_init__(self):
        if self.shard not in SHARDING:
            raise ValueError(f"train.shard {self.shard!r}: choose from {SHARDING}")
        check_backend(self.ppo.attention, self.activation_checkpointing)

    @property
    def dtype(self) -> str:
        """train.dtype: the compute precision of policy, critic and reference, and the teacher's weights."""
        return self.ppo.dtype

    @classmethod
    def from_section(cls, section: dict, method: str, seed: int) -> RunConfig:
        """The `train` config section of the run (`method`, `seed`), the method's own settings
        (train.per_method) over the rest."""
        section = method_section(section, method)
        own = {f.name for f in fields(cls)}
        if unknown := set(section) - own - {"dtype"} - {f.name for f in fields(TrainRuns)}:
            raise ValueError(f"unknown train config keys {sorted(unknown)}")
        if missing := {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING} - set(section):
            raise ValueError(f"train config lacks {sorted(missing)}")
        key_of = {v: k for k, v in PPO_FIELD_OF_KEY.items()}
        ppo_keys = {key_of.get(f.name, f.name) for f in fields(PPOConfig)} - set(PPO_RUN_FIELDS)
        if unknown := set(section["ppo"]) - ppo_keys:
            raise ValueError(f"unknown train.ppo keys {sorted(unknown)}")
        precision = {"dtype": section["dtype"]} if "dtype" in section else {}
        ppo = PPOConfig(**{PPO_FIELD_OF_KEY.get(k, k): v for k, v in section["ppo"].items()}, **precision,
                        method=method, seed=seed)
        return cls(**{k: v for k, v in section.items() if k in own and k not in ("ppo", "vllm")}, ppo=ppo,
                   vllm=ColocatedEngineConfig.from_dict(section.get("vllm")))


@dataclass(frozen=True)
class RunSections:
    """What one training run reads of the config, typed once at its entry: its train section (the method's own
    settings over the rest), agent (its batch size rollout's) and rollout."""

    run: RunConfig
    agent: AgentConfig
    rollout: RolloutConfig

    @classmethod
    def parse(cls, cfg: dict, method: str, seed: int) -> RunSections:
        """`cfg`'s train, agent and rollout sections; a bad or missing key of any is a ConfigError naming its
        section, before anything runs."""
        agent, rollout = agent_config(cfg), rollout_config(cfg)
        try:
            run = RunConfig.from_section(section(cfg, "train"), method, seed)
        except ConfigError:
            raise
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config section 'train': {e}") from None
        return cls(run, agent, rollout)
