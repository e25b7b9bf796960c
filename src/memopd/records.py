"""Exact per-call records of an agent rollout.

An `Invocation` is one model call exactly as it ran: the input token ids the model saw and the token
ids it sampled (never decoded and re-tokenised), plus the behaviour log-probs when the backend gave
them. An `Episode` is the ordered calls of one task. Every call's input starts with the same shared
prefix q (system + task text) of `prefix_len` tokens.

Provenance: a memory rewrite may copy tokens of an earlier sampled response into a later context.
`Retained` records each such span, so that the packing compiler knows which tokens are sampled
actions and which are context copies without ever matching tokens by value.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from memopd.atomic import atomic_path


class RecordError(ValueError):
    """An episode whose calls are inconsistent (prefix mismatch, bad provenance span, ...)."""


@dataclass(frozen=True)
class Retained:
    """Tokens output_ids[src_start : src_start+length] of call `src_call` reappear in this call's
    input at input_ids[dst_start : dst_start+length] (dst_start counts from the start of the input,
    so it is >= prefix_len)."""

    src_call: int
    src_start: int
    dst_start: int
    length: int


@dataclass
class Invocation:
    input_ids: list[int]  # z_t = [q, x_t], exactly as fed to the model
    output_ids: list[int]  # a_t, exactly as sampled
    logprobs: list[float] | None = None  # behaviour log-probs of output_ids, if the backend gave them
    stop_reason: str = ""  # "stop", "length", "eos", ... as the backend reported it
    retained: list[Retained] = field(default_factory=list)


def flatten_history(prefix_len: int, inputs: list[list[int]], outputs: list[list[int]]) -> tuple[list[int], list[Retained]]:
    """Call t's input in the persistent-history flattening (packing layout "persistent"): the prefix once, then
    every earlier call's input after the prefix and its response, then call t's input after the prefix. `inputs`:
    the exact states of calls 0..t (each [q, x_s]); `outputs`: the responses of calls 0..t-1. Returns the ids and
    the provenance of the earlier responses inside them (one Retained span per earlier call)."""
    if len(inputs) != len(outputs) + 1:
        raise ValueError(f"flatten_history: {len(inputs)} inputs for {len(outputs)} earlier responses")
    ids, spans = list(inputs[0][:prefix_len]), []
    for s, (x, a) in enumerate(zip(inputs, outputs)):
        ids += x[prefix_len:]
        spans.append(Retained(s, 0, len(ids), len(a)))
        ids += a
    return ids + list(inputs[-1][prefix_len:]), spans


def span_error(r: Retained, t: int, outputs: list[list[int]], input_ids: list[int], prefix_len: int) -> str | None:
    """What is wrong with retained span `r` of call t (None: nothing), given the responses of calls 0..t-1."""
    if not (0 <= r.src_call < t):
        return f"retained span from call {r.src_call} (must be earlier)"
    src = outputs[r.src_call]
    if r.length <= 0 or r.src_start < 0 or r.src_start + r.length > len(src):
        return f"retained span {r} outside call {r.src_call}'s response"
    if r.dst_start < prefix_len or r.dst_start + r.length > len(input_ids):
        return f"retained span {r} outside the context of this call"
    if input_ids[r.dst_start : r.dst_start + r.length] != src[r.src_start : r.src_start + r.length]:
        return f"retained span {r} does not hold the source tokens"
    return None


@dataclass
class Episode:
    task_id: str
    prefix_len: int
    invocations: list[Invocation]
    reward: float | None = None
    metrics: dict = field(default_factory=dict)

    @property
    def prefix_ids(self) -> list[int]:
        return self.invocations[0].input_ids[: self.prefix_len] if self.invocations else []

    def validate(self) -> "Episode":
        """Check the invariants the packing compiler relies on; raise RecordError naming the call."""
        if not self.invocations:
            raise RecordError(f"episode {self.task_id!r}: no invocations")
        if self.prefix_len < 0:
            raise RecordError(f"episode {self.task_id!r}: negative prefix_len")
        q = self.prefix_ids
        if len(q) != self.prefix_len:
            raise RecordError(f"episode {self.task_id!r}: call 0 input is shorter than prefix_len")
        for t, inv in enumerate(self.invocations):
            where = f"episode {self.task_id!r} call {t}"
            if inv.input_ids[: self.prefix_len] != q:
                raise RecordError(f"{where}: input does not start with the shared prefix")
            if not inv.output_ids:
                raise RecordError(f"{where}: empty sampled response")
            if len(inv.input_ids) == 0:
                raise RecordError(f"{where}: empty input (no token conditions the first action)")
            if inv.logprobs is not None and len(inv.logprobs) != len(inv.output_ids):
                raise RecordError(f"{where}: {len(inv.logprobs)} log-probs for {len(inv.output_ids)} tokens")
            for r in inv.retained:
                bad = span_error(r, t, [i.output_ids for i in self.invocations[:t]], inv.input_ids, self.prefix_len)
                if bad:
                    raise RecordError(f"{where}: {bad}")
        return self


# --- disk format: parquet, one row per invocation, list<int32> columns (lossless) -----------------

_SCHEMA = pa.schema(
    [
        ("episode", pa.int64()),
        ("task_id", pa.string()),
        ("call", pa.int32()),
        ("prefix_len", pa.int32()),
        ("input_ids", pa.list_(pa.int32())),
        ("output_ids", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.float64())),  # null when the backend gave none
        ("stop_reason", pa.string()),
        ("retained", pa.list_(pa.list_(pa.int32()))),  # [src_call, src_start, dst_start, length]
        ("reward", pa.float64()),
        ("metrics", pa.string()),  # JSON, episode-level, repeated on each row of the episode
    ]
)


def save_episodes(path: str | Path, episodes: list[Episode]) -> None:
    """Write episodes to parquet (atomically: a temporary file is renamed into place)."""
    rows = {name: [] for name in _SCHEMA.names}
    for e, ep in enumerate(episodes):
        for t, inv in enumerate(ep.invocations):
            rows["episode"].append(e)
            rows["task_id"].append(ep.task_id)
            rows["call"].append(t)
            rows["prefix_len"].append(ep.prefix_len)
            rows["input_ids"].append(inv.input_ids)
            rows["output_ids"].append(inv.output_ids)
            rows["logprobs"].append(inv.logprobs)
            rows["stop_reason"].append(inv.stop_reason)
            rows["retained"].append([[r.src_call, r.src_start, r.dst_start, r.length] for r in inv.retained])
            rows["reward"].append(ep.reward)
            rows["metrics"].append(json.dumps(ep.metrics, sort_keys=True))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        pq.write_table(pa.table(rows, schema=_SCHEMA), tmp)


def load_episodes(path: str | Path) -> list[Episode]:
    table = pq.read_table(path)
    missing = set(_SCHEMA.names) - set(table.column_names)
    if missing:
        raise RecordError(f"{path}: not an episode file (missing columns {sorted(missing)})")
    episodes: dict[int, Episode] = {}
    for row in table.to_pylist():
        ep = episodes.get(row["episode"])
        if ep is None:
            ep = episodes[row["episode"]] = Episode(
                task_id=row["task_id"], prefix_len=row["prefix_len"], invocations=[],
                reward=row["reward"], metrics=json.loads(row["metrics"]),
            )
        if row["call"] != len(ep.invocations):
            raise RecordError(f"{path}: episode {row['episode']} calls out of order at call {row['call']}")
        ep.invocations.append(
            Invocation(
                input_ids=list(row["input_ids"]), output_ids=list(row["output_ids"]),
                logprobs=None if row["logprobs"] is None else list(row["logprobs"]),
                stop_reason=row["stop_reason"], retained=[Retained(*r) for r in row["retained"]],
            )
        )
    return [episodes[k] for k in sorted(episodes)]
