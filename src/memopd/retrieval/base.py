"""What every retrieval backend returns, and how passages are shown to the agent."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Hit:
    """One retrieved passage with its score (higher is better; scales differ between backends)."""

    id: str
    title: str
    text: str
    score: float


class Retriever(ABC):
    """The one interface the agent uses: batched `search(queries, k)` -> per query, best first."""

    backend: str

    @abstractmethod
    def search(self, queries: Sequence[str], k: int = 3) -> list[list[Hit]]:
        ...


def passage_text(title: str, text: str) -> str:
    """One passage as the agent reads it (after its `Doc i ` number): `(Title: title) text`."""
    return f"(Title: {title}) {text}"


def format_passages(hits: Sequence[Hit]) -> str:
    """Passages for the agent's <information> block, one per line: `Doc i (Title: title) text`
    (MEM1 / Search-R1 layout, numbered from 1); "No results." when there are none."""
    if not hits:
        return "No results."
    return "\n".join(f"Doc {i} {passage_text(h.title, h.text)}" for i, h in enumerate(hits, 1))


def write_index_dir(out_dir, write_backend, ids, titles, texts, meta: dict) -> None:
    """An index directory, written atomically (a temporary directory renamed into place): the backend's
    own files (`write_backend(tmp_dir)`), passages.parquet and meta.json. Shared by every backend."""
    import json
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    from memopd.atomic import atomic_path

    with atomic_path(out_dir) as tmp:
        shutil.rmtree(tmp, ignore_errors=True)  # what a killed build left
        tmp.mkdir(parents=True)
        write_backend(tmp)
        pq.write_table(pa.table({"id": ids, "title": titles, "text": texts}), tmp / "passages.parquet")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
