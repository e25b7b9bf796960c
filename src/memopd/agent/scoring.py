"""Per-task scoring and the cost metrics of one episode.

TODO(issue 3): switch `score_task` to memopd.metrics (SQuAD-normalised EM/F1, multi-answer scoring) when
it lands; this is a minimal stand-in with the same semantics so the rollout can compute rewards now.
"""
from __future__ import annotations

import re
import string
from collections import Counter

from memopd.records import Episode


def _normalize(s: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def _f1(pred: str, gold: str) -> float:
    p, g = _normalize(pred).split(), _normalize(gold).split()
    common = sum((Counter(p) & Counter(g)).values())
    if common == 0:
        return 0.0
    prec, rec = common / len(p), common / len(g)
    return 2 * prec * rec / (prec + rec)


def score_task(pred_answers, gold_aliases: list[list[str]]) -> tuple[float, float]:
    """(EM, F1) of one task, averaged over its questions: prediction i answers question i (missing
    predictions score 0); each question takes the best alias."""
    if not gold_aliases:
        return 0.0, 0.0
    preds = list(pred_answers) + [""] * max(0, len(gold_aliases) - len(pred_answers))
    em = f1 = 0.0
    for pred, golds in zip(preds, gold_aliases):
        if not pred.strip():
            continue
        em += max((float(_normalize(pred) == _normalize(g)) for g in golds), default=0.0)
        f1 += max((_f1(pred, g) for g in golds), default=0.0)
    return em / len(gold_aliases), f1 / len(gold_aliases)


def peak_context_tokens(ep: Episode) -> int:
    """Largest number of tokens any one call held (input + its generated response)."""
    return max(len(inv.input_ids) + len(inv.output_ids) for inv in ep.invocations)


def dependency(ep: Episode) -> float:
    """Attention-cost integral: sum over generated segments s of (|context| + |s|/2) * |s|."""
    return float(sum((len(inv.input_ids) + len(inv.output_ids) / 2) * len(inv.output_ids) for inv in ep.invocations))
