"""Copy probe of the controlled study (docs/study.md "Status"): does a model copy the question's person into
its first search? On the first call of evaluated episodes (their real prompts), the model is fed the
scripted teacher's response '<think>Searching Q1.</think><search>' + question 1 and we count how often its
greedy next token is right, separately for the name tokens (capitalised words after the first) and for
the question's template tokens. Names occur in the question only, so a right name token is a copy.
Teacher-forced, so it sees a copy forming token by token; the free-running counterpart is the evaluation
episodes' `copy_exact` metric (memopd.metrics.copy_probe: the whole query equals the question).

    python workflow/scripts/name_copy_probe.py MODEL_DIR results/eval/MODEL/q2_test.episodes.parquet
"""
from __future__ import annotations

import argparse
import json

import pandas as pd
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

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


def count(logits_of, tok: Tokenizer, first_calls: pd.DataFrame) -> dict[str, list[int]]:
    """kind ("name" / "template") -> [right, total] greedy next tokens over question 1's tokens.
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


def probe(model_dir: str, episodes: str) -> dict:
    tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logits_of(ids):
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0]

    first = pd.read_parquet(episodes).query("call == 0")
    counts = count(logits_of, tok, first)
    return {"model": model_dir, "episodes": len(first),
            **{f"{k}_tokens_right": f"{r}/{n} = {r / max(n, 1):.2f}" for k, (r, n) in counts.items()}}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("episodes")
    args = ap.parse_args()
    print(json.dumps(probe(args.model_dir, args.episodes)))
