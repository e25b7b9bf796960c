"""Paper scale: the full data sets by name through `datasets` (network, or a warm HF cache).

Not exercised on the embedded default (no code path there reaches the hub). The rows of the hub data
sets have the same fields as the committed samples, so they go through the same row parsers:
`hotpotqa/hotpot_qa` (configs `distractor`, `fullwiki`) -> `hotpotqa_hf`; `google-research-datasets/nq_open`
(config `nq_open`) -> `nq_open`.
"""
from __future__ import annotations

from tqdm import tqdm

from memopd.data.loaders import QA, QA_PARSERS, DataConfigError


def load_qa_hub(name: str, config: str | None, split: str, fmt: str, key: str = "name",
                revision: str | None = None) -> list[QA]:
    """Every question of a hub data set split, parsed like the local files (errors name row and field)."""
    if fmt not in QA_PARSERS:
        raise DataConfigError(f"{key}: unknown question format {fmt!r} (known: {', '.join(QA_PARSERS)})")
    import datasets  # imported here: the embedded default never needs it

    ds = datasets.load_dataset(name, config, split=split, revision=revision)
    parse = QA_PARSERS[fmt]
    label = f"{name}/{config}:{split}" if config else f"{name}:{split}"
    out = []
    for i, row in enumerate(tqdm(ds, desc=f"load {label}", unit="q", mininterval=5)):
        if fmt.startswith("hotpotqa") and not row.get("answer"):
            continue  # the fullwiki test split has no answers: nothing to score
        out.append(parse(row, f"{label}[row {i}]"))
    return out
