"""Student and teacher must share one tokenizer (OPD compares them id by id): refused at parse time when
both tokenizers are available offline, else by the train step before any model loads."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from memopd.vocab import TokenizerMismatch, check_model_dirs, check_model_specs, tokenizer_source

ROOT = Path(__file__).resolve().parents[1]


def write_tokenizer(d: Path, vocab: dict[str, int], added: dict[str, int] | None = None) -> Path:
    """A minimal tokenizer.json (what the checks read): BPE vocabulary + added special tokens."""
    d.mkdir(parents=True, exist_ok=True)
    spec = {"model": {"type": "BPE", "vocab": vocab, "merges": []},
            "added_tokens": [{"id": i, "content": t, "special": True} for t, i in (added or {}).items()]}
    (d / "tokenizer.json").write_text(json.dumps(spec))
    return d


VOCAB = {"a": 0, "b": 1, "ab": 2, "c": 3}
SPECIAL = {"<|im_end|>": 4}


def test_the_same_tokenizer_passes_and_a_different_one_is_refused_naming_the_ids(tmp_path):
    a = write_tokenizer(tmp_path / "a", VOCAB, SPECIAL)
    same = write_tokenizer(tmp_path / "same", dict(reversed(VOCAB.items())), SPECIAL)  # other bytes, same ids
    swapped = write_tokenizer(tmp_path / "swapped", {**VOCAB, "ab": 3, "c": 2}, SPECIAL)
    assert check_model_specs({"student": {"pretrained": str(a)}, "teacher": {"pretrained": str(same)}}) is None
    check_model_dirs(a, same)
    with pytest.raises(TokenizerMismatch, match=r"tokenizers differ: id 2: 'ab' vs 'c'"):
        check_model_specs({"student": {"pretrained": str(a)}, "teacher": {"pretrained": str(swapped)}})
    with pytest.raises(TokenizerMismatch, match="student 5 tokens, teacher 6"):
        check_model_dirs(a, write_tokenizer(tmp_path / "more", VOCAB, {**SPECIAL, "<extra>": 5}))
    # a `tokenizer` entry is the model's tokenizer
    spec = {"pretrained": str(tmp_path / "weights_only"), "tokenizer": str(swapped)}
    with pytest.raises(TokenizerMismatch):
        check_model_specs({"student": {"pretrained": str(a)}, "teacher": spec})


def test_what_cannot_be_checked_offline_is_left_to_the_train_step(tmp_path):
    tiny = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 1,
            "num_key_value_heads": 1}
    assert tokenizer_source(tiny) == "results/models/tokenizer"
    assert check_model_specs({"student": tiny, "teacher": tiny}) is None  # one trained tokenizer
    built = {"pretrained": "results/models/base"}
    assert check_model_specs({"student": built, "teacher": {"pretrained": "results/models/base/"}}) is None
    # hub names never downloaded (not in the HF cache): deferred to the train step, not refused, no network
    never = {"student": {"pretrained": "nobody/model-a"}, "teacher": {"pretrained": "nobody/model-b"}}
    assert "train step" in check_model_specs(never)


def test_the_workflow_refuses_different_tokenizers_before_any_job(tmp_path):
    """`snakemake -n` (parse time) stops with the reason (failed before: the dry run planned the jobs)."""
    cfg = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    cfg["models"]["student"] = {"pretrained": str(write_tokenizer(tmp_path / "s", VOCAB, SPECIAL))}
    cfg["models"]["teacher"] = {"pretrained": str(write_tokenizer(tmp_path / "t", {**VOCAB, "ab": 3, "c": 2}))}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    res = subprocess.run([str(Path(sys.executable).parent / "snakemake"), "-n", "--configfile", str(path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    assert "tokenizers differ" in res.stdout + res.stderr and "id 2" in res.stdout + res.stderr
