"""Where a run's time went: Snakemake's `benchmark:` file of every job (results/logs/bench/), summed by rule.
Not a pipeline step: read it after `snakemake -c 2 all` (docs/results.md "Main job times").

    python workflow/scripts/job_times.py [results/logs/bench]

Prints one line per rule (jobs, wall seconds summed over its jobs, CPU seconds, the longest job) and the totals.
Jobs run side by side, so their wall seconds add up to more than the run's; the span runs from the first job's
start (its benchmark file's mtime minus its seconds) to the last job's end. A benchmark file is
`{rule}.tsv`, `{rule}_{wildcards}.tsv` or `{rule}/{wildcards}.tsv`.
"""
import re
import sys
from pathlib import Path

import pandas as pd

# `rule x:` and `use rule y as x with:`, also indented (a rule defined under `if`, as rule study is)
_RULE = re.compile(r"^[ \t]*(?:rule|use rule \w+ as) (\w+)", re.MULTILINE)


def rules_in(rules_dir: str = "workflow/rules") -> list[str]:
    """Every rule name defined in the .smk files of `rules_dir`."""
    return sorted({r for f in Path(rules_dir).glob("*.smk") for r in _RULE.findall(f.read_text())})


def rule_of(rel: Path, rules: list[str]) -> str:
    """The rule of a benchmark file (path relative to the bench folder): its folder, or the longest rule name
    that its stem is or starts with followed by '_'."""
    if len(rel.parts) > 1:
        return rel.parts[0]
    hits = [r for r in rules if rel.stem == r or rel.stem.startswith(r + "_")]
    if not hits:
        raise ValueError(f"{rel}: no rule of the workflow matches this benchmark file")
    return max(hits, key=len)


def summarise(bench_dir: str, rules: list[str]) -> tuple[pd.DataFrame, float]:
    """(one row per rule: jobs, wall_s, cpu_s, longest_s, longest_job; span in seconds)."""
    files = sorted(Path(bench_dir).rglob("*.tsv"))
    if not files:
        raise ValueError(f"{bench_dir}: no benchmark files (run the workflow first)")
    rows, starts, ends = {}, [], []
    for f in files:
        t = pd.read_csv(f, sep="\t")
        if t.empty:
            raise ValueError(f"{f}: empty benchmark file")
        s, cpu = float(t["s"].iloc[-1]), float(t["cpu_time"].iloc[-1])  # the last line: the run that made it
        rel = f.relative_to(bench_dir)
        r = rows.setdefault(rule_of(rel, rules), {"jobs": 0, "wall_s": 0.0, "cpu_s": 0.0, "longest_s": -1.0})
        r["jobs"] += 1
        r["wall_s"] += s
        r["cpu_s"] += cpu
        if s > r["longest_s"]:
            r["longest_s"], r["longest_job"] = s, str(rel.with_suffix(""))
        ends.append(f.stat().st_mtime)
        starts.append(f.stat().st_mtime - s)
    out = pd.DataFrame([{"rule": k, **v} for k, v in rows.items()])
    return out.sort_values("wall_s", ascending=False, kind="stable").reset_index(drop=True), max(ends) - min(starts)


def main(bench_dir: str = "results/logs/bench", rules_dir: str = "workflow/rules") -> None:
    table, span = summarise(bench_dir, rules_in(rules_dir))
    print(table.to_string(index=False, float_format=lambda x: f"{x:.0f}"))
    print(f"\n{int(table.jobs.sum())} jobs: {table.wall_s.sum() / 60:.1f} job-minutes (wall, summed), "
          f"{table.cpu_s.sum() / 60:.1f} CPU-minutes; span, first start to last end: {span / 60:.1f} min")


if __name__ == "__main__":
    main(*sys.argv[1:])
