"""Task metrics: EM / F1 (SQuAD normalisation), multi-answer scoring for Q_n, cost measures.

Answer quality
- `normalize_answer`: the SQuAD v1.1 normalisation (lowercase, drop punctuation, drop the articles
  a/an/the, collapse whitespace). Two deliberate extensions, both no-ops on ASCII text: the string is
  put in Unicode NFC form first (a composed and a decomposed 'ö' compare equal), and Unicode punctuation
  (category P*: curly quotes, dashes, ...) is dropped like ASCII punctuation, so "ain’t" == "ain't".
  Accents are kept ("Röntgen" != "Rontgen"), as in SQuAD.
- `exact_match` / `f1_score`: per question, the best over all gold aliases.
- `score_answer`: Q_n scoring. The predicted answer string is split on ';' and matched to the gold
  questions by order; a missing answer scores 0, answers beyond the n-th are ignored. It reports the
  per-task mean over questions (the fraction the tables report) and the MEM1-style sum.

Cost
- `peak_context`: the most tokens any one call held (input + its generated response).
- `dependency`: sum over generated segments s of (|context| + |s|/2) * |s| -- the attention-cost
  integral of generating s after a context of |context| tokens.
"""
from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from typing import Iterable, Sequence

_ASCII_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)


def _is_punct(ch: str) -> bool:
    return ch in _ASCII_PUNCT or unicodedata.category(ch).startswith("P")


def normalize_answer(s: str) -> str:
    """SQuAD normalisation (see the module docstring for the two Unicode extensions)."""
    s = unicodedata.normalize("NFC", s).lower()
    s = "".join(ch for ch in s if not _is_punct(ch))
    s = _ARTICLES.sub(" ", s)
    # NFC again: dropping a character can bring a base letter and a combining mark together
    return unicodedata.normalize("NFC", " ".join(s.split()))


def _aliases(gold: str | Sequence[str]) -> list[str]:
    return [gold] if isinstance(gold, str) else list(gold)


def exact_match(prediction: str, gold: str | Sequence[str]) -> float:
    """1.0 if the normalised prediction equals any normalised alias, else 0.0."""
    p = normalize_answer(prediction)
    return float(any(p == normalize_answer(g) for g in _aliases(gold)))


def _f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    if not pred_tokens or not gold_tokens:  # SQuAD v2: both empty -> 1, one empty -> 0
        return float(pred_tokens == gold_tokens)
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, gold: str | Sequence[str]) -> float:
    """Token-multiset F1 of the normalised prediction against the best alias."""
    p = normalize_answer(prediction).split()
    return max((_f1(p, normalize_answer(g).split()) for g in _aliases(gold)), default=0.0)


def split_answers(text: str | None) -> list[str]:
    """'a1; a2; a3' -> ['a1', 'a2', 'a3'] (None or '' -> [])."""
    if text is None or not text.strip():
        return []
    return [a.strip() for a in text.split(";")]


def score_answer(prediction: str | None, gold: Sequence[Sequence[str]]) -> dict:
    """Score one task's answer string ('a1; a2; ...') against its questions' alias lists (in question
    order); `prediction=None` (no answer) scores 0. See `score_answers`."""
    return score_answers(split_answers(prediction), gold)


def score_answers(preds: Sequence[str], gold: Sequence[Sequence[str]]) -> dict:
    """Score predicted answers (already split, matched to questions by order) against alias lists.

    Returns {"em", "f1"} (means over the n questions), {"em_sum", "f1_sum"} (MEM1-style sums), and
    per-question lists "em_per_question", "f1_per_question"; missing answers score 0, extra ones are
    ignored.
    """
    if not gold:
        raise ValueError("a task has at least one question")
    em = [exact_match(preds[i], g) if i < len(preds) else 0.0 for i, g in enumerate(gold)]
    f1 = [f1_score(preds[i], g) if i < len(preds) else 0.0 for i, g in enumerate(gold)]
    n = len(gold)
    return {"em": sum(em) / n, "f1": sum(f1) / n, "em_sum": sum(em), "f1_sum": sum(f1),
            "em_per_question": em, "f1_per_question": f1, "answers_given": len(preds)}


def copy_probe(first_action: str, first_query: str, question: str) -> dict:
    """How well the model reproduces question 1 in its first call's search query (the protocol's first
    move, and what the SFT data teaches verbatim): token F1 and normalised exact match against the
    question; 0 when the first action is not a search."""
    if first_action != "search":
        return {"copy_f1": 0.0, "copy_exact": 0.0}
    return {"copy_f1": f1_score(first_query, question), "copy_exact": exact_match(first_query, question)}


def peak_context(context_lengths: Iterable[int]) -> int:
    """The most tokens held at once by any call of an episode (0 for no call). The agent passes
    |input| + |generated| per call: the context the model attends over when it emits its last token."""
    return max(context_lengths, default=0)


def dependency(segments: Iterable[tuple[int, int]]) -> float:
    """sum over generated segments of (|context| + |s|/2) * |s|, segments given as (|context|, |s|).

    Generating token k of s attends to |context| + k earlier tokens; summed over k this is
    |context| |s| + |s|(|s|-1)/2, which the paper writes (|context| + |s|/2) |s|."""
    total = 0.0
    for ctx, gen in segments:
        if ctx < 0 or gen < 0:
            raise ValueError(f"negative segment length ({ctx}, {gen})")
        total += (ctx + gen / 2) * gen
    return total
