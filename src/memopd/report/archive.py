"""A small archive of a finished set of training runs, to commit: every evaluation the result tables read
(scalar scores, and per-task EM/F1 of every evaluation) and every run's per-step training metrics (the matched
control's runs too), with the config, label and commit they came from. Tables 1-2, vs_student, the matched control and the training-curve table rebuild from it alone
(`memopd report from-archive`), without rerunning anything; so does the claims table when the run declares its
claims (config `claims`, kept in the manifest), and the SFT chain's table when the run chose its student along
the chain (`chain`: its models, teacher and evaluations, kept in the manifest with those evaluations), and the SFT
summary, benchmark statistics, retrieval recall and alignment audit when it names their inputs (`tables`).

Layout (the results/ layout, so the report commands read it unchanged):
    archive.json                                  manifest: format, commit, created, the `train` config, the reward,
                                                  the run's label (captions), its `claims`, `chain` and `tables` (or
                                                  null), every file with its SHA-256
    eval/{model}/{benchmark}.json                 the evaluation's scalar scores (its nested config and timings left out)
    eval/{model}/{benchmark}.csv                  per task: task_id, em, f1
    train/{method}/seed{seed}/metrics.jsonl.gz    every logged step, line for line (gzip without a timestamp)
    sft/, benchmarks/, retrieval/, audit/         what the SFT summary, benchmark statistics, retrieval recall and
                                                  alignment audit tables read (memopd.report.archived_tables), when
                                                  the manifest's `tables` names it
"""
from __future__ import annotations

import csv
import datetime
import gzip
import hashlib
import json
import shutil
import subprocess
from pathlib import Path

from memopd.config import TrainRuns
from memopd.inputs import ConfigError
from memopd.outputs import write_json
from memopd.report.archived_tables import KEPT, ArchivedTables, keep

FORMAT = 1
MANIFEST = "archive.json"
TASK_COLUMNS = ("task_id", "em", "f1")


def contents(train: TrainRuns) -> tuple[list[tuple[str, str]], list[tuple[str, int]]]:
    """What the archive keeps of the `train` config section's runs: ([(model, benchmark)], [(method, seed)]): every
    run on every horizon, the SFT student and teacher on every horizon, the matched control's runs on its
    benchmark (what the result tables read); the training metrics of every run of train.methods, each on its seeds
    (the curves), and of the matched control's runs (a control seed no method trains has no curve in the tables, yet
    its steps are the evidence of how it trained, e.g. a collapse). Rule `archive` takes its inputs from here."""
    horizons = list(train.horizons)
    seeds, bench = train.control()
    trained = train.runs()
    control = [(m, s) for m, ss in seeds.items() for s in ss]
    evals = [(f"{m}_seed{s}", b) for m, s in trained for b in horizons]
    evals += [(model, b) for model in dict.fromkeys([train.student, train.teacher]) for b in horizons]
    evals += [(f"{m}_seed{s}", bench) for m, s in control]
    return list(dict.fromkeys(evals)), list(dict.fromkeys(trained + control))


def git_commit(path: Path) -> str:
    """The commit of the checkout holding `path`, with '+changes' when its tracked files differ; 'unknown'
    outside a git checkout."""
    def git(*args):
        return subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, timeout=30)

    head = git("rev-parse", "HEAD")
    if head.returncode != 0:
        return "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return head.stdout.strip() + ("+changes" if dirty else "")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _scalars(ev: dict) -> dict:
    return {k: v for k, v in ev.items() if isinstance(v, (int, float, str, bool)) or v is None}


def _copy_tasks(src: Path, dst: Path) -> None:
    with open(src, newline="") as f:
        rows = list(csv.DictReader(f))
    missing = [c for c in TASK_COLUMNS if rows and c not in rows[0]]
    if missing:
        raise ValueError(f"{src}: no column {missing[0]!r}")
    with open(dst, "w", newline="") as f:
        w = csv.DictWriter(f, TASK_COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def chain_evals(chain: dict | None) -> list[tuple[str, str]]:
    """The evaluations the SFT chain's table reads: every model of the chain on its three, the teacher on two."""
    if not chain:
        return []
    b = chain["benchmarks"]
    return ([(m, x) for m in chain["models"] for x in (b["reward"], b["short"], b["long"])]
            + [(chain["teacher"], b["short"]), (chain["teacher"], b["long"])])


def write_archive(train: dict, reward: str, eval_dir: str | Path, train_dir: str | Path, out: str | Path,
                  commit: str, label: str = "", claims: dict | None = None, chain: dict | None = None,
                  tables: ArchivedTables | None = None, results: str | Path | None = None) -> dict:
    """Copy what `contents` names of the `train` section's runs from `eval_dir` / `train_dir` into `out` (replacing its eval/ and train/)
    and write its manifest (last, so an interrupted archive has none). A missing file is named before anything is
    written. `label`: the run's label, which prefixes its captions (memopd.outputs.LABEL_VAR); `claims`: the config
    section the claims table reads (its short and long horizons among train.horizons, so archived); `chain`: what the
    SFT chain's table reads (memopd.study.commands.chain_config), its evaluations archived too; `tables`: what the
    SFT summary, benchmark, recall and alignment tables read, kept from the run's `results` folder
    (memopd.report.archived_tables)."""
    eval_dir, train_dir, out = Path(eval_dir), Path(train_dir), Path(out)
    typed = TrainRuns.from_section(train)  # the manifest keeps the section as written
    evals, runs = contents(typed)
    evals = list(dict.fromkeys(evals + chain_evals(chain) + (tables.evals() if tables else [])))
    if claims and (outside := [claims[k] for k in ("short", "long") if claims[k] not in typed.horizons]):
        raise ConfigError(f"claims: {outside[0]!r} is not a horizon of train.horizons, so not archived")
    sources = [eval_dir / m / f"{b}{ext}" for m, b in evals for ext in (".json", ".csv")]
    sources += [train_dir / m / f"seed{s}" / "metrics.jsonl" for m, s in runs]
    sources += tables.sources(Path(results)) if tables else []
    missing = [str(p) for p in sources if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"cannot archive: {len(missing)} missing, e.g. {missing[0]}")
    for d in (eval_dir, train_dir):  # its eval/ and train/ are replaced: they must not be the run's own
        if out.resolve() in d.resolve().parents:
            raise ValueError(f"the archive {out} would replace {d}, which it archives: write it elsewhere")
    (out / MANIFEST).unlink(missing_ok=True)
    for old in ("eval", "train", *KEPT):  # an earlier archive's runs are not this one's
        shutil.rmtree(out / old, ignore_errors=True)
    files = []
    for model, bench in evals:
        d = out / "eval" / model
        d.mkdir(parents=True, exist_ok=True)
        ev = json.loads((eval_dir / model / f"{bench}.json").read_text())
        (d / f"{bench}.json").write_text(json.dumps(_scalars(ev), indent=2, sort_keys=True) + "\n")
        _copy_tasks(eval_dir / model / f"{bench}.csv", d / f"{bench}.csv")
        files += [d / f"{bench}.json", d / f"{bench}.csv"]
    for method, seed in runs:
        d = out / "train" / method / f"seed{seed}"
        d.mkdir(parents=True, exist_ok=True)
        with gzip.GzipFile(d / "metrics.jsonl.gz", "wb", mtime=0) as f:  # no timestamp: the same runs, the same bytes
            f.write((train_dir / method / f"seed{seed}" / "metrics.jsonl").read_bytes())
        files.append(d / "metrics.jsonl.gz")
    files += keep(tables, results, out) if tables else []
    files.sort()
    manifest = {"format": FORMAT, "commit": commit, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"), "train": train, "reward": reward, "label": label, "claims": claims, "chain": chain,
                "tables": tables.to_dict() if tables else None,
                "files": {str(p.relative_to(out)): _sha256(p) for p in files}}
    write_json(out / MANIFEST, manifest)
    return manifest


def read_archive(path: str | Path) -> dict:
    """The manifest of the archive at `path`, after checking that every file it lists is there with its SHA-256
    (a missing or changed file is named)."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise FileNotFoundError(f"no such file: {path / MANIFEST} (not an archive, or an interrupted one)")
    manifest = json.loads((path / MANIFEST).read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path / MANIFEST}: format {manifest.get('format')!r}, this code reads {FORMAT}")
    for name, digest in manifest["files"].items():
        f = path / name
        if not f.is_file():
            raise FileNotFoundError(f"{path}: {name} is listed in {MANIFEST} but missing")
        if _sha256(f) != digest:
            raise ValueError(f"{path}: {name} differs from the SHA-256 in {MANIFEST}")
    return manifest


def metrics_files(path: str | Path, train: TrainRuns) -> list[Path]:
    """The archived metrics of the runs the training-curve table reads (train.methods, each on its seeds)."""
    return [Path(path) / "train" / m / f"seed{s}" / "metrics.jsonl.gz" for m, s in train.runs()]
