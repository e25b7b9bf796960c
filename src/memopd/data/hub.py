"""Paper scale: the full data sets by name through `datasets` (network, or a warm HF cache).

Not exercised on the embedded default (no code path there reaches the hub). The rows of the hub data
sets have the same fields as the committed samples, so they go through the same row parsers:
`hotpotqa/hotpot_qa` (configs `distractor`, `fullwiki`) -> `hotpotqa_hf`; `google-research-datasets/nq_open`
(config `nq_open`) -> `nq_open`.
"""
from __future__ import annotations

from tqdm import tqdm

from memopd.atomic import atomic_path
from memopd.prefetch import FETCH_REPO_TYPE
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


def fetch_file(repo: str, filename: str, out: str, repo_type: str = FETCH_REPO_TYPE,
               revision: str | None = None) -> None:
    """Download one file of a hub repository (e.g. the wiki-18 corpus of Search-R1 / MEM1,
    `PeterJinGo/wiki-18-corpus`, `wiki-18.jsonl.gz`) to `out`, gunzipped if it ends in .gz. Atomic."""
    import gzip
    import shutil
    from pathlib import Path

    from huggingface_hub import hf_hub_download

    src = hf_hub_download(repo_id=repo, filename=filename, repo_type=repo_type, revision=revision)
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if filename.endswith(".gz") and not out.endswith(".gz") else open
    with atomic_path(out_path) as tmp, opener(src, "rb") as fin, open(tmp, "wb") as fout:
        shutil.copyfileobj(fin, fout, length=1 << 24)
