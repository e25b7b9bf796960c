"""Did a finished run write every output of its DAG? Not a pipeline step: run it after `snakemake ... all`
(CI does, after the smoke run of config/smoke.yaml).

    python workflow/scripts/check_outputs.py [--configfile FILE ...] [--target all]

The files come from Snakemake itself: `snakemake TARGET --summary` lists the output of every job of the
target's DAG (the same Snakefile and config files as the run). Each must exist and be non-empty: a file
of size > 0, a directory output with at least one file in it; a CSV must have a header and at least one
row; a PNG must start with the PNG signature. Prints every problem, one per line, and exits 1 if there is
one; 0 with a one-line count otherwise.
"""
import argparse
import csv
import subprocess
import sys
from pathlib import Path

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def dag_outputs(target: str = "all", configfiles: list[str] | None = None, snakefile: str = "Snakefile",
                directory: str = ".") -> list[str]:
    """Every output file of the jobs of `target`'s DAG: the first column of `snakemake TARGET --summary`
    (run with the interpreter running this script, in `directory`)."""
    cmd = [sys.executable, "-m", "snakemake", target, "--summary", "--snakefile", snakefile]
    if configfiles:
        cmd += ["--configfile", *configfiles]
    r = subprocess.run(cmd, cwd=directory, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    if not lines or not lines[0].startswith("output_file\t"):
        raise RuntimeError(f"unexpected `snakemake --summary` output:\n{r.stdout[:2000]}\n{r.stderr[-2000:]}")
    return sorted({ln.split("\t", 1)[0] for ln in lines[1:]})


def problem(path: Path) -> str | None:
    """Why the output `path` is not acceptable, or None if it is."""
    if path.is_dir():
        return None if any(p.is_file() for p in path.rglob("*")) else "empty directory"
    if not path.exists():
        return "missing"
    if path.stat().st_size == 0:
        return "empty (0 bytes)"
    if path.suffix == ".csv":
        with open(path, newline="", encoding="utf-8") as f:
            rows = [row for row in csv.reader(f) if any(cell.strip() for cell in row)]
        if not rows:
            return "CSV without a header"
        if len(rows) < 2:
            return "CSV with a header and no row"
    if path.suffix == ".png":
        with open(path, "rb") as f:
            if f.read(len(PNG_SIGNATURE)) != PNG_SIGNATURE:
                return "not a PNG (no PNG signature)"
    return None


def check(paths: list[str], root: Path = Path(".")) -> list[str]:
    """One line per unacceptable output (paths relative to `root`): 'PATH: why'."""
    return [f"{p}: {why}" for p in paths if (why := problem(root / p))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configfile", nargs="+", default=None, help="as given to the run (none: the embedded default)")
    ap.add_argument("--target", default="all")
    ap.add_argument("--snakefile", default="Snakefile")
    ap.add_argument("--directory", default=".", help="the run's working directory (the repository root)")
    args = ap.parse_args(argv)
    paths = dag_outputs(args.target, args.configfile, args.snakefile, args.directory)
    bad = check(paths, Path(args.directory))
    for line in bad:
        print(f"check_outputs: {line}", file=sys.stderr)
    if bad:
        print(f"check_outputs: {len(bad)} of {len(paths)} outputs of `{args.target}` missing or empty", file=sys.stderr)
        return 1
    print(f"check_outputs: all {len(paths)} outputs of `{args.target}` present and non-empty")
    return 0


if __name__ == "__main__":
    sys.exit(main())
