"""Models and tokenizers: an offline byte-level BPE tokenizer, tiny Qwen-architecture models built
from config (embedded default), and loading of real Hugging Face checkpoints (paper scale).

Checkpoints are read and written as safetensors only.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch

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


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path, min_frequency: int = 2):
    """Train a byte-level BPE on `texts` (offline) and save it with `save_pretrained`."""
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


def tiny_config(arch: dict, tokenizer):
    """A Qwen2 (the Qwen2.5 architecture) config from a small dict of sizes."""
    from transformers import Qwen2Config

    required = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"]
    missing = [k for k in required if k not in arch]
    if missing:
        raise ValueError(f"tiny model config lacks {missing}")
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=arch["hidden_size"],
        intermediate_size=arch["intermediate_size"],
        num_hidden_layers=arch["num_hidden_layers"],
        num_attention_heads=arch["num_attention_heads"],
        num_key_value_heads=arch["num_key_value_heads"],
        max_position_embeddings=arch.get("max_position_embeddings", 4096),
        rope_theta=arch.get("rope_theta", 10000.0),
        tie_word_embeddings=arch.get("tie_word_embeddings", False),
        use_sliding_window=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )


def build_tiny_model(arch: dict, tokenizer, seed: int):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_config(arch, tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def init_model(spec: dict, out_dir: str | Path, seed: int, tokenizer_path: str | Path | None = None,
               offline: bool = True) -> dict:
    """Create a model directory (weights + tokenizer + provenance) from a model spec:
    either {"pretrained": NAME_OR_PATH} (paper scale) or a tiny architecture dict (embedded default)."""
    out_dir = Path(out_dir)
    if "pretrained" in spec:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(spec["pretrained"], dtype=DTYPES[spec.get("dtype", "bfloat16")],
                                                     local_files_only=offline, use_safetensors=True)
        tokenizer = load_tokenizer(spec.get("tokenizer", spec["pretrained"]), offline=offline)
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


def load_model(path: str | Path, dtype: str = "float32", device: str = "cpu", offline: bool = True,
               attn_implementation: str = "sdpa"):
    """Load a causal LM from a directory or hub name (safetensors only)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=DTYPES[dtype], local_files_only=offline, use_safetensors=True,
        attn_implementation=attn_implementation,
    )
    return model.to(device).eval()
