"""A synthetic knowledge base for the controlled memory study: people with attributes, stated in passages.

Why this design (docs/study.md has the long version):
- Made-up names and values (syllables drawn from a seeded generator): nothing can be known without
  reading; a small model trained here from random weights has never seen them.
- People share first names or surnames, and values are shared across people: a search returns the
  right passage beside look-alikes (another person with the same surname, or the same person's other
  facts), so the answer is a span the model must pick, not the first value in the observation.
- Each passage states two facts of one person in a random order and template: the span to copy
  depends on which fact the question asks for.
- Train, dev and test questions are about disjoint people, so a test answer can only come from a
  passage read during the episode, never from weights trained on it.
- Answers have aliases ("Quenda Guild" / "Quenda"): EM and F1 are scored against all.
Composed into KB-Q2/Q8/Q16 by the benchmarks' own compose code, a task asks n such questions at once;
under `summary_replacement` every earlier observation is gone after a turn, so a Q8 answer can be given
only if the agent kept each earlier finding in its memory across every rewrite.

Outputs use the formats the loaders already read: passages as wiki18 jsonl, questions as NQ-oracle jsonl
(one file per pool: train, dev, test; each with its gold passage), plus kb.json (the people, for inspection).
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

from memopd.config import KBConfig

_ONSETS = "b d f g k l m n p r s t v z br dr gr kr tr th sh".split()
_VOWELS = "a e i o u ai ei ou".split()
_CODAS = "n l r s th k m".split() + [""] * 4


@dataclass(frozen=True)
class Attribute:
    """One kind of fact: its sentence templates ({p} the person, {v} the value) and questions."""

    name: str
    sentences: tuple[str, ...]
    questions: tuple[str, ...]
    suffixes: tuple[str, ...] = ("",)  # a value is "<word><suffix>"; with a suffix, the bare word is an alias


ATTRIBUTES = (
    Attribute("birthplace", ("{p} was born in {v}.", "{p} comes from the town of {v}."),
              ("Where was {p} born?", "Which town does {p} come from?")),
    Attribute("employer", ("{p} works for the {v}.", "{p} is employed by the {v}."),
              ("Who employs {p}?", "Which guild does {p} work for?"), (" Guild", " Company", " Works")),
    Attribute("instrument", ("{p} plays the {v}.", "{p} is a player of the {v}."),
              ("Which instrument does {p} play?", "What does {p} play?")),
    Attribute("river", ("{p} lives by the {v} river.", "The house of {p} stands on the {v} river."),
              ("Which river does {p} live by?", "On which river does {p} live?")),
)


@dataclass
class Person:
    name: str
    facts: dict[str, str] = field(default_factory=dict)  # attribute -> value
    pool: str = "train"


def _word(rng: random.Random, syllables: int) -> str:
    w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)) + rng.choice(_CODAS)
    return w.capitalize()


def _words(rng: random.Random, n: int, taken: set[str]) -> list[str]:
    """n distinct new words of 2-3 syllables (distinct from every word in `taken`, which grows)."""
    out = []
    while len(out) < n:
        w = _word(rng, rng.choice((2, 2, 3)))
        if w not in taken:
            taken.add(w)
            out.append(w)
    return out


def generate(cfg: KBConfig, seed: int) -> list[Person]:
    """The people of the knowledge base, each with one value per attribute and a pool (train/dev/test)."""
    rng, taken = random.Random(seed), set()
    firsts, lasts = _words(rng, cfg.first_names, taken), _words(rng, cfg.surnames, taken)
    values = {a.name: _words(rng, cfg.values, taken) for a in ATTRIBUTES}
    names = rng.sample([f"{f} {s}" for f in firsts for s in lasts], cfg.people)
    people = []
    for i, name in enumerate(names):
        facts = {a.name: rng.choice(values[a.name]) + rng.choice(a.suffixes) for a in ATTRIBUTES}
        people.append(Person(name, facts))
    order = list(range(cfg.people))
    rng.shuffle(order)
    n_test, n_dev = round(cfg.test_fraction * cfg.people), round(cfg.dev_fraction * cfg.people)
    for j, i in enumerate(order):
        people[i].pool = "test" if j < n_test else "dev" if j < n_test + n_dev else "train"
    return people


def aliases(attr: Attribute, value: str) -> list[str]:
    """Every accepted answer: the value, and its bare word when it carries a suffix ("Quenda Guild", "Quenda")."""
    for s in attr.suffixes:
        if s and value.endswith(s):
            return [value, value[: -len(s)]]
    return [value]


def passages(people: list[Person], seed: int) -> list[tuple[str, str]]:
    """(title, text): two passages per person, each stating two of its facts in random order and wording."""
    rng, out = random.Random(seed + 1), []
    by_name = {a.name: a for a in ATTRIBUTES}
    for p in people:
        attrs = list(by_name)
        rng.shuffle(attrs)
        for pair in (attrs[:2], attrs[2:]):
            sents = [rng.choice(by_name[a].sentences).format(p=p.name, v=p.facts[a]) for a in pair]
            out.append((p.name, " ".join(sents)))
    rng.shuffle(out)
    return out


def questions(people: list[Person], docs: list[tuple[str, str]], pool: str, seed: int) -> list[dict]:
    """One question per (person, attribute) of a pool, in the NQ oracle format: {"question", "answers":
    aliases, "ctxs": [the passage that states the fact]} (the gold passage scores retrieval recall)."""
    rng, out = random.Random(f"{seed}:{pool}"), []
    for p in people:
        if p.pool != pool:
            continue
        for a in ATTRIBUTES:
            value = p.facts[a.name]
            gold = [{"title": t, "text": x, "isgold": True} for t, x in docs if t == p.name and value in x]
            out.append({"question": rng.choice(a.questions).format(p=p.name), "answers": aliases(a, value),
                        "ctxs": gold})
    rng.shuffle(out)
    return out


def write(cfg: KBConfig, seed: int, out_dir: str | Path) -> dict:
    """Write passages.jsonl (wiki18), {train,dev,test}.jsonl (NQ-open) and kb.json under out_dir; return counts."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    people = generate(cfg, seed)
    docs = passages(people, seed)
    with open(out / "passages.jsonl", "w") as f:
        for i, (title, text) in enumerate(docs):
            f.write(json.dumps({"id": str(i), "contents": f'"{title}"\n{text}'}) + "\n")
    counts = {"people": len(people), "passages": len(docs)}
    for pool in ("train", "dev", "test"):
        qs = questions(people, docs, pool, seed)
        with open(out / f"{pool}.jsonl", "w") as f:
            f.writelines(json.dumps(q) + "\n" for q in qs)
        counts[f"{pool}_questions"] = len(qs)
    record = {"config": asdict(cfg), "seed": seed, "counts": counts, "people": [asdict(p) for p in people]}
    (out / "kb.json").write_text(json.dumps(record, indent=1) + "\n")
    return counts
