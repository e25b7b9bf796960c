"""Model sizes: the shapes memory depends on (Spec), from a Hugging Face config.json, the config's plan.models
table or a tiny model's sizes; the units (GB, bytes per dtype). The plan section itself: memopd.config.PlanConfig."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from memopd.config import PretrainedModelConfig
from memopd.plan.inputs import PlanInputs

GB = 1e9
BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "auto": 2}


# ---------------------------------------------------------------------------------------------- model specs
@dataclass
class Spec:
    """The sizes of a model that memory depends on."""
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    params: int = 0
    head_dim: int = 0
    tied: bool = False
    weights_gb: float | None = None  # stored size when not params x dtype (quantised: gpt-oss MXFP4)
    max_positions: int | None = None  # config.json's max_position_embeddings: an engine's longest sequence by default

    def __post_init__(self):
        self.head_dim = self.head_dim or self.hidden // self.heads
        self.params = self.params or qwen2_params(self)

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers (embeddings, final norm, untied head): FSDP's root unit."""
        return self.params - self.layers * (self.layer_params + self.heads * self.head_dim + 2 * self.kv + 2 * self.hidden)

    @property
    def layer_params(self) -> int:  # matmul weights of one decoder layer (what autocast casts)
        return 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv + 3 * self.hidden * self.intermediate

    def weights(self, dtype: str) -> float:
        return self.weights_gb * GB if self.weights_gb else self.params * BYTES[dtype]


def qwen2_params(m: Spec) -> int:
    """Qwen2 / Llama parameter count: embeddings, per layer q/k/v (+ biases), o, SwiGLU, two RMSNorms, the final
    norm and an untied head (Qwen2.5-3B: 3,085,938,688; -7B: 7,615,616,512)."""
    q = m.heads * m.head_dim
    layer = m.layer_params + q + 2 * m.kv + 2 * m.hidden
    return m.vocab * m.hidden * (1 if m.tied else 2) + m.layers * layer + m.hidden


def spec_from_config(name: str, c: dict) -> Spec:
    """From a Hugging Face config.json (or a plan.models entry with the same keys)."""
    s = Spec(name, c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
             c.get("num_key_value_heads") or c["num_attention_heads"], c["intermediate_size"], c["vocab_size"],
             params=c.get("params", 0), head_dim=c.get("head_dim") or 0, tied=bool(c.get("tie_word_embeddings")),
             weights_gb=c.get("weights_gb"), max_positions=c.get("max_position_embeddings"))
    if c.get("model_type") == "bert" and not c.get("params"):  # e5: embeddings (+ positions, types), 12 layers, pooler
        h, i = s.hidden, s.intermediate
        s.params = (s.vocab + c.get("max_position_embeddings", 512) + c.get("type_vocab_size", 2) + 2) * h \
            + s.layers * (4 * h * h + 2 * h * i + i + 9 * h) + h * h + h
    return s


def cached_config(name: str) -> dict | None:
    """config.json of a local model directory or of a hub name already in the Hugging Face cache (offline)."""
    p = Path(name) / "config.json"
    if p.is_file():
        return json.loads(p.read_text())
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(name, "config.json")
        return json.loads(Path(hit).read_text()) if isinstance(hit, str) else None
    except (ImportError, ValueError, OSError):  # no hub library, not a repo id: the table must have it
        return None


def resolve(name: str, p: PlanInputs) -> Spec:
    """A model by hub name or directory: its cached config.json, completed by plan.models[name] (params, or the
    stored size of a quantised model, which config.json lacks); plan.models alone when nothing is cached."""
    table = p.plan.models.get(name)
    found = cached_config(name)
    if found is None and table is None:
        raise ValueError(f"no config.json for model {name!r} offline: add its sizes to config plan.models")
    return spec_from_config(name, {**(table or {}), **(found or {})})


def role_spec(p: PlanInputs, role: str) -> Spec:
    """The student or teacher (config models.<role>): pretrained by name/path, or a tiny model from its sizes."""
    m = p.models[role]
    if isinstance(m, PretrainedModelConfig):
        return resolve(m.pretrained, p)
    return spec_from_config(role, {**asdict(m), "vocab_size": p.tokenizer.vocab_size})


def model_role(name: str) -> str:
    """results/models/{name}: teacher_* are the teacher; student_* and trained runs ({method}_seed{s}) the student."""
    return "teacher" if name.startswith("teacher") else "student"


def load_config(paths: list[str]) -> dict:
    """YAML config files merged in order, as Snakemake merges --configfile (later keys win, dicts deep), and
    validated against the workflow's schema: a bad file or key is a UsageError naming it (memopd.schema)."""
    from memopd.schema import merge_files, validate

    cfg = merge_files(paths)
    validate(cfg)
    return cfg
