"""What every retrieval backend returns, and how passages are shown to the agent."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Sequence


@dataclass(frozen=True)
class Hit:
    """One retrieved passage with its score (higher is better; scales differ between backends)."""

    id: str
    title: str
    text: str
    score: float

    def as_dict(self) -> dict:
        return asdict(self)


class Retriever(ABC):
    """The one interface the agent uses: batched `search(queries, k)` -> per query, best first."""

    backend: str

    @abstractmethod
    def search(self, queries: Sequence[str], k: int = 3) -> list[list[Hit]]:
        ...


def format_passages(hits: Sequence[Hit]) -> str:
    """Passages for the agent's <information> block, one per line: `Doc i (Title: title) text`
    (MEM1 / Search-R1 layout, numbered from 1); "No results." when there are none."""
    if not hits:
        return "No results."
    return "\n".join(f"Doc {i} (Title: {h.title}) {h.text}" for i, h in enumerate(hits, 1))
