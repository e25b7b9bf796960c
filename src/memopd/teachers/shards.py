"""Teacher trajectories in shards: which tasks a shard plays, its resumable chunks, and the merge of files.

The task list (the benchmarks in order, `teacher.max_tasks` of each) is cut into `teacher.shards`
contiguous slices, shard i of N holding tasks [i*n//N, (i+1)*n//N), one job each. Every episode is
sampled with the seeds of its position in the whole list (rollout `indices`), never with a seed of its
shard: an episode does not depend on the number of shards, on how a shard is cut into chunks, or on
which shards run at once, and the shards' files concatenated in order hold the single-process run's
episodes (exactly for the deterministic scripted teacher; for the LLM teacher every request carries the
same seed, so only the server's batch-dependent numerics can differ).

Within a shard, `teacher.chunk_tasks` tasks at a time are rolled out and each chunk is written to
`<shard>.parts/chunk_NNNN.parquet` (+ `.json`: its wall clock, rollout and teacher figures). A rerun of
the shard (preempted, failed) keeps the chunks of the same work (`manifest.json`: a fingerprint of the
config, seed, slice, tasks, index and tokenizer files and the code that plays them) and rolls out only
the others; other work discards them. The parts are removed once the shard's file is written.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memopd.atomic import atomic_path, write_text
from memopd.records import Episode, load_episodes, save_episodes

PACKAGE = Path(__file__).resolve().parents[1]
PLAYER = "memopd.teachers.trajectories:trajectories_step"  # what plays the tasks: its code is part of the fingerprint


def shard_bounds(n: int, shards: int, shard: int) -> tuple[int, int]:
    """Tasks [lo, hi) of shard `shard` of `shards` over `n` tasks (contiguous, sizes differ by at most 1)."""
    if shards < 1 or not 0 <= shard < shards:
        raise ValueError(f"shard {shard} of {shards}: need 0 <= shard < shards")
    return shard * n // shards, (shard + 1) * n // shards


def chunk_bounds(lo: int, hi: int, size: int | None) -> list[tuple[int, int]]:
    """[lo, hi) in chunks of `size` tasks (None: one chunk)."""
    size = size or max(hi - lo, 1)
    return [(a, min(a + size, hi)) for a in range(lo, hi, size)]


def code_digest() -> str:
    """The hash of the code PLAYER can run (memopd.codegraph: its import closure): chunks played by other code are
    not reused."""
    from memopd.codegraph import code_hash

    return code_hash(PLAYER, PACKAGE.parent)


class Chunks:
    """The resumable chunks of one shard, in `directory` (`<shard file>.parts`)."""

    def __init__(self, directory: str | Path, key: str):
        self.dir = Path(directory)
        manifest = self.dir / "manifest.json"
        if self.dir.exists():
            old = json.loads(manifest.read_text()).get("fingerprint") if manifest.exists() else None
            if old != key:  # other work: start over
                shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        if not manifest.exists():
            manifest.write_text(json.dumps({"fingerprint": key}) + "\n")

    def _paths(self, j: int) -> tuple[Path, Path]:
        return self.dir / f"chunk_{j:04d}.parquet", self.dir / f"chunk_{j:04d}.json"

    def done(self, j: int) -> dict | None:
        """The figures of chunk j when it was written completely (its JSON is written last), else None."""
        data, info = self._paths(j)
        return json.loads(info.read_text()) if info.exists() and data.exists() else None

    def load(self, j: int) -> list[Episode]:
        return load_episodes(self._paths(j)[0])

    def write(self, j: int, episodes: list[Episode], info: dict) -> None:
        data, path = self._paths(j)
        save_episodes(data, episodes)
        write_text(path, json.dumps(info, indent=2) + "\n")

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def concat_episode_files(paths: list[str | Path], out: str | Path) -> None:
    """Episode files in order -> one file (episode numbers offset; one file at a time in memory; a single
    file is copied byte for byte), written atomically."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not paths:
        save_episodes(out, [])
        return
    with atomic_path(out) as tmp:
        if len(paths) == 1:
            shutil.copyfile(paths[0], tmp)
        else:
            _concat_parquet(paths, tmp)


def _concat_parquet(paths: list[str | Path], out: Path) -> None:
    """Episode files in order -> the parquet file `out`, episode numbers offset, one file at a time in memory."""
    from memopd.records import _SCHEMA

    offset = 0
    with pq.ParquetWriter(out, _SCHEMA) as writer:
        for p in paths:
            table = pq.read_table(p).select(_SCHEMA.names).cast(_SCHEMA)
            if table.num_rows:
                ep = table["episode"]
                table = table.set_column(0, "episode", pc.add(ep, pa.scalar(offset, pa.int64())))
                offset += pc.max(ep).as_py() + 1
                writer.write_table(table)


def episode_rows(path: str | Path) -> list[tuple[dict, list[int]]]:
    """(metrics, response lengths per call) of every episode of a file, in order, without loading the
    token ids: what `trajectories.summarize` needs."""
    t = pq.read_table(path, columns=["episode", "call", "metrics", "output_ids"])
    lens = pc.list_value_length(t["output_ids"]).to_pylist()
    rows: dict[int, tuple[dict, list[int]]] = {}
    for e, call, m, n in zip(t["episode"].to_pylist(), t["call"].to_pylist(), t["metrics"].to_pylist(), lens):
        if e not in rows:
            rows[e] = (json.loads(m), [])
        if call != len(rows[e][1]):
            raise ValueError(f"{path}: episode {e} calls out of order at call {call}")
        rows[e][1].append(n or 0)
    return [rows[k] for k in sorted(rows)]
