"""`memopd audit batch`: a trainer's batch against the exact call ledger of its rollout. For every sampled token
three log-probs: the engine's (the ledger's), the exact one (the call's own input run alone, positions 0..n-1, the
full vocabulary) and the batch's (the row as the trainer scores it: its tokens, positions and visibility). Their
differences are kept apart, because they have different causes and different fixes:

  numerical       engine - exact: the engine's kernels against the trainer's, the same state
  sampler         engine - exact renormalised over the sampling support (top-p / top-k, from the ledger's sampling):
                  an engine that returns processed log-probs is off by log S in every ratio, not noisy
  representation  batch - exact: the trainer scores another state than the one sampled

Before any number, each loss-carrying token of the batch is placed (no model needed): the ledger call and action
token it scores, and what the batch shows it compared with that call's exact state: `exact`, `positions` (the same
tokens at other positions: running positions), `leaked` (more tokens visible than the call saw: another call's
text), `missing` (fewer), `other` (a different state), `context copy` (the loss sits on a copy of an earlier action
in a later call's context), `unmatched` (no ledger action holds the token in that state: a re-tokenised call or a
foreign token). The train-once rule: every ledger action token carries loss exactly once, under its own state, and
no context copy carries loss.
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch

from memopd.audit.adapters import BatchRow
from memopd.ledger import LedgerEpisode

KEY = 8  # tokens of state before a target that index the ledger
EPSILONS = (0.2, 0.28)  # PPO clip ranges at which a ratio off 1 is a false clip
PLACES = ("exact", "positions", "leaked", "missing", "other", "context copy", "unmatched")


@dataclass(frozen=True)
class Slot:
    """A ledger action token: episode index, call, offset in the call's action."""
    episode: int
    call: int
    offset: int


@dataclass
class Placed:
    row: int
    k: int  # the loss token's index in its row
    place: str
    slot: Slot | None
    extra: int = 0  # leaked / missing: how many tokens more / fewer than the call saw


def _state(ep: LedgerEpisode, call: int, offset: int) -> tuple[list[int], list[int]]:
    c = ep.calls[call]
    ids = c.input_ids + c.action_ids[:offset]
    return ids, c.positions + list(range(c.positions[-1] + 1, c.positions[-1] + 1 + offset))


def ledger_index(episodes: list[LedgerEpisode]) -> tuple[dict, dict]:
    """({(last KEY state ids, target): [Slot]}, the same for the context copies of retained spans)."""
    actions, copies = defaultdict(list), defaultdict(list)
    for e, ep in enumerate(episodes):
        for t, c in enumerate(ep.calls):
            for o, tok in enumerate(c.action_ids):
                ids, _ = _state(ep, t, o)
                actions[(tuple(ids[-KEY:]), tok)].append(Slot(e, t, o))
            for r in c.retained:
                for i in range(r.length):
                    q = r.dst_start + i
                    copies[(tuple(c.input_ids[max(0, q - KEY):q]), c.input_ids[q])].append(Slot(e, r.src_call, r.src_start + i))
    return actions, copies


def _within(small: list[int], big: list[int]) -> bool:
    """`small` is `big` with some tokens left out (a subsequence, in order)."""
    it = iter(big)
    return all(any(x == y for y in it) for x in small)


def _seen(row: BatchRow, allowed: torch.Tensor, p: int) -> tuple[list[int], list[int]]:
    keys = allowed[p, : p + 1].nonzero().flatten().tolist()
    return [row.input_ids[j] for j in keys], [row.position_ids[j] for j in keys]


def place_row(r: int, row: BatchRow, episodes: list[LedgerEpisode], actions: dict, copies: dict) -> list[Placed]:
    allowed = row.allowed()
    out = []
    for k, (p, tgt) in enumerate(zip(row.pred_index, row.target_id)):
        ids, pos = _seen(row, allowed, p)
        slots = actions.get((tuple(ids[-KEY:]), tgt))
        if not slots:
            copy = copies.get((tuple(ids[-KEY:]), tgt))
            out.append(Placed(r, k, "context copy" if copy else "unmatched", copy[0] if copy else None))
            continue
        best, place, extra = None, "other", 0
        for s in slots:  # the slot whose exact state the row shows most of, from the end
            want, want_pos = _state(episodes[s.episode], s.call, s.offset)
            if ids == want:
                best, place = s, "exact" if pos == want_pos else "positions"
                break
            if len(ids) > len(want) and _within(want, ids):
                best, place, extra = s, "leaked", len(ids) - len(want)
            elif best is None and len(ids) < len(want) and _within(ids, want):
                best, place, extra = s, "missing", len(want) - len(ids)
        out.append(Placed(r, k, place, best or slots[0], extra))
    return out


@dataclass
class Placement:
    placed: list[Placed]
    untrained: list[Slot]  # ledger action tokens that carry no loss
    twice: list[Slot] = field(default_factory=list)  # ledger action tokens that carry loss more than once

    def counts(self) -> dict[str, int]:
        c = Counter(p.place for p in self.placed)
        return {k: c.get(k, 0) for k in PLACES}

    @property
    def trains_once(self) -> bool:
        return (not self.untrained and not self.twice and
                all(p.place in ("exact", "positions", "leaked", "missing", "other") for p in self.placed))


def place(rows: list[BatchRow], episodes: list[LedgerEpisode]) -> Placement:
    actions, copies = ledger_index(episodes)
    placed = [p for r, row in enumerate(rows) for p in place_row(r, row, episodes, actions, copies)]
    used = Counter(p.slot for p in placed if p.place not in ("context copy", "unmatched"))
    every = [Slot(e, t, o) for e, ep in enumerate(episodes) for t, c in enumerate(ep.calls) for o in range(len(c.action_ids))]
    return Placement(placed, [s for s in every if s not in used], sorted((s for s, n in used.items() if n > 1),
                                                                          key=lambda s: (s.episode, s.call, s.offset)))


# ----------------------------------------------------------------------------------------------- the numbers

def _lm_head(model, hidden: torch.Tensor) -> torch.Tensor:
    from memopd.attention import lm_logits

    return lm_logits(model, hidden).float()


@torch.no_grad()
def exact_hidden(model, episodes: list[LedgerEpisode]) -> dict[Slot, torch.Tensor]:
    """The hidden state predicting every ledger action token, each call run alone at its own positions."""
    dev = next(model.parameters()).device
    out = {}
    for e, ep in enumerate(episodes):
        for t, c in enumerate(ep.calls):
            ids = torch.tensor([c.input_ids + c.action_ids], device=dev)
            last = c.positions[-1]
            pos = torch.tensor([c.positions + list(range(last + 1, last + 1 + len(c.action_ids)))], device=dev)
            h = model.get_decoder()(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state[0]
            n = len(c.input_ids)
            for o in range(len(c.action_ids)):
                out[Slot(e, t, o)] = h[n - 1 + o]
    return out


@torch.no_grad()
def row_hidden(model, row: BatchRow) -> torch.Tensor:
    """The row's hidden states as the trainer computes them: its tokens, positions and visibility (sdpa, a dense
    boolean mask)."""
    from memopd.attention import attn_impl

    dev = next(model.parameters()).device
    mask = row.allowed()[None, None].to(dev)
    with attn_impl(model, "sdpa"):
        h = model.get_decoder()(input_ids=torch.tensor([row.input_ids], device=dev),
                                position_ids=torch.tensor([row.position_ids], device=dev), attention_mask=mask,
                                use_cache=False).last_hidden_state[0]
    return h


def renormalised(logp: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """(V,) log-probs renormalised over the sampling support: the top_k largest, then the smallest set whose mass
    reaches top_p (vLLM's order); -inf outside it."""
    order = torch.argsort(logp, descending=True)
    keep = torch.ones_like(logp, dtype=torch.bool)
    if top_k and top_k > 0:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        p = logp[order].exp() * keep[order]
        cum = torch.cumsum(p / p.sum(), 0)
        drop = cum - p / p.sum() >= top_p  # the tokens after the mass is reached
        keep[order[drop]] = False
    out = torch.full_like(logp, -math.inf)
    out[keep] = logp[keep] - torch.logsumexp(logp[keep], 0)
    return out


def _quantiles(d: list[float]) -> dict:
    if not d:
        return {"tokens": 0, "p50_abs_dlogp": math.nan, "p99_abs_dlogp": math.nan, "max_abs_dlogp": math.nan}
    a = torch.tensor(d, dtype=torch.float64).abs()
    return {"tokens": len(d), "p50_abs_dlogp": float(a.quantile(0.5)), "p99_abs_dlogp": float(a.quantile(0.99)),
            "max_abs_dlogp": float(a.max())}


def _clips(d: list[float]) -> dict:
    t = torch.tensor(d, dtype=torch.float64)
    return {f"false_clip_{e:g}": float(((t.exp() - 1).abs() > e).double().mean()) if d else math.nan for e in EPSILONS}


@torch.no_grad()
def compare(model, rows: list[BatchRow], episodes: list[LedgerEpisode], placement: Placement) -> dict:
    """The three comparisons over the tokens they apply to, overall and per call index (round)."""
    exact_h = exact_hidden(model, episodes)
    slots = sorted(exact_h, key=lambda s: (s.episode, s.call, s.offset))
    logits = {}
    for i in range(0, len(slots), 512):
        part = slots[i:i + 512]
        for s, z in zip(part, _lm_head(model, torch.stack([exact_h[s] for s in part]))):
            logits[s] = z
    num, samp, full, outside = defaultdict(list), defaultdict(list), defaultdict(list), 0
    for s in slots:
        ep, c = episodes[s.episode], episodes[s.episode].calls[s.call]
        if c.logprobs is None or c.logprobs[s.offset] is None:
            continue
        lp = torch.log_softmax(logits[s], -1)
        tok, eng = c.action_ids[s.offset], float(c.logprobs[s.offset])
        if not math.isfinite(eng):  # an engine that reports -inf: a token it could not have sampled
            outside += 1
            continue
        num[s.call].append(eng - float(lp[tok]))
        sp = ep.sampling or {}
        renorm = float(renormalised(lp, float(sp.get("top_p", 1.0)), int(sp.get("top_k", 0) or 0))[tok])
        if math.isfinite(renorm):
            samp[s.call].append(eng - renorm)
        else:  # outside the support the exact model gives: no renormalised value to compare with
            outside += 1
    rep = defaultdict(list)
    kl, dlogit, top1 = defaultdict(list), defaultdict(list), defaultdict(int)
    by_row = defaultdict(list)
    for p in placement.placed:
        if p.slot is not None and p.place not in ("context copy", "unmatched"):
            by_row[p.row].append(p)
    for r, ps in by_row.items():
        row = rows[r]
        h = row_hidden(model, row)
        z = _lm_head(model, h[torch.tensor([row.pred_index[p.k] for p in ps])])
        for p, zb in zip(ps, z):
            ze = logits[p.slot]
            le, lb = torch.log_softmax(ze, -1), torch.log_softmax(zb, -1)
            tok = row.target_id[p.k]
            rep[p.slot.call].append(float(lb[tok] - le[tok]))
            kl[p.slot.call].append(float((le.exp() * (le - lb)).sum()))
            dlogit[p.slot.call].append(float((zb - ze).abs().max()))
            top1[p.slot.call] += int(zb.argmax() != ze.argmax())
            full[p.slot.call].append(tok)

    def block(d: dict, extra=None) -> dict:
        every = [x for v in d.values() for x in v]
        out = {**_quantiles(every), **_clips(every)}
        if extra:
            out.update(extra(None))
        out["per_round"] = {str(t): {**_quantiles(v), **(extra(t) if extra else {})} for t, v in sorted(d.items())}
        return out

    def rep_extra(t):
        ks = [x for k, v in kl.items() if t is None or k == t for x in v]
        dl = [x for k, v in dlogit.items() if t is None or k == t for x in v]
        return {"kl_max": max(ks, default=math.nan), "kl_mean": sum(ks) / len(ks) if ks else math.nan,
                "max_abs_dlogit": max(dl, default=math.nan),
                "top1_changes": sum(v for k, v in top1.items() if t is None or k == t)}

    return {"numerical": block(num), "sampler": {**block(samp), "outside_support": outside},
            "representation": block(rep, rep_extra)}


def verdict(report: dict, tol: float = 1e-4) -> list[str]:
    """Findings in words, each naming its cause (empty: the batch is exact and trains each token once)."""
    out = []
    c = report["placement"]["counts"]
    for place_ in PLACES[1:]:
        if c[place_]:
            out.append(f"{c[place_]} loss tokens scored under a state that is not the one sampled: {place_}")
    if report["placement"]["untrained"]:
        out.append(f"train once: {report['placement']['untrained']} ledger action tokens carry no loss")
    if report["placement"]["twice"]:
        out.append(f"train once: {report['placement']['twice']} ledger action tokens carry loss more than once")
    if report.get("numbers"):
        n, s, r = (report["numbers"][k] for k in ("numerical", "sampler", "representation"))
        if r["tokens"] and r["max_abs_dlogp"] > tol:
            out.append(f"representation error: max |d log p| {r['max_abs_dlogp']:.3g}, p99 {r['p99_abs_dlogp']:.3g}")
        if n["tokens"] and n["p50_abs_dlogp"] > 10 * max(s["p50_abs_dlogp"], tol):
            out.append(f"sampler processing: the engine's log-probs are renormalised over its sampling support "
                       f"(off the full vocabulary by p50 {n['p50_abs_dlogp']:.3g}, off the renormalised values by "
                       f"p50 {s['p50_abs_dlogp']:.3g})")
        elif n["tokens"] and n["max_abs_dlogp"] > tol:
            out.append(f"numerical error (engine vs exact, the same state): p50 {n['p50_abs_dlogp']:.3g}, max "
                       f"{n['max_abs_dlogp']:.3g}")
    return out


def audit(model, rows: list[BatchRow], episodes: list[LedgerEpisode], numbers: bool = True) -> dict:
    placement = place(rows, episodes)
    report = {"placement": {"counts": placement.counts(), "untrained": len(placement.untrained),
                            "twice": len(placement.twice), "trains_once": placement.trains_once,
                            "first": _first_problems(placement, rows)}}
    if numbers and model is not None:
        report["numbers"] = compare(model, rows, episodes, placement)
    report["findings"] = verdict(report)
    report["passed"] = not report["findings"]
    return report


def _first_problems(placement: Placement, rows: list[BatchRow], show: int = 5) -> list[str]:
    out = [f"{rows[p.row].where or f'row {p.row}'} loss token {p.k} (pred index {rows[p.row].pred_index[p.k]}): "
           f"{p.place}{f' ({p.extra} tokens)' if p.extra else ''}"
           for p in placement.placed if p.place != "exact"][:show]
    out += [f"episode {s.episode} call {s.call} action token {s.offset}: carries no loss" for s in placement.untrained[:show]]
    out += [f"episode {s.episode} call {s.call} action token {s.offset}: carries loss twice" for s in placement.twice[:show]]
    return out


def report_rows(report: dict) -> list[dict]:
    """The Markdown table's rows: one per comparison, over every token it applies to."""
    rows = []
    for kind in ("numerical", "sampler", "representation"):
        b = (report.get("numbers") or {}).get(kind)
        if b:
            rows.append({"comparison": kind, **{k: v for k, v in b.items() if k != "per_round"}})
    return rows


def write_report(report: dict, out) -> None:
    """JSON, a Markdown table (placement, comparisons, findings) and a bar figure of |d log p| per comparison."""
    from pathlib import Path

    from memopd.outputs import markdown, pyplot, save_figure, write_json

    out = Path(out)
    write_json(out, report)
    counts = [{"place": k, "loss tokens": v} for k, v in report["placement"]["counts"].items()]
    text = markdown(counts, "Where each loss-carrying token of the batch lands against the ledger (exact: the state "
                    "it was sampled in)", None)
    rows = report_rows(report)
    if rows:
        text += "\n" + markdown(rows, "Log-prob differences per sampled token: numerical = engine - exact, sampler = "
                                 "engine - exact renormalised over the sampling support, representation = batch - "
                                 "exact (false clips: ratio off 1 by more than epsilon with identical weights)", None)
    notes = report["findings"] or ["the batch scores every sampled token once, under the state it was sampled in"]
    text += "\n" + "\n".join(f"Finding: {f}" for f in notes + report["placement"]["first"]) + "\n"
    out.with_suffix(".md").write_text(text)
    if rows:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for i, r in enumerate(rows):
            vals = [max(r[k], 1e-12) if r[k] == r[k] else 1e-12 for k in ("p50_abs_dlogp", "p99_abs_dlogp", "max_abs_dlogp")]
            ax.bar([i * 4 + j for j in range(3)], vals, color=["C0", "C1", "C3"])
        ax.set_yscale("log")
        ax.set_xticks([i * 4 + 1 for i in range(len(rows))], [r["comparison"] for r in rows])
        ax.set_ylabel("|d log p|: p50, p99, max")
        save_figure(fig, out.with_suffix(".png"), "Batch audit: numerical, sampler and representation error")
