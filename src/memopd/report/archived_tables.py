"""The tables an archive rebuilds beyond the runs' results: the SFT summary, the benchmark statistics, the retrieval
recall and the alignment audit. What the archive keeps of each comes from the run's own outputs under its results/
folder (nothing is rerun), and each table is rebuilt from that alone by the code that wrote it in the run.

Layout (inside the archive, beside eval/ and train/; memopd.report.archive):
    sft/{model}/heldout.json           each SFT-summary model's held-out loss, as written
    sft/{model}/memopd_model.json      its model record (the SFT and pre-training seconds the table reads)
    eval/{model}/{benchmark}.json|csv  its evaluation, in the runs' evaluation layout
    benchmarks/{set}.csv.gz            per task: KEPT_TASK_COLUMNS (qids and sources space-separated)
    retrieval/recall_hits.csv          each sampled question's hit (memopd.retrieval.recall.HITS_COLUMNS)
    audit/alignment_audit.json         the alignment audit's rows as measured, its scoring, device and episodes' record
"""
from __future__ import annotations

import csv
import gzip
import io
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from memopd.inputs import ConfigError

KEPT_TASK_COLUMNS = ("task_id", "benchmark", "split", "qids", "sources")
# Where each input is in the run's results/ folder (the workflow's layout, docs/outputs.md)
HELDOUT, MODEL_RECORD = "sft/heldout_{model}.json", "models/{model}/memopd_model.json"
BENCHMARK, RECALL_HITS = "benchmarks/{name}.parquet", "retrieval/recall_hits.csv"
ALIGNMENT, AUDIT_EPISODES = "tables/alignment_audit.csv", "audit/episodes.parquet"
KEPT = ("sft", "benchmarks", "retrieval", "audit")  # the archive's folders of these inputs


@dataclass(frozen=True)
class ArchivedTables:
    """What these tables read of a run, as its workflow sets them: the SFT summary's models in order, the model they
    are compared with and the evaluation they are scored on; the benchmark sets in the config's order; the alignment
    audit's scoring (memopd.config.AuditScoring's keys)."""
    sft_models: tuple[str, ...]
    sft_reference: str
    sft_benchmark: str
    benchmark_sets: tuple[str, ...]
    audit: dict

    @classmethod
    def from_dict(cls, d: dict) -> ArchivedTables:
        fields = set(cls.__dataclass_fields__)
        if set(d) != fields:
            raise ConfigError(f"archived tables: keys {sorted(d)}, expected {sorted(fields)}")
        if d["sft_reference"] not in d["sft_models"]:
            raise ConfigError(f"archived tables: sft_reference {d['sft_reference']!r} is not among sft_models")
        return cls(tuple(d["sft_models"]), d["sft_reference"], d["sft_benchmark"], tuple(d["benchmark_sets"]),
                   dict(d["audit"]))

    def to_dict(self) -> dict:
        return json.loads(json.dumps(asdict(self)))

    def evals(self) -> list[tuple[str, str]]:
        """The evaluations the SFT summary reads (archived with the runs' evaluations)."""
        return [(m, self.sft_benchmark) for m in self.sft_models]

    def sources(self, results: Path) -> list[Path]:
        """The run's files these tables are kept from (its evaluations aside)."""
        files = [results / p.format(model=m) for m in self.sft_models for p in (HELDOUT, MODEL_RECORD)]
        files += [results / BENCHMARK.format(name=n) for n in self.benchmark_sets]
        return files + [results / RECALL_HITS, results / ALIGNMENT, results / AUDIT_EPISODES]


def keep(spec: ArchivedTables, results: str | Path, out: str | Path) -> list[Path]:
    """Write into the archive `out` (its KEPT folders absent) what the four tables read of the run under `results`;
    returns the files written. The run's evaluations are archive.py's to copy."""
    results, out = Path(results), Path(out)
    files = keep_sft(spec.sft_models, results, out)
    files += [keep_tasks(results / BENCHMARK.format(name=n), out) for n in spec.benchmark_sets]
    files.append(keep_recall(results / RECALL_HITS, out))
    return files + [keep_alignment(results / ALIGNMENT, results / AUDIT_EPISODES, out)]


def rebuild(spec: ArchivedTables, archive: str | Path, tables: str | Path) -> None:
    """The four tables from the archive alone into the folder `tables`."""
    archive, tables = Path(archive), Path(tables)
    rebuild_sft(spec, archive, tables / "sft_summary.csv")
    rebuild_benchmarks(spec.benchmark_sets, archive, tables / "benchmark_stats.csv")
    rebuild_recall(archive, tables / "retrieval_recall.csv")
    rebuild_alignment(spec.audit, archive, tables / "alignment_audit.csv")


def keep_sft(models, results: Path, out: Path) -> list[Path]:
    """Each model's held-out loss and model record (sft/{model}/)."""
    files = []
    for m in models:
        (out / "sft" / m).mkdir(parents=True, exist_ok=True)
        for src, name in ((HELDOUT, "heldout.json"), (MODEL_RECORD, "memopd_model.json")):
            shutil.copyfile(results / src.format(model=m), out / "sft" / m / name)
            files.append(out / "sft" / m / name)
    return files


def rebuild_sft(spec: ArchivedTables, archive: Path, out: Path) -> None:
    from memopd.report.sft import summary, write_summary

    sft = [archive / "sft" / m for m in spec.sft_models]
    evals = [str(archive / "eval" / m / f"{spec.sft_benchmark}.json") for m in spec.sft_models]
    rows, notes = summary(list(spec.sft_models), [str(d / "heldout.json") for d in sft], evals,
                          [str(d / "memopd_model.json") for d in sft], spec.sft_reference)
    write_summary(rows, notes, evals[0], spec.sft_reference, out)


def keep_tasks(src: Path, out: Path) -> Path:
    """One benchmark file's tasks (benchmarks/{set}.csv.gz: KEPT_TASK_COLUMNS, lists space-separated)."""
    from memopd.data.compose import read_tasks

    buf = io.StringIO(newline="")
    w = csv.writer(buf)
    w.writerow(KEPT_TASK_COLUMNS)
    for t in read_tasks(src):
        w.writerow([t["task_id"], t["benchmark"], t["split"], " ".join(t["qids"]), " ".join(t["sources"])])
    dst = out / "benchmarks" / f"{src.stem}.csv.gz"
    dst.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(dst, "wb", mtime=0) as f:  # no timestamp: the same tasks, the same bytes
        f.write(buf.getvalue().encode())
    return dst


def rebuild_benchmarks(sets, archive: Path, out: Path) -> None:
    from memopd.data.compose import stats_rows, write_stats
    from memopd.outputs import atomic_path

    by_set = {}
    for n in sets:
        with gzip.open(archive / "benchmarks" / f"{n}.csv.gz", "rt", newline="") as f:
            by_set[n] = [{**r, "qids": r["qids"].split(), "sources": r["sources"].split()} for r in csv.DictReader(f)]
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp, open(tmp, "w", newline="") as f:
        write_stats(f, stats_rows(by_set))


def keep_recall(hits: Path, out: Path) -> Path:
    """Each sampled question's hit, as the recall step wrote it (retrieval/recall_hits.csv)."""
    (out / "retrieval").mkdir(parents=True, exist_ok=True)
    return Path(shutil.copyfile(hits, out / "retrieval" / "recall_hits.csv"))


def rebuild_recall(archive: Path, out: Path) -> None:
    from memopd.outputs import write_csv
    from memopd.retrieval.recall import RECALL_COLUMNS, recall_table

    with open(archive / "retrieval" / "recall_hits.csv", newline="") as f:
        write_csv(out, recall_table(list(csv.DictReader(f))), RECALL_COLUMNS)


def keep_alignment(table: Path, episodes: Path, out: Path) -> Path:
    """The alignment audit's rows as its table holds them, the device it scored on (this machine's: the archive's
    check against the run's table catches another) and the record of its episodes (audit/alignment_audit.json)."""
    from memopd.audit.steps import read_episodes
    from memopd.models import default_device

    _, meta = read_episodes(episodes)
    with open(table, newline="") as f:
        rows = [{k: _value(v) for k, v in row.items()} for row in csv.DictReader(f)]
    dst = out / "audit" / "alignment_audit.json"
    dst.parent.mkdir(parents=True, exist_ok=True)
    record = {"device": default_device(), "episodes": meta, "rows": rows}  # keys unsorted: the rows keep their columns
    dst.write_text(json.dumps(record, indent=1) + "\n")
    return dst


def _value(cell: str):
    """A CSV cell of a table written from Python values (int, float repr, bool): that value again."""
    if cell in ("True", "False"):
        return cell == "True"
    for kind in (int, float):
        try:
            return kind(cell)
        except ValueError:
            pass
    return cell


def rebuild_alignment(audit: dict, archive: Path, out: Path) -> None:
    from memopd.audit.steps import alignment_table
    from memopd.config import AuditScoring

    record = json.loads((archive / "audit" / "alignment_audit.json").read_text())
    alignment_table(record["rows"], AuditScoring.from_dict(audit), record["device"], record["episodes"], out)
