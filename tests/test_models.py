"""Offline tokenizer and tiny models: real training of a small BPE, safetensors round trip."""
import json

import pytest
import torch

from memopd.data import corpus_texts
from memopd.models import PROTOCOL_TOKENS, build_tiny_model, init_model, load_model, load_tokenizer, train_tokenizer

ARCH = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 512}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from itertools import islice

    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(islice(corpus_texts("data"), 2000), vocab_size=600, out_dir=out)
    return out


def test_tokenizer_has_protocol_tokens_and_chat_template(tok_dir):
    tok = load_tokenizer(tok_dir)
    for tag in PROTOCOL_TOKENS:
        assert len(tok(tag, add_special_tokens=False)["input_ids"]) == 1, tag
    text = tok.apply_chat_template([{"role": "user", "content": "who wrote Hamlet?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nwho wrote Hamlet?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok("<think>Shakespeare</think><answer>William Shakespeare</answer>")["input_ids"]
    assert tok.decode(ids) == "<think>Shakespeare</think><answer>William Shakespeare</answer>"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_tiny_model_is_seeded_and_round_trips_through_safetensors(tok_dir, tmp_path):
    info = init_model(ARCH, tmp_path / "m", seed=3, tokenizer_path=tok_dir)
    assert (tmp_path / "m" / "model.safetensors").exists()
    assert not list((tmp_path / "m").glob("*.bin"))
    assert json.loads((tmp_path / "m" / "memopd_model.json").read_text())["params"] == info["params"]
    tok = load_tokenizer(tok_dir)
    again = build_tiny_model(ARCH, tok, seed=3)
    loaded = load_model(tmp_path / "m")
    assert loaded.config.model_type == "qwen2" and loaded.config.vocab_size == len(tok)
    ids = torch.tensor([tok("a question about Paris")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, again.eval()(ids).logits, rtol=0, atol=0)
    assert not torch.equal(build_tiny_model(ARCH, tok, seed=4).model.embed_tokens.weight, again.model.embed_tokens.weight)


def test_tiny_model_config_errors_name_the_missing_key(tok_dir):
    with pytest.raises(ValueError, match="hidden_size"):
        build_tiny_model({k: v for k, v in ARCH.items() if k != "hidden_size"}, load_tokenizer(tok_dir), seed=0)


def test_missing_data_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="wiki18_sample"):
        next(corpus_texts(tmp_path))
