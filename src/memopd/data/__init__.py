"""Data: the committed samples in data/ (embedded default) or full data sets by name (paper scale).

- loaders.py  HotpotQA (HF schema and official layout), NQ-open, NQ oracle, wiki-18; typed errors
- hub.py      the same formats loaded by name through `datasets` (paper scale)
- compose.py  Q_n and Wiki-RAG task composition, train/test pools, parquet + stats output
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

from memopd.data.loaders import (QA, DataConfigError, DataFormatError, MissingDataError, Passage,
                                 iter_passages, load_qa, resolve)

__all__ = ["QA", "Passage", "DataConfigError", "DataFormatError", "MissingDataError", "load_qa",
           "iter_passages", "corpus_texts"]

# The committed files the tokenizer corpus reads (relative to data_dir).
_WIKI = "wiki/wiki18_sample.jsonl"
_NQ_ORACLE = "nq/nq-open-oracle.jsonl.gz"
_HOTPOT_GLOB = "hotpotqa/distractor_dev_sample_*.jsonl"


def corpus_texts(data_dir: str | Path, files: Sequence[dict] | None = None) -> Iterator[str]:
    """Every piece of text in the committed samples (passages, questions, answers): tokenizer corpus.
    `files` ({format, path} under data_dir, config `tokenizer.files`) replaces the committed samples."""
    d = Path(data_dir)
    if files is not None:
        yield from _listed_texts(d, files)
        return
    for key, rel in (("wiki", _WIKI), ("nq", _NQ_ORACLE)):
        if not (d / rel).exists():
            raise MissingDataError(d / rel, f"data_dir ({key} file)")
    for p in iter_passages(d / _WIKI, "wiki18"):
        yield p.title + "\n" + p.text
    for qa in load_qa(d / _NQ_ORACLE, "nq_oracle"):
        yield qa.question + " " + " ".join(qa.answers)
        for title, text in qa.passages:
            yield title + "\n" + text
    for path in sorted(d.glob(_HOTPOT_GLOB)):
        for qa in load_qa(path, "hotpotqa_hf"):
            yield qa.question + " " + qa.answers[0]
            for title, text in qa.passages:
                yield title + "\n" + text


def _listed_texts(d: Path, files: Sequence[dict]) -> Iterator[str]:
    for i, f in enumerate(files):
        key = f"tokenizer.files[{i}]"
        path = resolve(f["path"], d, f"{key}.path")
        if f["format"] == "wiki18":
            for p in iter_passages(path, "wiki18", f"{key}.format"):
                yield p.title + "\n" + p.text
            continue
        for qa in load_qa(path, f["format"], f"{key}.format"):
            yield qa.question + " " + " ".join(qa.answers)
            for title, text in qa.passages:
                yield title + "\n" + text
