"""What every step writes for people and machines: JSON, tables as CSV (for machines) and Markdown (for people,
with a caption saying what produced them), and figures (PNG, titled). Each table caption and figure title starts
with the run's label (config `label`, set by the workflow in LABEL_VAR), so a table or figure of the controlled
study cannot be taken for the real model's."""
from __future__ import annotations

import csv
import json
import os
import textwrap
from pathlib import Path

from memopd.atomic import atomic_path, write_text


def write_json(path: str | Path, obj) -> None:
    """An object as indented JSON, atomically (written beside, then renamed), creating the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(obj, indent=2) + "\n")


def _fmt(v) -> str:
    if isinstance(v, float):
        if v == 0 or 1e-3 <= abs(v) < 1e5:
            return f"{v:.4g}"
        return f"{v:.2e}"
    return str(v)


# Set by the workflow from config `label` for every command of a run: prefixed to each table's caption.
LABEL_VAR = "MEMOPD_LABEL"


def markdown(rows: list[dict], caption: str, notes: list[str] | None = None) -> str:
    """The caption (italic), the table, then `notes` (e.g. findings), one paragraph each."""
    cols = list(rows[0]) if rows else []
    label = os.environ.get(LABEL_VAR, "")  # the workflow's `label` (the controlled study names itself)
    lines = [f"*{label + ': ' if label else ''}{caption}*", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r[c]) for c in cols) + " |" for r in rows]
    for n in notes or []:
        lines += ["", n]
    return "\n".join(lines) + "\n"


def write_csv(path: str | Path, rows: list[dict], columns=None) -> None:
    """Rows to CSV, atomically: no partial file on failure. Columns: every key of any row, in first-seen
    order, unless given (rows may differ: e.g. a scaled estimate carries `scaled_from`); a missing value
    is an empty cell."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns or dict.fromkeys(k for r in rows for k in r)))
        w.writeheader()
        w.writerows(rows)


def write_table(rows: list[dict], csv_path: str | Path, caption: str, md_path: str | Path | None = None,
                notes: list[str] | None = None) -> None:
    """Write rows to CSV and Markdown (md beside the CSV unless given, with `notes` under the table),
    atomically."""
    if not rows:
        raise ValueError(f"no rows for {csv_path}")
    csv_path = Path(csv_path)
    md_path = Path(md_path) if md_path else csv_path.with_suffix(".md")
    write_csv(csv_path, rows)
    write_text(md_path, markdown(rows, caption, notes))


def print_table(rows: list[dict], csv_path: str | Path) -> None:
    """Show a written table (its Markdown) on stdout, for the step's log."""
    print(Path(csv_path).with_suffix(".md").read_text())
    print(f"{len(rows)} rows -> {csv_path}")


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display on a cluster node)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figure_title(title: str, width: int) -> str:
    """`title` with the run's label in front (as each table's caption), wrapped to `width` characters."""
    label = os.environ.get(LABEL_VAR, "")
    return textwrap.fill(f"{label}: {title}" if label else title, width)


def save_figure(fig, path: str | Path, title: str, dpi: int = 110, width: int = 120, suptitle: bool = False) -> str:
    """Title `fig` (its axes' title, or the figure's with `suptitle`) with `figure_title` and save it as a PNG
    carrying the same Title, atomically; closes it. Returns the title drawn."""
    title = figure_title(title, width)
    if suptitle:
        fig.suptitle(title, fontsize=10)
    else:
        fig.axes[0].set_title(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=dpi, bbox_inches="tight", metadata={"Title": title})
    tmp.replace(path)
    pyplot().close(fig)
    return title
