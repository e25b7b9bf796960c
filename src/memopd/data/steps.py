"""The `memopd benchmarks` step: compose every configured benchmark and write it (all or nothing)."""
from __future__ import annotations

from pathlib import Path

from memopd.config import BenchmarksConfig
from memopd.data.compose import compose, write


def build_benchmarks(written: dict, data_dir: str | Path, seed: int, out_dir: str | Path,
                     stats_path: str | Path) -> list[dict]:
    """Check the `benchmarks` section (`written`: as the config spells it, recorded with the files), compose,
    write `out_dir/{benchmark}_{split}.parquet` and the stats CSV."""
    rows_by_set, stats = compose(BenchmarksConfig.from_dict(written), data_dir, seed)
    record = {"config": written, "seed": seed, "data_dir": str(data_dir)}
    for path in write(rows_by_set, stats, out_dir, stats_path, record):
        print(f"wrote {path}")
    width = max(len(r["benchmark"]) for r in stats)
    for r in stats:
        print(f"{r['benchmark']:{width}s} {r['split']:5s} {r['source']:9s} tasks {r['tasks']:5d}  questions {r['questions']:6d}")
    return stats
