"""The exact call ledger: a portable, versioned record of what a rollout sampled, call by call, for checking a
training batch made by any trainer against it (docs/ledger.md has the format with an example).

A ledger is a JSON Lines file. Line 1 is the header:
    {"format": "memopd.ledger", "version": 1, "tokenizer": "...", "weight_version": ..., "sampling": {...}}
every other line one episode:
    {"episode": "e0", "task_id": "...", "prefix_len": 12, "weight_version": 3,
     "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 64},
     "calls": [{"input_ids": [...], "positions": [...], "action_ids": [...], "logprobs": [...],
                "top_logprobs": [[[id, logprob], ...], ...], "spans": [...]}, ...]}
Per call: the input token ids exactly as the engine saw them, their positions (default 0 .. n-1), the sampled action
ids, the engine's log-prob of each (null when it gave none) and, where it gives them, its top-k per action token.
`spans` covers the input without gap or overlap, in order: `prefix` (the shared system + task tokens, the same in
every call), `context` (what the memory rule put there: observations, the rule's text) and `retained` (tokens copied
from an earlier call's action: `from_call`, `from_offset`, the provenance the packer needs to never match tokens by
value). An episode's sampling and weight version default to the header's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from memopd.atomic import atomic_path
from memopd.records import Episode, Invocation, Retained

FORMAT, VERSION = "memopd.ledger", 1
SPAN_KINDS = ("prefix", "context", "retained")


class LedgerError(ValueError):
    """A ledger that breaks the format: the message names the line, episode, call and offset."""


@dataclass
class LedgerCall:
    input_ids: list[int]
    action_ids: list[int]
    positions: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[list[float]]] | None
    retained: list[Retained] = field(default_factory=list)


@dataclass
class LedgerEpisode:
    episode: str
    task_id: str
    prefix_len: int
    calls: list[LedgerCall]
    sampling: dict
    weight_version: object = None

    def to_episode(self) -> Episode:
        """The ledger's episode as the library's exact records (positions are the records' 0 .. n-1)."""
        return Episode(self.task_id, self.prefix_len, [
            Invocation(c.input_ids, c.action_ids, c.logprobs, retained=list(c.retained)) for c in self.calls])


def spans_of(inv: Invocation, prefix_len: int) -> list[dict]:
    """A call's input as prefix / context / retained spans, in order, covering it."""
    out, at = [{"kind": "prefix", "start": 0, "end": prefix_len}], prefix_len
    for r in sorted(inv.retained, key=lambda r: r.dst_start):
        if r.dst_start > at:
            out.append({"kind": "context", "start": at, "end": r.dst_start})
        out.append({"kind": "retained", "start": r.dst_start, "end": r.dst_start + r.length, "from_call": r.src_call,
                    "from_offset": r.src_start})
        at = r.dst_start + r.length
    if at < len(inv.input_ids):
        out.append({"kind": "context", "start": at, "end": len(inv.input_ids)})
    return [s for s in out if s["end"] > s["start"]]


def episode_line(ep: Episode, name: str) -> dict:
    return {"episode": name, "task_id": ep.task_id, "prefix_len": ep.prefix_len, "calls": [
        {"input_ids": inv.input_ids, "positions": list(range(len(inv.input_ids))), "action_ids": inv.output_ids,
         "logprobs": inv.logprobs, "spans": spans_of(inv, ep.prefix_len)} for inv in ep.invocations]}


def write_ledger(path: str | Path, episodes: list[Episode], sampling: dict, tokenizer: str = "",
                 weight_version=None) -> None:
    """Our rollouts' episodes as a ledger (written whole or not at all)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    head = {"format": FORMAT, "version": VERSION, "tokenizer": tokenizer, "sampling": sampling,
            "weight_version": weight_version}
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        f.write(json.dumps(head, sort_keys=True) + "\n")
        for i, ep in enumerate(episodes):
            f.write(json.dumps(episode_line(ep, f"e{i}"), sort_keys=True) + "\n")


def _ints(value, where: str, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise LedgerError(f"{where}: {what} must be a list of integers")
    return value


def _call(c: dict, where: str, prefix: list[int] | None, prefix_len: int, earlier: list[LedgerCall]) -> LedgerCall:
    if not isinstance(c, dict):
        raise LedgerError(f"{where}: a call is an object")
    ids = _ints(c.get("input_ids"), where, "input_ids")
    acts = _ints(c.get("action_ids"), where, "action_ids")
    if not ids or not acts:
        raise LedgerError(f"{where}: empty {'input_ids' if not ids else 'action_ids'}")
    pos = _ints(c.get("positions", list(range(len(ids)))), where, "positions")
    if len(pos) != len(ids):
        raise LedgerError(f"{where}: {len(pos)} positions for {len(ids)} input tokens")
    lps = c.get("logprobs")
    if lps is not None and (not isinstance(lps, list) or len(lps) != len(acts)):
        raise LedgerError(f"{where}: logprobs must hold one value per action token ({len(acts)})")
    top = c.get("top_logprobs")
    if top is not None and (not isinstance(top, list) or len(top) != len(acts)):
        raise LedgerError(f"{where}: top_logprobs must hold one list per action token ({len(acts)})")
    if prefix is not None and ids[:prefix_len] != prefix:
        off = next(i for i, (a, b) in enumerate(zip(ids[:prefix_len], prefix)) if a != b) if len(ids) >= prefix_len \
            else len(ids)
        raise LedgerError(f"{where}: offset {off}: the input does not start with the episode's prefix")
    return LedgerCall(ids, acts, pos, lps, top, _spans(c.get("spans"), where, ids, prefix_len, earlier))


def _spans(spans, where: str, ids: list[int], prefix_len: int, earlier: list[LedgerCall]) -> list[Retained]:
    if not isinstance(spans, list) or not spans:
        raise LedgerError(f"{where}: spans must list the input's prefix / context / retained spans")
    at, kept = 0, []
    for k, s in enumerate(spans):
        w = f"{where} span {k}"
        kind, start, end = s.get("kind"), s.get("start"), s.get("end")
        if kind not in SPAN_KINDS:
            raise LedgerError(f"{w}: kind {kind!r} is not one of {list(SPAN_KINDS)}")
        if start != at or not isinstance(end, int) or end <= start or end > len(ids):
            raise LedgerError(f"{w}: offset {at}: spans must cover the input in order without gap or overlap "
                              f"(this one [{start}, {end}) of {len(ids)} tokens)")
        if (kind == "prefix") != (start == 0 and k == 0) or (kind == "prefix" and end != prefix_len):
            raise LedgerError(f"{w}: offset {start}: the first span, and only it, is the prefix [0, {prefix_len})")
        if kind == "retained":
            kept.append(_retained(s, w, ids, earlier))
        at = end
    if at != len(ids):
        raise LedgerError(f"{where}: offset {at}: the spans end before the input's {len(ids)} tokens")
    return kept


def _retained(s: dict, w: str, ids: list[int], earlier: list[LedgerCall]) -> Retained:
    src, off = s.get("from_call"), s.get("from_offset")
    if not isinstance(src, int) or not 0 <= src < len(earlier):
        raise LedgerError(f"{w}: offset {s['start']}: from_call {src!r} is not an earlier call")
    acts, n = earlier[src].action_ids, s["end"] - s["start"]
    if not isinstance(off, int) or off < 0 or off + n > len(acts):
        raise LedgerError(f"{w}: offset {s['start']}: from_offset {off!r} + {n} tokens is outside call {src}'s "
                          f"{len(acts)} action tokens")
    for i in range(n):
        if ids[s["start"] + i] != acts[off + i]:
            raise LedgerError(f"{w}: offset {s['start'] + i}: token {ids[s['start'] + i]} is not call {src}'s action "
                              f"token {acts[off + i]} at {off + i} it claims to copy")
    return Retained(src, off, s["start"], n)


def _episode(d: dict, line: int, head: dict) -> LedgerEpisode:
    name = d.get("episode", f"line {line}") if isinstance(d, dict) else f"line {line}"
    where = f"line {line} (episode {name!r})"
    if not isinstance(d, dict) or not isinstance(d.get("calls"), list) or not d["calls"]:
        raise LedgerError(f"{where}: an episode is an object with a non-empty list of calls")
    prefix_len = d.get("prefix_len")
    if not isinstance(prefix_len, int) or prefix_len < 0:
        raise LedgerError(f"{where}: prefix_len must be an integer >= 0")
    calls: list[LedgerCall] = []
    for t, c in enumerate(d["calls"]):
        prefix = calls[0].input_ids[:prefix_len] if calls else None
        calls.append(_call(c, f"{where} call {t}", prefix, prefix_len, calls))
    if len(calls[0].input_ids) < prefix_len:
        raise LedgerError(f"{where} call 0: its input is shorter than prefix_len {prefix_len}")
    return LedgerEpisode(str(name), str(d.get("task_id", name)), prefix_len, calls,
                         d.get("sampling", head.get("sampling") or {}), d.get("weight_version", head.get("weight_version")))


def read_ledger(path: str | Path) -> tuple[dict, list[LedgerEpisode]]:
    """(header, episodes) of a ledger, every rule of the format checked; LedgerError names the first break."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    lines = path.read_text().splitlines()
    rows = []
    for i, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            rows.append((i, json.loads(text)))
        except json.JSONDecodeError as e:
            raise LedgerError(f"{path}: line {i}: not JSON ({e.msg} at column {e.colno})") from None
    if not rows or not isinstance(rows[0][1], dict) or rows[0][1].get("format") != FORMAT:
        raise LedgerError(f"{path}: line 1: not a ledger (its header needs \"format\": \"{FORMAT}\")")
    head = rows[0][1]
    if head.get("version") != VERSION:
        raise LedgerError(f"{path}: line 1: version {head.get('version')!r}; this code reads version {VERSION}")
    episodes, seen = [], set()
    for line, d in rows[1:]:
        try:
            ep = _episode(d, line, head)
        except LedgerError as e:
            raise LedgerError(f"{path}: {e}") from None
        if ep.episode in seen:
            raise LedgerError(f"{path}: line {line}: episode {ep.episode!r} appears twice")
        seen.add(ep.episode)
        episodes.append(ep)
    return head, episodes


def from_episodes(episodes: list[Episode], sampling: dict | None = None) -> list[LedgerEpisode]:
    """Our episodes as ledger episodes, through the same checks a ledger file gets."""
    head = {"sampling": sampling or {}}
    return [_episode(episode_line(ep, f"e{i}"), i + 2, head) for i, ep in enumerate(episodes)]
