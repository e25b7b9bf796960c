"""One vocabulary for student and teacher: OPD compares their distributions id by id (`losses.reverse_kl`),
so id v must be the same token for both. Two models of one tokenizer may still have heads of different
sizes (Qwen2.5-3B pads to 151,936 rows, Qwen2.5-7B to 152,064, for the same 151,665 ids): that is what
`losses.shared_vocab` handles. Two different tokenizers cannot be handled: they are refused.

Checked twice:
  * when the workflow is parsed (`check_model_specs`, from config `models`, offline and cheap: the
    tokenizer.json of a local directory or of the local Hugging Face cache, no transformers import). A
    tokenizer not available offline then (a hub name never downloaded, a model this pipeline builds) is
    left to the train step;
  * by every training run that scores a teacher (`check_model_dirs`), before it loads any model.

The Snakefile imports this module at parse time: only json, pathlib and memopd.config at module level.
"""
from __future__ import annotations

import json
from pathlib import Path

from memopd.config import PretrainedModelConfig, model_config

# Tiny models (embedded default, no `pretrained`) use the tokenizer trained by the workflow (rule tokenizer).
TRAINED_TOKENIZER = "results/models/tokenizer"


class TokenizerMismatch(ValueError):
    """Student and teacher tokenizers map some id to different tokens."""


def tokenizer_source(spec: dict) -> str:
    """Where a config model spec's tokenizer comes from: a pretrained model's own (or its `tokenizer`
    entry), for a tiny model the one trained here."""
    m = model_config(spec)
    if not isinstance(m, PretrainedModelConfig):
        return TRAINED_TOKENIZER
    return str(Path(m.tokenizer or m.pretrained))


def tokenizer_file(source: str | Path) -> Path | None:
    """tokenizer.json of a local directory, or of a hub name in the local Hugging Face cache (never the
    network); None when it is not available offline."""
    local = Path(source)
    if local.is_dir():
        return local / "tokenizer.json" if (local / "tokenizer.json").is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        hit = try_to_load_from_cache(str(source), "tokenizer.json")
    except ValueError:  # not a valid repo id either (e.g. a local path that does not exist yet)
        return None
    return Path(hit) if isinstance(hit, str) else None


def vocabulary(path: str | Path) -> dict[str, int]:
    """token -> id of a tokenizer.json, added (special) tokens included: what every id means."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    # BPE / WordPiece / WordLevel store {token: id}; Unigram a list of [token, score] in id order
    out = dict(vocab) if isinstance(vocab, dict) else {tok: i for i, (tok, _) in enumerate(vocab)}
    out.update({t["content"]: t["id"] for t in data.get("added_tokens", [])})
    return out


def differences(student: dict[str, int], teacher: dict[str, int], show: int = 3) -> list[str]:
    """What differs between two vocabularies, for the error message; empty when every id means the same
    token in both."""
    if student == teacher:
        return []
    out = [f"student {len(student)} tokens, teacher {len(teacher)}"] if len(student) != len(teacher) else []
    s_tok, t_tok = ({i: t for t, i in v.items()} for v in (student, teacher))
    ids = sorted(i for i in s_tok.keys() | t_tok.keys() if s_tok.get(i) != t_tok.get(i))
    out += [f"id {i}: {s_tok.get(i)!r} vs {t_tok.get(i)!r}" for i in ids[:show]]
    if len(ids) > show:
        out.append(f"{len(ids)} ids differ")
    return out


def _refuse(student: str, teacher: str, diffs: list[str]) -> None:
    if diffs:
        raise TokenizerMismatch(
            f"student ({student}) and teacher ({teacher}) tokenizers differ: {'; '.join(diffs)}. OPD compares "
            "the two distributions id by id, so the student and the teacher must share one tokenizer")


def check_files(student: Path, teacher: Path, names: tuple[str, str]) -> None:
    """Raise TokenizerMismatch when two tokenizer.json files give any id different tokens."""
    if student.read_bytes() == teacher.read_bytes():  # the usual case, without parsing
        return
    _refuse(*names, differences(vocabulary(student), vocabulary(teacher)))


def check_model_specs(models: dict) -> str | None:
    """Parse-time check of config `models` (student vs teacher). Raises TokenizerMismatch when both
    tokenizers are available offline and differ; returns None when the pair is checked (or has one
    source), else why the check is left to the train step."""
    sources = tokenizer_source(models["student"]), tokenizer_source(models["teacher"])
    if sources[0] == sources[1]:
        return None
    files = [tokenizer_file(s) for s in sources]
    missing = [s for s, f in zip(sources, files) if f is None]
    if missing:
        return f"tokenizer of {', '.join(missing)} not available offline: the train step checks it"
    check_files(files[0], files[1], sources)
    return None


def check_model_dirs(student_dir: str | Path, teacher_dir: str | Path) -> None:
    """Train-time check of two model directories (as saved by this pipeline: tokenizer beside the weights)."""
    files = [Path(d) / "tokenizer.json" for d in (student_dir, teacher_dir)]
    names = (str(student_dir), str(teacher_dir))
    if all(f.is_file() for f in files):
        check_files(files[0], files[1], names)
        return
    from memopd.models import load_tokenizer  # a tokenizer without tokenizer.json (slow tokenizers)

    _refuse(*names, differences(*(load_tokenizer(d).get_vocab() for d in (student_dir, teacher_dir))))
