"""The retrieval corpus: passages from the configured files, de-duplicated, with stable ids, as parquet.

Embedded default: the wiki-18 sample + every HotpotQA context paragraph + every NQ oracle passage.
Paper scale: the full wiki-18 file (streamed; ~21M passages).

Ids are stable across rebuilds and independent of file order: a wiki-18 passage keeps its upstream id
(`wiki18:<id>`), any other passage is named by a hash of its title and text (`psg:<hash>`). Duplicates
(same title and text up to whitespace) are kept once; wiki-18 files are read first, so a paragraph that
is also a wiki-18 passage keeps the wiki-18 id (the `source` column names the first file that had it).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from memopd.atomic import atomic_path
from memopd.data.loaders import DataConfigError, Passage, content_hash, iter_passages, resolve

COLUMNS = ("id", "title", "text", "source")


def iter_corpus(entries: list[dict], data_dir: str | Path, key: str = "retrieval.corpus") -> Iterator[Passage]:
    """Every configured passage, duplicates removed, in config order."""
    if not entries:
        raise DataConfigError(f"{key}: no passage source configured")
    # resolve every path before reading any: a missing file is reported before work starts
    paths = [resolve(e["path"], data_dir, f"{key}[{i}].path") for i, e in enumerate(entries)]
    order = sorted(range(len(entries)), key=lambda i: entries[i]["format"] != "wiki18")  # wiki-18 first
    seen_content, seen_id = set(), set()
    for i in order:
        e, path = entries[i], paths[i]
        for p in iter_passages(path, e["format"], f"{key}[{i}].format"):
            h = content_hash(p.title, p.text)
            if h in seen_content:
                continue
            if p.key in seen_id:  # two different passages claiming one upstream id
                raise DataConfigError(f"{key}[{i}]: passage id {p.key} appears twice with different text ({path})")
            seen_content.add(h)
            seen_id.add(p.key)
            yield p


def build_corpus(entries: list[dict], data_dir: str | Path, out: str | Path, record: dict | None = None,
                 chunk: int = 100_000) -> dict:
    """Write the corpus parquet (columns id, title, text, source) atomically; returns its stats."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    schema = pa.schema([(c, pa.string()) for c in COLUMNS],
                       metadata={b"memopd": json.dumps(record or {}, sort_keys=True).encode()})
    counts: dict[str, int] = {}
    with atomic_path(out) as tmp, pq.ParquetWriter(tmp, schema) as w:
        buf = []
        for p in tqdm(iter_corpus(entries, data_dir), desc="corpus", unit="psg", mininterval=2):
            buf.append({"id": p.key, "title": p.title, "text": p.text, "source": p.source})
            counts[p.source] = counts.get(p.source, 0) + 1
            if len(buf) >= chunk:
                w.write_table(pa.Table.from_pylist(buf, schema=schema))
                buf = []
        if buf:
            w.write_table(pa.Table.from_pylist(buf, schema=schema))
    return {"passages": sum(counts.values()), "by_source": counts}


def read_corpus(path: str | Path) -> dict[str, list[str]]:
    """{column: list} of a corpus parquet file."""
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"corpus {path} not found (build it with `memopd retrieval corpus`)")
    t = pq.read_table(path, columns=list(COLUMNS))
    return {c: t.column(c).to_pylist() for c in COLUMNS}
