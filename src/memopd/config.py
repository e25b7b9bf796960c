"""The config's sections as typed values (agent, rollout, benchmarks, kb, rce, rce_rollouts, retrieval, plan, eval,
teacher, audit, claims, resources), parsed once where a command starts. Importable without torch: the Snakefile
imports it at parse time (workflow/rules/common.smk), and so do the planner and the commands before they load any
model.

Config keys keep their spelling (workflow/schemas/config.schema.yaml documents them); a field may be named for
what it is where the key is ambiguous: `rollout.backend` is the generation engine (`RolloutConfig.engine`), not
an attention path or a retrieval index.
"""
from __future__ import annotations

import re
from dataclasses import MISSING, dataclass, field, fields

from memopd.inputs import ConfigError, section
from memopd.methods import control_methods

RULES = ("full_retention", "suffix_retention", "summary_replacement", "sliding_window", "retrieval_refresh")
USER_RULE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")  # a user's rule by import path, module:function
VIEWS = ("exact", "persistent")  # what a model is shown at each call (AgentConfig.view)
ENGINES = ("hf", "vllm")  # generation engines (rollout.backend)


@dataclass
class MemoryConfig:
    """How the next call's context is built (memopd.agent.memory): a built-in rule, or module:function."""

    rule: str = "summary_replacement"
    suffix_tokens: int = 32  # K of suffix_retention
    window: int = 2  # W of sliding_window

    def __post_init__(self):
        if self.rule not in RULES and not USER_RULE.fullmatch(self.rule):
            raise ConfigError(f"agent.rule {self.rule!r}: neither a built-in rule {RULES} nor an import path "
                              "module:function")
        if self.suffix_tokens < 1 or self.window < 1:
            raise ValueError("suffix_tokens and window must be >= 1")


@dataclass
class AgentConfig:
    """The `agent` section of the config (plus `batch_size` from `rollout`)."""

    rule: str = "summary_replacement"
    suffix_tokens: int = 32
    window: int = 2
    turns: dict = field(default_factory=lambda: {"default": 6})  # turn budget (calls) per benchmark
    invalid_action: str = "end"  # "end": an invalid action ends the episode; "continue": it is told and goes on
    invalid_penalty: float = 0.0  # subtracted from the reward per invalid action
    top_k: int = 3  # passages per search
    max_observation_tokens: int = 256  # cut of the passages' tokens in one observation
    max_input_tokens: int = 3072  # an input longer than this ends the episode ("context_overflow")
    max_query_chars: int = 512
    reward: str = "em"  # "em" or "f1" of the final answers
    batch_size: int = 16
    # what the model is shown at each call: "exact" (the memory rule's state) or "persistent" (the history of the
    # episode's exact states and responses as one transcript, records.flatten_history: the state memopd_persistent's
    # teacher is scored on); recorded as shown
    view: str = "exact"

    def __post_init__(self):
        if self.invalid_action not in ("end", "continue"):
            raise ValueError(f"invalid_action must be 'end' or 'continue', not {self.invalid_action!r}")
        if self.view not in VIEWS:
            raise ValueError(f"view must be one of {VIEWS}, not {self.view!r}")
        if self.reward not in ("em", "f1"):
            raise ValueError(f"reward must be 'em' or 'f1', not {self.reward!r}")
        if "default" not in self.turns:
            raise ValueError("turns needs a 'default' budget")
        self.memory = MemoryConfig(self.rule, self.suffix_tokens, self.window)

    @classmethod
    def from_dict(cls, cfg: dict, **overrides) -> "AgentConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(cfg) - known
        if unknown:
            raise ValueError(f"unknown agent config keys {sorted(unknown)}")
        return cls(**{**cfg, **overrides})

    def max_turns(self, benchmark: str) -> int:
        """Budget by exact benchmark name, then without its split (`wikirag_test` -> `wikirag`), then
        `default`."""
        b = benchmark.lower()
        turns = {k.lower(): v for k, v in self.turns.items()}
        return int(turns.get(b, turns.get(re.sub(r"_(train|test|dev|val)$", "", b), turns["default"])))


def _known(d: dict | None, cls, key: str) -> dict:
    """`d` (None: empty) once every key is a field of `cls`; else a ConfigError naming `key`'s unknown ones."""
    d = dict(d or {})
    if unknown := set(d) - {f.name for f in fields(cls)}:
        raise ConfigError(f"unknown {key} keys {sorted(unknown)}; known: {sorted(f.name for f in fields(cls))}")
    return d


def _required(d: dict, cls, key: str) -> dict:
    """`d` once it holds every field of `cls` without a default; else a ConfigError naming the missing keys."""
    if missing := [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
                   and f.name not in d]:
        raise ConfigError(f"config section {key!r} has no {', '.join(map(repr, missing))}")
    return d


@dataclass(frozen=True)
class EngineConfig:
    """`rollout.vllm`: a vLLM generation engine (rollout.backend vllm) of rollouts and evaluations."""

    gpu_memory_utilization: float = 0.85  # the engine's share of its GPU: alone on it but for a scoring model
    max_model_len: int | None = None  # the longest sequence; None: the model's own limit, as vLLM derives it

    @classmethod
    def from_dict(cls, d: dict | None, key: str = "rollout.vllm") -> "EngineConfig":
        return cls(**_known(d, cls, key))


@dataclass(frozen=True)
class ColocatedEngineConfig:
    """`train.vllm`: the rollout engine inside a training run's process, beside its policy, critic, reference and
    teacher (generation.weight_sync.colocated_llm); its longest sequence is rollout.vllm's."""

    gpu_memory_utilization: float = 0.3  # the engine's share of the GPU the trainer's models also hold
    sleep: bool = False  # free the engine's GPU memory during the update (vLLM sleep mode, level 2)

    @classmethod
    def from_dict(cls, d: dict | None, key: str = "train.vllm") -> "ColocatedEngineConfig":
        return cls(**_known(d, cls, key))


@dataclass(frozen=True)
class RolloutConfig:
    """The `rollout` section: the generation engine, its precision and device, and the sampling of training
    rollouts (evaluation overrides temperature and max_new_tokens per benchmark: `EvalSettings.sampling`)."""

    engine: str = "hf"  # config key `backend`
    dtype: str = "float32"
    device: str | None = None  # None: the default device
    batch_size: int = 16
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    vllm: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"backend must be one of {ENGINES}, not {self.engine!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "RolloutConfig":
        known = ({f.name for f in fields(cls)} - {"engine"}) | {"backend"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown rollout config keys {sorted(unknown)}")
        d = {("engine" if k == "backend" else k): v for k, v in d.items()}
        return cls(**{**d, "vllm": EngineConfig.from_dict(d.get("vllm"))})

    @property
    def vllm_engine(self) -> bool:
        return self.engine == "vllm"

    def sampling(self, **overrides) -> dict:
        """Keyword arguments of the engine's sampling parameters, with per-step overrides (e.g. eval's greedy)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "max_new_tokens": self.max_new_tokens, **overrides}


def rollout_config(cfg: dict) -> RolloutConfig:
    """The `rollout` section of a config; a ConfigError names a bad key."""
    try:
        return RolloutConfig.from_dict(section(cfg, "rollout"))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config section 'rollout': {e}") from None


def agent_config(cfg: dict, **overrides) -> AgentConfig:
    """The `agent` section as an AgentConfig, its batch size from `rollout`; a ConfigError names a bad key."""
    batch = section(cfg, "rollout", "batch_size")["batch_size"]
    try:
        return AgentConfig.from_dict(section(cfg, "agent"), **{"batch_size": batch, **overrides})
    except (TypeError, ValueError) as e:  # an unknown key, or a field without a value
        raise ConfigError(f"config section 'agent': {e}") from None


SPLITS = ("train", "dev", "test")  # the question pools (memopd.data.compose)
COMPOSE_MODES = ("same_source", "mixed")  # benchmarks.compose: n questions of one data set, or interleaved


@dataclass(frozen=True)
class QASourceConfig:
    """One entry of `benchmarks.sources.<name>`: a question file under data_dir (`path`) or a hub data set (`name`,
    `split`, paper scale). Values are checked where the benchmarks are composed, each error naming its entry."""

    format: str | None = None  # memopd.data.loaders.QA_PARSERS
    path: str | None = None
    name: str | None = None
    config: str | None = None
    split: str | None = None
    revision: str | None = None
    pool: str = "split"  # split: train or test by a seeded hash of the question id; else that pool whole

    @classmethod
    def from_dict(cls, d: dict, key: str) -> "QASourceConfig":
        return cls(**_known(d, cls, key))


@dataclass(frozen=True)
class QnSetConfig:
    """One `benchmarks.qn.sets` entry: `tasks` tasks of `n` questions from the `split` pool."""

    n: int
    split: str
    tasks: int


@dataclass(frozen=True)
class QnConfig:
    """`benchmarks.qn`: the multi-question task sets (Q2, Q8, Q16) and the sources they draw from."""

    sources: tuple[str, ...] = ()
    sets: tuple[QnSetConfig, ...] = ()

    @classmethod
    def from_dict(cls, d: dict | None, key: str = "benchmarks.qn") -> "QnConfig":
        d = _known(d, cls, key)
        sets = []
        for i, s in enumerate(d.get("sets") or ()):
            s = _required(_known(s, QnSetConfig, f"{key}.sets[{i}]"), QnSetConfig, f"{key}.sets[{i}]")
            sets.append(QnSetConfig(int(s["n"]), s["split"], int(s["tasks"])))
        return cls(tuple(d.get("sources") or ()), tuple(sets))


@dataclass(frozen=True)
class WikiRagConfig:
    """`benchmarks.wiki_rag`: single-question retrieval tasks per split (0: none)."""

    sources: tuple[str, ...] = ()
    train: int = 0
    test: int = 0

    @classmethod
    def from_dict(cls, d: dict, key: str = "benchmarks.wiki_rag") -> "WikiRagConfig":
        d = _known(d, cls, key)
        return cls(**{**d, "sources": tuple(d.get("sources") or ())})


@dataclass(frozen=True)
class BenchmarksConfig:
    """The `benchmarks` section (memopd.data.compose): question sources, the Q_n task sets, Wiki-RAG."""

    sources: dict = field(default_factory=dict)  # source name -> tuple of QASourceConfig
    test_fraction: float = 0.3  # of a source's `pool: split` questions
    compose: str = "same_source"  # COMPOSE_MODES
    qn: QnConfig = field(default_factory=QnConfig)
    wiki_rag: WikiRagConfig | None = None

    @classmethod
    def from_dict(cls, d: dict | None, key: str = "benchmarks") -> "BenchmarksConfig":
        d = _known(d, cls, key)
        sources = {name: tuple(QASourceConfig.from_dict(e, f"{key}.sources.{name}[{i}]") for i, e in enumerate(es))
                   for name, es in (d.get("sources") or {}).items()}
        wr = d.get("wiki_rag")
        return cls(**{**d, "sources": sources, "qn": QnConfig.from_dict(d.get("qn"), f"{key}.qn"),
                      "wiki_rag": WikiRagConfig.from_dict(wr, f"{key}.wiki_rag") if wr else None})


@dataclass(frozen=True)
class KBConfig:
    """The `kb` section (memopd.data.kb): sizes of the controlled study's knowledge base and its question pools."""

    people: int = 400
    first_names: int = 40  # few names for many people: look-alikes share one of them
    surnames: int = 60
    values: int = 60  # values per attribute, each shared by ~people/values people
    dev_fraction: float = 0.15
    test_fraction: float = 0.25

    def __post_init__(self):
        if self.people > self.first_names * self.surnames:
            raise ConfigError(f"kb: {self.people} people need more than {self.first_names} x {self.surnames} names")
        if not 0 < self.dev_fraction + self.test_fraction < 1:
            raise ConfigError("kb: dev_fraction + test_fraction must be in (0, 1)")

    @classmethod
    def from_dict(cls, d: dict | None, key: str = "kb") -> "KBConfig":
        return cls(**_known(d, cls, key))


@dataclass(frozen=True)
class TokenizerConfig:
    """The `tokenizer` section (`memopd tokenizer`): the offline byte-level BPE trained on data/."""

    vocab_size: int
    min_frequency: int = 2  # a pair merged only when seen this often
    files: tuple[dict, ...] | None = None  # {format, path} under data_dir; None: the committed samples
    prompts: bool = False  # also train on the agent protocol's fixed text, so that it costs few tokens per call

    @classmethod
    def from_dict(cls, d: dict | None, key: str = "tokenizer") -> "TokenizerConfig":
        d = _required(_known(d, cls, key), cls, key)
        return cls(**{**d, "files": None if d.get("files") is None else tuple(d["files"])})


@dataclass(frozen=True)
class PretrainedModelConfig:
    """models.<role> naming a pretrained LM (paper scale): a hub name or a local path."""

    pretrained: str
    tokenizer: str | None = None  # None: the model's own
    dtype: str = "bfloat16"  # what it is loaded and stored in


@dataclass(frozen=True)
class TinyModelConfig:
    """models.<role> without `pretrained`: a tiny Qwen2 from random weights, its ids the trained tokenizer's."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False

    @classmethod
    def from_dict(cls, d: dict | None, key: str = "models.<role>") -> "TinyModelConfig":
        return cls(**_required(_known(d, cls, key), cls, key))


def model_config(d: dict, key: str = "models.<role>") -> PretrainedModelConfig | TinyModelConfig:
    """One models.<role> section: pretrained when it names `pretrained`, else a tiny model's sizes."""
    cls = PretrainedModelConfig if "pretrained" in d else TinyModelConfig
    return cls(**_required(_known(d, cls, key), cls, key))


@dataclass(frozen=True)
class PackagedModelConfig:
    """models.base: a pretrained LM shipped in an installed Python package (GGUF), its file's hash checked."""

    package: str
    version: str
    module: str
    file: str  # inside the module
    sha256: str  # of that file
    wheel_sha256: str | None = None  # provenance, copied into memopd_model.json
    source: str | None = None
    license: str | None = None

    @classmethod
    def from_dict(cls, d: dict | None, key: str = "models.base") -> "PackagedModelConfig":
        return cls(**_required(_known(d, cls, key), cls, key))


@dataclass(frozen=True)
class HubConfig:
    """The `hub` section (memopd.prefetch, paper scale): where the jobs find the hub repositories the config names,
    each pinned to a commit."""

    home: str  # HF_HOME of every job, on the shared file system
    revisions: dict[str, str]  # repository id -> full commit hash
    ignore: dict[str, list[str]] = field(default_factory=dict)  # repository id -> file patterns left out

    @classmethod
    def from_dict(cls, d: dict | None, key: str = "hub") -> "HubConfig":
        return cls(**_required(_known(d, cls, key), cls, key))


@dataclass(frozen=True)
class StudyConfig:
    """The `study` section (rule study): the controlled study's config files, merged in order."""

    configs: tuple[str, ...]

    @classmethod
    def from_dict(cls, d: dict | None, key: str = "study") -> "StudyConfig":
        d = _required(_known(d, cls, key), cls, key)
        if not d["configs"]:
            raise ConfigError(f"{key}.configs names no config file")
        return cls(tuple(d["configs"]))


@dataclass(frozen=True)
class RCEConfig:
    """The `rce` section (`memopd rce`): random episodes of the rules, each packed call against the call run alone,
    on every backend."""

    dtype: str
    backends: tuple[str, ...]
    episodes: int
    calls: int
    prefix_tokens: int
    observation_tokens: tuple[int, int]  # [low, high] tokens per observation
    response_tokens: tuple[int, int]
    rules: tuple[str, ...] = RULES  # the episodes cycle through these (an empty list: every rule)
    tolerance: float | None = None  # None: the dtype's (memopd.rce.tolerances)

    @classmethod
    def from_dict(cls, d: dict | None, key: str = "rce") -> "RCEConfig":
        d = _required(_known(d, cls, key), cls, key)
        for k in ("observation_tokens", "response_tokens"):
            if not (isinstance(d[k], (list, tuple)) and len(d[k]) == 2):
                raise ConfigError(f"{key}.{k}: a range [low, high], not {d[k]!r}")
        return cls(**{**d, **{k: tuple(d[k]) for k in ("backends", "observation_tokens", "response_tokens")},
                      "rules": tuple(d.get("rules") or RULES)})


@dataclass(frozen=True)
class RCERolloutsConfig:
    """The `rce_rollouts` section: real rollouts of the model under every rule, then the same check on them."""

    benchmark: str
    tasks: int
    max_new_tokens: int
    dtype: str
    backends: tuple[str, ...]
    rules: tuple[str, ...] = RULES  # an empty list: every rule
    tolerance: float | None = None  # None: the dtype's (memopd.rce.tolerances)
    invalid_action: str | None = None  # None: the agent section's
    gpu_memory_utilization: float | None = None  # None: rollout.vllm's; the engine stays up beside the scoring model

    @classmethod
    def from_dict(cls, d: dict | None, key: str = "rce_rollouts") -> "RCERolloutsConfig":
        d = _required(_known(d, cls, key), cls, key)
        return cls(**{**d, "backends": tuple(d["backends"]), "rules": tuple(d.get("rules") or RULES)})


@dataclass(frozen=True)
class JobResources:
    """One step's jobs: the SLURM request (a local run uses `threads`, capped by -c)."""

    threads: int
    mem_mb: int
    runtime: int  # wall-clock limit in minutes
    gpu: int = 0  # GPUs of the job's single task (torchrun inside when > 1)
    gpu_model: str | None = None  # e.g. h100, only used with gpu >= 1


@dataclass(frozen=True)
class ResourcesConfig:
    """The `resources` section: `default`, overlaid per step by `rules.<step>`; the workflow requests what the
    planner sizes."""

    default: dict
    rules: dict = field(default_factory=dict)  # step name -> the keys it changes

    @classmethod
    def from_dict(cls, d: dict | None, key: str = "resources") -> "ResourcesConfig":
        d = _required(_known(d, cls, key), cls, key)
        _known(d["default"], JobResources, f"{key}.default")
        for step, r in (d.get("rules") or {}).items():
            _known(r, JobResources, f"{key}.rules.{step}")
        return cls(dict(d["default"]), dict(d.get("rules") or {}))

    def of(self, step: str) -> JobResources:
        """`default` overlaid by `rules.<step>`."""
        key = f"resources.rules.{step}" if step in self.rules else "resources.default"
        return JobResources(**_required({**self.default, **self.rules.get(step, {})}, JobResources, key))


RETRIEVAL_BACKENDS = ("bm25", "e5")  # retrieval.backend: BM25 (bm25s, CPU) or dense e5 vectors (FAISS)


@dataclass(frozen=True)
class BM25Config:
    """`retrieval.bm25` (memopd.retrieval.bm25), chosen on a tuning sample disjoint from the reported one."""

    k1: float = 1.2
    b: float = 0.75
    method: str = "lucene"
    stemmer: str | None = "english"  # Snowball (PyStemmer); None: no stemming
    stopwords: str | None = "en"
    title_weight: int = 2  # the title is indexed this many times before the text

    @classmethod
    def from_dict(cls, d: dict | None, key: str = "retrieval.bm25") -> "BM25Config":
        return cls(**_known(d, cls, key))


@dataclass(frozen=True)
class DenseConfig:
    """`retrieval.dense` (memopd.retrieval.dense): the e5 encoder, the FAISS index and the resumable build."""

    model: str = "intfloat/e5-base-v2"
    max_length: int = 256
    batch_size: int = 256
    device: str = "auto"
    dtype: str = "auto"
    faiss_factory: str = "Flat"  # exact inner product; else a FAISS index_factory string
    faiss_search: str = ""
    query_prefix: str = "query: "
    passage_prefix: str = "passage: "
    shard_passages: int = 500_000  # passages per resumable build shard (bounds its memory)
    search_block: int = 65_536  # rows per block of the exact numpy search

    @classmethod
    def from_dict(cls, d: dict | None, key: str = "retrieval.dense") -> "DenseConfig":
        return cls(**_known(d, cls, key))


@dataclass(frozen=True)
class RecallConfig:
    """`retrieval.recall`: the recall figures' question sample and the timed searches."""

    sources: tuple = ()  # {format, path} of the questions with evidence
    questions: int | None = 300  # per data set, seeded sample; None: every question
    nq_k: int = 5
    hotpot_k: int = 10
    timing_queries: int = 1000
    timing_k: int = 3

    @classmethod
    def from_dict(cls, d: dict | None, key: str = "retrieval.recall") -> "RecallConfig":
        d = _known(d, cls, key)
        return cls(**{**d, "sources": tuple(d.get("sources") or ())})


@dataclass(frozen=True)
class RetrievalConfig:
    """The `retrieval` section: the corpus, the index of its backend, the recall figures."""

    backend: str = "bm25"
    corpus: tuple = ()  # passage sources, {format, path} or {format, fetch}
    bm25: BM25Config = field(default_factory=BM25Config)
    dense: DenseConfig = field(default_factory=DenseConfig)
    recall: RecallConfig = field(default_factory=RecallConfig)

    def __post_init__(self):
        if self.backend not in RETRIEVAL_BACKENDS:
            raise ConfigError(f"retrieval.backend: unknown backend {self.backend!r} "
                              f"(known: {', '.join(RETRIEVAL_BACKENDS)})")

    @classmethod
    def from_dict(cls, d: dict | None, key: str = "retrieval") -> "RetrievalConfig":
        d = _known(d, cls, key)
        return cls(**{**d, "corpus": tuple(d.get("corpus") or ()), "bm25": BM25Config.from_dict(d.get("bm25")),
                      "dense": DenseConfig.from_dict(d.get("dense")),
                      "recall": RecallConfig.from_dict(d.get("recall"))})


def retrieval_config(cfg: dict) -> RetrievalConfig:
    """The `retrieval` section of a config; a ConfigError names a bad key."""
    return RetrievalConfig.from_dict(section(cfg, "retrieval"))


@dataclass(frozen=True)
class PlanConfig:
    """The `plan` section: the resource plan's machine and the allowances it adds (memopd.plan)."""

    enforce: bool = False  # the workflow refuses a run whose jobs do not fit
    gpu_memory_gb: float = 80
    disk_gb: float = 1000
    process_gb: float = 4.0  # host memory of one worker process
    cuda_context_gb: float = 1.0
    nccl_gb: float = 0.5  # GPU memory of NCCL's own buffers per rank
    vllm_asleep_gb: float = 1.0  # GPU memory a sleeping vLLM engine keeps
    prompt_tokens: int = 512  # allowance for the system prompt and the questions
    observation_overhead: int = 64  # tags and turn hint around an observation
    models: dict = field(default_factory=dict)  # sizes per model name when no config.json is cached
    corpus: dict | None = None  # {passages, text_gb} of the dense index's corpus

    @classmethod
    def from_dict(cls, d: dict | None, key: str = "plan") -> "PlanConfig":
        return cls(**_known(d, cls, key))


def plan_config(cfg: dict) -> PlanConfig:
    """The `plan` section of a config (absent: every default); a ConfigError names a bad key."""
    return PlanConfig.from_dict(cfg.get("plan"))


TEACHER_KINDS = ("scripted", "llm")  # teacher.kind: who plays the SFT trajectories
LLM_ENGINES = ("server", "offline")  # teacher.llm.engine: a vLLM server (the default) or vLLM in the job's process


@dataclass(frozen=True)
class TeacherServerConfig:
    """`teacher.llm.server`: the LLM teacher's vLLM server (teachers.llm.VLLMServer) and its client's limits. The
    offline engine takes dtype, gpu_memory_utilization and max_model_len where the section sets them."""

    port: int = 0  # 0: a free port
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9  # the server is alone on its GPUs
    max_model_len: int | None = None  # None: the model's own limit
    startup_timeout_s: float = 1800
    max_concurrency: int = 64  # requests in flight from the client
    request_timeout_s: float = 600
    extra_args: tuple = ()

    @classmethod
    def from_dict(cls, d: dict | None, key: str = "teacher.llm.server") -> "TeacherServerConfig":
        d = _known(d, cls, key)
        return cls(**{**d, "extra_args": tuple(d.get("extra_args") or ())})


@dataclass(frozen=True)
class TeacherConfig:
    """The `teacher` section: who plays the SFT trajectories, on which tasks, in how many jobs. Its `scripted` and
    `llm` parts are the teachers' own configs (teachers.scripted.ScriptedConfig, teachers.llm.LLMConfig)."""

    kind: str = "scripted"
    benchmarks: tuple = ()  # results/benchmarks/{name}.parquet
    max_tasks: int | None = None  # per benchmark; None: all
    seed: int | None = None  # None: the global seed
    reward: str = "f1"  # the trajectory filter's reward
    batch_size: int | None = None  # None: rollout.batch_size
    shards: int = 1  # jobs, each a contiguous slice of the tasks
    chunk_tasks: int | None = None  # tasks per kept chunk inside a shard; None: the whole shard
    scripted: dict = field(default_factory=dict)
    llm: dict | None = None

    def __post_init__(self):
        if self.kind not in TEACHER_KINDS:
            raise ConfigError(f"teacher.kind must be one of {TEACHER_KINDS}, not {self.kind!r}")

    @classmethod
    def from_dict(cls, d: dict | None, key: str = "teacher") -> "TeacherConfig":
        d = _known(d, cls, key)
        return cls(**{**d, "benchmarks": tuple(d.get("benchmarks") or ()), "scripted": dict(d.get("scripted") or {})})

    @property
    def server(self) -> TeacherServerConfig | None:
        """The vLLM server this step starts (an LLM teacher on the server engine without a url), else None."""
        llm = self.llm or {}
        if self.kind != "llm" or llm.get("engine", LLM_ENGINES[0]) != "server" or llm.get("url"):
            return None
        return TeacherServerConfig.from_dict(llm.get("server"))


def teacher_config(cfg: dict) -> TeacherConfig:
    """The `teacher` section of a config; a ConfigError names a bad key."""
    return TeacherConfig.from_dict(section(cfg, "teacher"))


@dataclass(frozen=True)
class AuditScoring:
    """`audit.dtype`, `clip` and `backends`: how the audit tables score the episodes (each table's job gets these)."""

    dtype: str
    clip: float
    backends: tuple

    @classmethod
    def from_dict(cls, d: dict | None, key: str = "audit") -> "AuditScoring":
        d = _required(_audit_part(d, cls, key), cls, key)
        return cls(**{**d, "backends": tuple(d["backends"])})


@dataclass(frozen=True)
class AuditRollout:
    """The `audit` keys of the audit episodes' rollout: which model plays which tasks, how many, how sampled."""

    model: str
    benchmark: str
    episodes: int
    rule_episodes: int
    rule: str | None = None  # None: agent.rule
    invalid_action: str | None = None  # None: agent.invalid_action
    temperature: float | None = None  # None: rollout.temperature
    max_new_tokens: int | None = None  # None: rollout.max_new_tokens

    @classmethod
    def from_dict(cls, d: dict | None, key: str = "audit") -> "AuditRollout":
        return cls(**_required(_audit_part(d, cls, key), cls, key))

    def sampling(self) -> dict:
        """The rollout's sampling overrides: temperature and max_new_tokens where set."""
        return {k: v for k in ("temperature", "max_new_tokens") if (v := getattr(self, k)) is not None}


AUDIT_KEYS = {f.name for c in (AuditScoring, AuditRollout) for f in fields(c)} | {"teacher", "packing"}


def _audit_part(d: dict | None, cls, key: str) -> dict:
    """The keys of `cls` in `d` (the audit section, or the part a job gets); a key of no part is refused."""
    d = dict(d or {})
    if unknown := set(d) - AUDIT_KEYS:
        raise ConfigError(f"unknown {key} keys {sorted(unknown)}; known: {sorted(AUDIT_KEYS)}")
    return {k: v for k, v in d.items() if k in {f.name for f in fields(cls)}}


@dataclass(frozen=True)
class PackingAudit:
    """`audit.packing`: the packing-efficiency sweep (synthetic episodes) and the real audit episodes' timings."""

    repeats: int
    synthetic: dict  # audit.packing_bench's sweep keys over its defaults
    real: dict  # {calls, episodes}
    backends: tuple | None = None  # None: audit.backends
    activation_checkpointing: bool = False

    @classmethod
    def from_dict(cls, d: dict | None, key: str = "audit.packing") -> "PackingAudit":
        d = _required(_known(d, cls, key), cls, key)
        return cls(**{**d, "backends": None if d.get("backends") is None else tuple(d["backends"])})


# What train.per_method.{method} may set: its seeds, step sizes and regularisers (never what the resource plan
# reads, which stays one value for every method)
PER_METHOD_KEYS = ("seeds", "lr_actor", "lr_critic", "ppo")
PER_METHOD_PPO_KEYS = ("opd_coef", "beta", "entropy_coef", "clip", "max_grad_norm")


def method_section(train: dict, method: str) -> dict:
    """The `train` section as method `method` runs it: train.per_method[method] over the rest (its `ppo` keys over
    train.ppo's, each other key in place of the section's), without per_method; a ConfigError names a bad key."""
    own = (train.get("per_method") or {}).get(method) or {}
    if bad := set(own) - set(PER_METHOD_KEYS):
        raise ConfigError(f"train.per_method.{method}: unknown keys {sorted(bad)}; choose from {list(PER_METHOD_KEYS)}")
    if bad := set(own.get("ppo") or {}) - set(PER_METHOD_PPO_KEYS):
        raise ConfigError(f"train.per_method.{method}.ppo: keys {sorted(bad)} are one value for every method; "
                          f"per method: {list(PER_METHOD_PPO_KEYS)}")
    out = {k: v for k, v in train.items() if k != "per_method"}
    out.update({k: v for k, v in own.items() if k != "ppo"})
    if "ppo" in own:
        out["ppo"] = {**train.get("ppo", {}), **own["ppo"]}
    return out


@dataclass(frozen=True)
class MatchedControlConfig:
    """train.matched_control: the paper's matched control (methods.control_methods) on its own seeds and benchmark."""

    seeds: tuple[int, ...] | None = None  # every control method on these; None: each on its own (TrainRuns.seeds_of)
    benchmark: str = "q2_test"  # its evaluation, results/eval/{model}/{benchmark}.json

    @classmethod
    def from_dict(cls, d: dict | None, key: str = "train.matched_control") -> "MatchedControlConfig":
        d = _known(d, cls, key)
        return cls(**{**d, "seeds": None if d.get("seeds") is None else tuple(d["seeds"])})


@dataclass(frozen=True)
class TrainRuns:
    """The `train` section as the workflow and the report read it: which runs there are (each method on its seeds),
    from which models, on which tasks, evaluated where. A run's own settings are memopd.train.config.RunConfig's,
    from the same section; `per_method` is kept as written (method_section merges it, the report names it)."""

    student: str  # the SFT model every run starts from (results/models/{student})
    teacher: str
    methods: tuple[str, ...]
    seeds: tuple[int, ...]
    benchmark: str  # the training tasks
    horizons: dict  # {benchmark: label}: every run's evaluations (a label of null drops the benchmark)
    steps: int
    batch_tasks: int
    matched_control: MatchedControlConfig = field(default_factory=MatchedControlConfig)
    per_method: dict = field(default_factory=dict)  # {method: its own settings over the section's}

    @classmethod
    def from_section(cls, train: dict, key: str = "train") -> "TrainRuns":
        """The section's workflow keys (RunConfig refuses a key neither reads); a ConfigError names a missing key or a
        bad train.per_method."""
        d = _required({f.name: train[f.name] for f in fields(cls) if f.name in train}, cls, key)
        for m in d.get("per_method") or {}:
            method_section(train, m)
        return cls(**{**d, "methods": tuple(d["methods"]), "seeds": tuple(d["seeds"]),
                      "horizons": {b: h for b, h in d["horizons"].items() if h is not None},
                      "matched_control": MatchedControlConfig.from_dict(d.get("matched_control")),
                      "per_method": dict(d.get("per_method") or {})})

    def seeds_of(self, method: str) -> list[int]:
        """train.per_method.{method}.seeds, else train.seeds."""
        own = self.per_method.get(method) or {}
        return list(own["seeds"] if "seeds" in own else self.seeds)

    def method_seeds(self, methods=None) -> dict[str, list[int]]:
        """{method: its seeds} for `methods` (default train.methods)."""
        return {m: self.seeds_of(m) for m in (self.methods if methods is None else methods)}

    def runs(self) -> list[tuple[str, int]]:
        """(method, seed) of every run of train.methods, each method on its own seeds."""
        return [(m, s) for m, seeds in self.method_seeds().items() for s in seeds]

    def control(self) -> tuple[dict[str, list[int]], str]:
        """({method: seeds}, benchmark) of the matched control: every method on matched_control.seeds when it names
        them, else each on its own."""
        mc, methods = self.matched_control, control_methods(self.methods)
        seeds = {m: list(mc.seeds) for m in methods} if mc.seeds is not None else self.method_seeds(methods)
        return seeds, mc.benchmark


def per_benchmark(value, bench: str):
    """A config value given once or per benchmark file name ({name: value, default: value})."""
    return value.get(bench, value.get("default")) if isinstance(value, dict) else value


@dataclass(frozen=True)
class EvalSettings:
    """The `eval` section's settings for one benchmark. None keeps the training rollout's value (config rollout):
    evaluation runs the protocol the policies were trained with unless the config says otherwise (a response
    budget below training's cuts answers off, and a cut answer counts as an invalid action)."""

    max_tasks: int | None = None  # the first N tasks of the file; None: all
    max_new_tokens: int | None = None
    temperature: float | None = None  # 0: greedy

    def sampling(self) -> dict:
        """The sampling overrides of the evaluation: temperature and max_new_tokens where set."""
        return {k: v for k in ("temperature", "max_new_tokens") if (v := getattr(self, k)) is not None}


@dataclass(frozen=True)
class EvalConfig:
    """The `eval` section: the models and benchmarks evaluated and their settings, each once or per benchmark file
    name ({name: value, default: value})."""

    models: tuple = ()
    benchmarks: tuple = ()
    max_tasks: int | dict | None = None
    max_new_tokens: int | dict | None = None
    temperature: float | dict | None = None

    @classmethod
    def from_dict(cls, d: dict | None, key: str = "eval") -> "EvalConfig":
        d = _known(d, cls, key)
        return cls(**{**d, "models": tuple(d.get("models") or ()), "benchmarks": tuple(d.get("benchmarks") or ())})

    def at(self, bench: str) -> EvalSettings:
        return EvalSettings(*(per_benchmark(getattr(self, f.name), bench) for f in fields(EvalSettings)))


def eval_config(cfg: dict) -> EvalConfig:
    """The `eval` section of a config; a ConfigError names a bad key."""
    return EvalConfig.from_dict(section(cfg, "eval"))


def eval_job_config(cfg: dict, bench: str, **agent) -> dict:
    """What one evaluation on `bench` reads (rule eval's --cfg): agent (with `agent` replacing keys, e.g. the
    view), rollout, and eval's settings for this benchmark only, so that adding a benchmark or a model does not
    change the settings of the evaluations already done."""
    ev = {k: per_benchmark(v, bench) for k, v in cfg["eval"].items() if k not in ("models", "benchmarks")}
    return {"agent": {**cfg["agent"], **agent}, "rollout": cfg["rollout"], "eval": ev}


@dataclass(frozen=True)
class ClaimsConfig:
    """The `claims` section (memopd.study.claims), declared before the run: the primaries, Holm-adjusted together,
    and the test tasks of the trained (`short`) and the long horizon of the growth claims."""

    primary: tuple[str, ...]
    short: str
    long: str

    @classmethod
    def from_dict(cls, d: dict | None, key: str = "claims") -> "ClaimsConfig":
        d = _required(_known(d, cls, key), cls, key)
        return cls(tuple(d["primary"]), d["short"], d["long"])
