"""Induction probe of the controlled study (docs/study.md "Why the copy came late"): can a model copy what
it cannot have memorised? Seeded random sequences of the tokenizer's ordinary tokens, each followed by itself; we count how
often the model's greedy next token is right over the repeat (its first token excluded: nothing points to
it). A copy of corpus text can come from weights that memorised the corpus; a copy of random tokens can
come only from attention to the earlier occurrence (an induction head), the mechanism the agent needs to
put a question's unseen name into its query.

    python workflow/scripts/induction_probe.py MODEL_DIR [--sequences 64] [--length 16 96] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import random

import torch
from transformers import AutoModelForCausalLM

from memopd.models import load_tokenizer, ordinary_token_ids  # the tokens `sft.repeats` draws from


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


def probe(model_dir: str, n: int, length: tuple[int, int], seed: int) -> dict:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logits_of(ids):
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0]

    right, total = repeat_accuracy(logits_of, sequences(ordinary_token_ids(load_tokenizer(model_dir)), n, length, seed))
    return {"model": model_dir, "sequences": n, "length": list(length), "seed": seed,
            "repeat_tokens_right": f"{right}/{total} = {right / max(total, 1):.3f}"}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--length", type=int, nargs=2, default=(16, 96))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(json.dumps(probe(args.model_dir, args.sequences, tuple(args.length), args.seed)))
