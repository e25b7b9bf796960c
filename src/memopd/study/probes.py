"""Probes of the controlled study: what a model copies.

names_probe: Copy probe of the controlled study (docs/study.md "Status"): does a model copy the question's person into
its first search? On the first call of evaluated episodes (their real prompts), the model is fed the
scripted teacher's response '<think>Searching Q1.</think><search>' + question 1 and we count how often its
greedy next token is right, separately for the name tokens (capitalised words after the first) and for
the question's template tokens. Names occur in the question only, so a right name token is a copy.
Teacher-forced, so it sees a copy forming token by token; the free-running counterpart is the evaluation
episodes' `copy_exact` metric (memopd.metrics.copy_probe: the whole query equals the question).

    memopd study probe-names MODEL_DIR results/eval/MODEL/q2_test.episodes.parquet

induction_probe: Induction probe of the controlled study (docs/study.md "Why the copy came late"): can a model copy what
it cannot have memorised? Seeded random sequences of the tokenizer's ordinary tokens, each followed by itself; we count how
often the model's greedy next token is right over the repeat (its first token excluded: nothing points to
it). A copy of corpus text can come from weights that memorised the corpus; a copy of random tokens can
come only from attention to the earlier occurrence (an induction head), the mechanism the agent needs to
put a question's unseen name into its query.

    memopd study probe-induction MODEL_DIR [--sequences 64] [--length 16 96] [--seed 0]
"""
from __future__ import annotations

import json
import random


def _greedy_logits(model_dir: str):
    """logits_of(ids) -> [len(ids), vocab] next-token logits of one sequence under the model in `model_dir`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logits_of(ids):
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0]

    return logits_of


PREFIX = "<think>Searching Q1.</think><search>"  # the scripted teacher's first response up to its query


def name_spans(question: str) -> list[tuple[int, int]]:
    """Character spans of the capitalised words after the first (the person's names)."""
    spans, pos = [], 0
    for k, word in enumerate(question.split()):
        start = question.index(word, pos)
        pos = start + len(word)
        if k > 0 and word[0].isupper():
            spans.append((start, start + len(word.rstrip("?"))))
    return spans


def count(logits_of, tok, first_calls) -> dict[str, list[int]]:
    """kind ("name" / "template") -> [right, total] greedy next tokens over question 1's tokens (`tok`: a
    tokenizers.Tokenizer; `first_calls`: the episodes' rows of call 0).
    logits_of(ids) -> [len(ids), vocab] next-token logits of a sequence."""
    counts = {"name": [0, 0], "template": [0, 0]}
    for row in first_calls.itertuples():
        question = json.loads(row.metrics)["questions"][0]
        prompt = list(row.input_ids) + tok.encode(PREFIX, add_special_tokens=False).ids
        target = tok.encode(question, add_special_tokens=False)
        greedy = logits_of(prompt + target.ids)[len(prompt) - 1: len(prompt) - 1 + len(target.ids)].argmax(-1).tolist()
        names = name_spans(question)
        for want, got, (a, b) in zip(target.ids, greedy, target.offsets):
            kind = "name" if any(a < e and b > s for s, e in names) else "template"  # a token may start at the space
            counts[kind][0] += int(want == got)
            counts[kind][1] += 1
    return counts


def names_probe(model_dir: str, episodes: str) -> dict:
    import pandas as pd
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    logits_of = _greedy_logits(model_dir)
    first = pd.read_parquet(episodes).query("call == 0")
    counts = count(logits_of, tok, first)
    return {"model": model_dir, "episodes": len(first),
            **{f"{k}_tokens_right": f"{r}/{n} = {r / max(n, 1):.2f}" for k, (r, n) in counts.items()}}



def sequences(vocab: list[int], n: int, length: tuple[int, int], seed: int) -> list[list[int]]:
    """`n` seeded random sequences of length[0]..length[1] tokens drawn uniformly from `vocab`."""
    rng = random.Random(f"induction/{seed}")
    return [[rng.choice(vocab) for _ in range(rng.randint(*length))] for _ in range(n)]


def repeat_accuracy(logits_of, seqs: list[list[int]]) -> tuple[int, int]:
    """(right, total) greedy next tokens over each sequence's repeat, the repeat's first token excluded.
    logits_of(ids) -> [len(ids), vocab] next-token logits of one sequence."""
    right = total = 0
    for s in seqs:
        n = len(s)
        greedy = logits_of(s + s)[n: 2 * n - 1].argmax(-1).tolist()  # the logit at j predicts token j + 1
        right += sum(int(g == t) for g, t in zip(greedy, s[1:]))
        total += n - 1
    return right, total


def induction_probe(model_dir: str, n: int, length: tuple[int, int], seed: int) -> dict:
    from memopd.models import load_tokenizer, ordinary_token_ids  # the tokens `sft.repeats` draws from

    logits_of = _greedy_logits(model_dir)
    right, total = repeat_accuracy(logits_of, sequences(ordinary_token_ids(load_tokenizer(model_dir)), n, length, seed))
    return {"model": model_dir, "sequences": n, "length": list(length), "seed": seed,
            "repeat_tokens_right": f"{right}/{total} = {right / max(total, 1):.3f}"}
