"""Loaders for the QA data sets and the wiki-18 passages, with errors that name file, record and field.

Every question source becomes a list of `QA` records; every passage source a stream of `Passage`s.
Formats (the `format` key of a source in the config):

- `hotpotqa_hf`       HotpotQA in the Hugging Face `hotpot_qa` schema (one JSON object per line, or rows
                      of the hub data set): id, question, answer, supporting_facts{title, sent_id},
                      context{title, sentences}.
- `hotpotqa_official` HotpotQA in the official JSON layout (one JSON array): _id, question, answer,
                      supporting_facts [[title, sent_id]], context [[title, [sentences]]].
- `nq_open`           NQ-open (JSON lines or hub rows): question, answer [aliases].
- `nq_oracle`         NQ-open questions with their gold passage (lost-in-the-middle oracle file):
                      question, answers [aliases], ctxs [{title, text, ...}].
- `wiki18`            DPR wiki-18 passages in the FlashRAG / Search-R1 form: id, contents = '"Title"\\ntext'.

The paper-scale path (data sets by name through `datasets`) reuses the same row parsers (see hub.py).
"""
from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

PASSAGE_FORMATS = ("wiki18", "hotpotqa_hf", "hotpotqa_official", "nq_oracle")


class DataFormatError(ValueError):
    """A record that does not have the expected shape: names the file, the line or record, the field."""

    def __init__(self, where: str, field_name: str, problem: str):
        super().__init__(f"{where}: field '{field_name}': {problem}")
        self.where, self.field, self.problem = where, field_name, problem


class DataConfigError(ValueError):
    """A configuration that cannot work (unknown source, n larger than the pool, missing file, ...).
    Raised before any output is written."""


class MissingDataError(DataConfigError, FileNotFoundError):
    """A configured data file that does not exist: names the path and the config key."""

    def __init__(self, path: Path, key: str):
        super().__init__(f"{key}: data file {path} not found")
        self.path, self.key = path, key


@dataclass(frozen=True)
class QA:
    """One question with every accepted answer (aliases; the first is the canonical one)."""

    qid: str
    question: str
    answers: tuple[str, ...]
    source: str                                   # data set: "hotpotqa" or "nq"
    evidence_titles: tuple[str, ...] = ()         # HotpotQA supporting articles; NQ gold passage title
    passages: tuple[tuple[str, str], ...] = field(default=(), repr=False)  # (title, text) in the record


@dataclass(frozen=True)
class Passage:
    """One retrievable passage. `key` is stable across rebuilds (upstream id, or a content hash)."""

    key: str
    title: str
    text: str
    source: str


def content_hash(*parts: str, length: int = 16) -> str:
    """Stable short id of a text: the same content gives the same id in every build."""
    h = hashlib.sha1("\x1f".join(" ".join(p.split()) for p in parts).encode("utf-8"))
    return h.hexdigest()[:length]


# ---------------------------------------------------------------------------------------------- reading

def resolve(path: str | Path, data_dir: str | Path, key: str) -> Path:
    """A configured path: absolute, or relative to data_dir. Missing -> MissingDataError(path, key)."""
    p = Path(path)
    if not p.is_absolute():
        p = Path(data_dir) / p
    if not p.is_file():
        raise MissingDataError(p, key)
    return p


def iter_json_records(path: Path) -> Iterator[tuple[str, dict]]:
    """(where, record) for a JSON-lines file (optionally gzipped) or a JSON array file.
    `where` is 'file:line' or 'file[record i]' for error messages."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        first = f.read(1)
        while first and first.isspace():
            first = f.read(1)
        f.seek(0)
        if first == "[":  # one JSON array (the official HotpotQA layout)
            try:
                records = json.load(f)
            except json.JSONDecodeError as e:
                raise DataFormatError(f"{path}:{e.lineno}", "<json>", f"invalid JSON ({e.msg})") from None
            for i, rec in enumerate(records):
                where = f"{path}[record {i}]"
                if not isinstance(rec, dict):
                    raise DataFormatError(where, "<record>", f"expected an object, got {type(rec).__name__}")
                yield where, rec
            return
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataFormatError(where, "<json>", f"invalid JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise DataFormatError(where, "<record>", f"expected an object, got {type(rec).__name__}")
            yield where, rec


def _get(rec: dict, name: str, kind: type | tuple, where: str):
    if name not in rec:
        raise DataFormatError(where, name, "missing")
    v = rec[name]
    if not isinstance(v, kind):
        want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise DataFormatError(where, name, f"expected {want}, got {type(v).__name__}")
    return v


def _text(rec: dict, name: str, where: str) -> str:
    v = _get(rec, name, str, where)
    if not v.strip():
        raise DataFormatError(where, name, "empty")
    return v


def _str_list(rec: dict, name: str, where: str, nonempty: bool = True) -> list[str]:
    v = _get(rec, name, list, where)
    if nonempty and not v:
        raise DataFormatError(where, name, "empty list")
    for i, x in enumerate(v):
        if not isinstance(x, str) or not x.strip():
            raise DataFormatError(where, f"{name}[{i}]", "expected a non-empty string")
    return v


def _unique(xs) -> tuple:
    return tuple(dict.fromkeys(xs))


# ------------------------------------------------------------------------------------------ row parsers

def parse_hotpotqa_hf(rec: dict, where: str) -> QA:
    qid = _get(rec, "id", (str, int), where)
    sf = _get(rec, "supporting_facts", dict, where)
    ctx = _get(rec, "context", dict, where)
    titles = _str_list(sf, "title", f"{where} supporting_facts")
    ctx_titles = _get(ctx, "title", list, f"{where} context")
    sentences = _get(ctx, "sentences", list, f"{where} context")
    if len(ctx_titles) != len(sentences):
        raise DataFormatError(where, "context", f"{len(ctx_titles)} titles but {len(sentences)} sentence lists")
    return QA(f"hotpotqa:{qid}", _text(rec, "question", where), (_text(rec, "answer", where),), "hotpotqa",
              _unique(titles), _paragraphs(zip(ctx_titles, sentences), where))


def parse_hotpotqa_official(rec: dict, where: str) -> QA:
    qid = _get(rec, "_id", (str, int), where)
    sf = _get(rec, "supporting_facts", list, where)
    titles = []
    for i, fact in enumerate(sf):
        if not (isinstance(fact, list) and len(fact) == 2 and isinstance(fact[0], str)):
            raise DataFormatError(where, f"supporting_facts[{i}]", "expected [title, sent_id]")
        titles.append(fact[0])
    ctx = _get(rec, "context", list, where)
    pairs = []
    for i, item in enumerate(ctx):
        if not (isinstance(item, list) and len(item) == 2):
            raise DataFormatError(where, f"context[{i}]", "expected [title, [sentences]]")
        pairs.append((item[0], item[1]))
    return QA(f"hotpotqa:{qid}", _text(rec, "question", where), (_text(rec, "answer", where),), "hotpotqa",
              _unique(titles), _paragraphs(pairs, where))


def _paragraphs(pairs, where: str) -> tuple[tuple[str, str], ...]:
    out = []
    for i, (title, sents) in enumerate(pairs):
        if not isinstance(title, str) or not isinstance(sents, list) or not all(isinstance(s, str) for s in sents):
            raise DataFormatError(where, f"context[{i}]", "expected a title and a list of sentence strings")
        text = "".join(sents).strip()  # HotpotQA sentences carry their own leading spaces
        if text:
            out.append((title, text))
    return tuple(out)


def parse_nq_open(rec: dict, where: str) -> QA:
    q = _text(rec, "question", where)
    return QA(f"nq:{content_hash(q, length=12)}", q, tuple(_str_list(rec, "answer", where)), "nq")


def parse_nq_oracle(rec: dict, where: str) -> QA:
    q = _text(rec, "question", where)
    answers = _str_list(rec, "answers", where)
    ctxs = _get(rec, "ctxs", list, where)
    passages, gold = [], []
    for i, c in enumerate(ctxs):
        if not isinstance(c, dict):
            raise DataFormatError(where, f"ctxs[{i}]", "expected an object")
        title = _get(c, "title", str, f"{where} ctxs[{i}]")
        passages.append((title, _text(c, "text", f"{where} ctxs[{i}]")))
        if c.get("isgold", True):
            gold.append(title)
    # the id hashes the question alone, so NQ-open and the oracle file give one question one id
    return QA(f"nq:{content_hash(q, length=12)}", q, tuple(answers), "nq", _unique(gold), tuple(passages))


def parse_wiki18(rec: dict, where: str) -> Passage:
    pid = _get(rec, "id", (str, int), where)
    contents = _text(rec, "contents", where)
    if "\n" not in contents:
        raise DataFormatError(where, "contents", 'expected "Title"\\ntext (no newline)')
    title, text = contents.split("\n", 1)
    title = title.strip()
    if len(title) >= 2 and title[0] == title[-1] == '"':  # FlashRAG quotes the title
        title = title[1:-1]
    return Passage(f"wiki18:{pid}", title, text.strip(), "wiki18")


QA_PARSERS: dict[str, Callable[[dict, str], QA]] = {
    "hotpotqa_hf": parse_hotpotqa_hf,
    "hotpotqa_official": parse_hotpotqa_official,
    "nq_open": parse_nq_open,
    "nq_oracle": parse_nq_oracle,
}


# ------------------------------------------------------------------------------------------- file level

def _checked(path: str | Path, fmt: str, known, what: str, key: str) -> Path:
    """`path` as a Path, once `fmt` is one of `known` and the file exists; else an error naming `key`."""
    if fmt not in known:
        raise DataConfigError(f"{key}: unknown {what} format {fmt!r} (known: {', '.join(known)})")
    path = Path(path)
    if not path.is_file():
        raise MissingDataError(path, key)
    return path


def load_qa(path: str | Path, fmt: str, key: str = "path") -> list[QA]:
    """Every question of one file in format `fmt`."""
    path = _checked(path, fmt, QA_PARSERS, "question", key)
    parse = QA_PARSERS[fmt]
    return [parse(rec, where) for where, rec in iter_json_records(path)]


def iter_passages(path: str | Path, fmt: str, key: str = "path") -> Iterator[Passage]:
    """The passages of one file: wiki-18 passages, HotpotQA context paragraphs, NQ oracle passages."""
    for where, rec in iter_json_records(_checked(path, fmt, PASSAGE_FORMATS, "passage", key)):
        if fmt == "wiki18":
            yield parse_wiki18(rec, where)
            continue
        qa = QA_PARSERS[fmt](rec, where)
        for title, text in qa.passages:  # id = content only, so one paragraph has one id whatever file holds it
            yield Passage(f"psg:{content_hash(title, text)}", title, text, qa.source)
