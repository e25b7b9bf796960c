"""Data: the committed samples in data/ (embedded default) or full data sets by name (paper scale)."""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Iterator


def _jsonl(path: Path) -> Iterator[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def corpus_texts(data_dir: str | Path) -> Iterator[str]:
    """Every piece of text in the committed samples (passages, questions, answers): tokenizer corpus."""
    d = Path(data_dir)
    files = {"wiki": d / "wiki/wiki18_sample.jsonl", "nq": d / "nq/nq-open-oracle.jsonl.gz"}
    for key, path in files.items():
        if not path.exists():
            raise FileNotFoundError(f"{path} not found (data_dir={data_dir!s}, file {key})")
    for rec in _jsonl(files["wiki"]):
        yield rec["contents"]
    for rec in _jsonl(files["nq"]):
        yield rec["question"] + " " + " ".join(rec["answers"])
        for c in rec.get("ctxs", []):
            yield c["title"] + "\n" + c["text"]
    for path in sorted((d / "hotpotqa").glob("distractor_dev_sample_*.jsonl")):
        for rec in _jsonl(path):
            yield rec["question"] + " " + rec["answer"]
            for title, sents in zip(rec["context"]["title"], rec["context"]["sentences"]):
                yield title + "\n" + "".join(sents)
