"""Shared helpers of the agent tests: a tiny tokenizer and model built from data/, a real BM25 retriever
over real passages, real NQ tasks, and scripted policies that drive the real rollout loop.

Built once per test process (functools.cache): no file outside a temporary directory is written, and
nothing depends on the Snakemake outputs.
"""
from __future__ import annotations

import gzip
import itertools
import json
import tempfile
from functools import cache
from pathlib import Path

import torch

from memopd.agent.protocol import Generation
from memopd.agent.protocol import Task, encode

# One thread: on a shared 2-core machine two OpenMP threads per process spin against the other jobs and
# run 10-50x slower (measured here), while one thread stays fast.
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"


@cache
def tokenizer():
    from memopd.data import corpus_texts
    from memopd.models import train_tokenizer

    texts = list(itertools.islice(corpus_texts(DATA), 3000))
    return train_tokenizer(texts, 2048, tempfile.mkdtemp(prefix="memopd_tok_"), min_frequency=2)


# Tiny Qwen2-architecture models for unit tests (random init: a random model is the point there); the
# embedded default's student and teacher are the pretrained SmolLM2 (config models).
TINY_MODELS = {
    "student": {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "max_position_embeddings": 4096},
    "teacher": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 6, "num_attention_heads": 8,
                "num_key_value_heads": 4, "max_position_embeddings": 4096},
}


def student_arch() -> dict:
    return dict(TINY_MODELS["student"])


def random_student(seed: int = 0):
    from memopd.models import build_tiny_model

    return build_tiny_model(student_arch(), tokenizer(), seed).eval()


@cache
def oracle_records(n: int = 300) -> list[dict]:
    with gzip.open(DATA / "nq/nq-open-oracle.jsonl.gz", "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in itertools.islice(f, n)]


def nq_tasks(n_tasks: int, n_questions: int = 1, start: int = 0, benchmark: str = "") -> list[Task]:
    """Real NQ-open questions (with their alias lists), `n_questions` asked together per task."""
    recs = oracle_records()[start : start + n_tasks * n_questions]
    bench = benchmark or f"q{n_questions}"
    return [Task(f"nq{start + i}", [r["question"] for r in chunk], [r["answers"] for r in chunk], bench)
            for i, chunk in enumerate(recs[k : k + n_questions] for k in range(0, len(recs), n_questions))]


@cache
def retriever():
    """wiki-18 sample passages + the NQ oracle passages of the questions used in the tests."""
    passages = []
    with open(DATA / "wiki/wiki18_sample.jsonl", encoding="utf-8") as f:
        for line in itertools.islice(f, 400):
            rec = json.loads(line)
            title, _, text = rec["contents"].partition("\n")
            passages.append({"id": f"wiki{rec['id']}", "title": title.strip('"'), "text": text})
    for i, r in enumerate(oracle_records()):
        for j, c in enumerate(r["ctxs"][:1]):
            passages.append({"id": f"nq{i}_{j}", "title": c["title"], "text": c["text"]})
    from memopd.retrieval.bm25 import BM25Retriever

    return BM25Retriever.build({k: [p[k] for p in passages] for k in ("id", "title", "text")}, progress=False)


# --- scripted policies (they drive the real rollout loop; only the sampling is replaced). The scripted
# teacher that knows the gold answers is the library one: memopd.teachers.scripted.ScriptedTeacher.

class ListBackend:
    """Returns the given responses in order, one per generate row (use with batch_size 1)."""

    name = "list"

    def __init__(self, tok, responses: list[str], max_new_tokens: int = 10_000):
        self.tok, self.responses, self.max_new = tok, list(responses), max_new_tokens
        self.prompts: list[list[int]] = []

    def generate(self, prompts, seeds):
        out = []
        for p in prompts:
            self.prompts.append(list(p))
            ids = encode(self.tok, self.responses.pop(0))
            reason = "length" if len(ids) > self.max_new else "stop"
            out.append(Generation(ids[: self.max_new], None, reason))
        return out


@cache
def protocol_student(steps: int = 30, seed: int = 0):
    """The tiny student after a few seconds of SFT on scripted-teacher episodes (memopd.teachers.scripted), so that the real HF backend
    samples protocol-shaped responses (think blocks, searches, answers) plus some invalid ones."""
    from memopd.agent.rollout import rollout
    from memopd.config import AgentConfig
    from memopd.teachers.scripted import ScriptedTeacher

    tok = tokenizer()
    tasks = nq_tasks(24, n_questions=2, start=100)
    cfg = AgentConfig(max_observation_tokens=48, turns={"default": 4})
    eps = rollout(tasks, ScriptedTeacher(tok, tasks), tok, retriever(), cfg, progress=False)
    seqs = [(inv.input_ids + inv.output_ids, len(inv.input_ids)) for ep in eps for inv in ep.invocations]
    model = random_student(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = [seqs[int(i)] for i in torch.randint(len(seqs), (8,), generator=g)]
        L = max(len(s) for s, _ in batch)
        ids = torch.full((len(batch), L), tok.pad_token_id)
        labels = torch.full((len(batch), L), -100)
        for b, (s, n_in) in enumerate(batch):
            ids[b, : len(s)] = torch.tensor(s)
            labels[b, n_in : len(s)] = torch.tensor(s[n_in:])
        att = torch.arange(L)[None] < torch.tensor([len(s) for s, _ in batch])[:, None]
        loss = model(input_ids=ids, attention_mask=att.long(), labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def training_dir(d: Path, tasks: int, steps: int, batch_tasks: int, new_tokens: int) -> dict:
    """A training run's inputs in `d` (a protocol-speaking student, a random teacher, `tasks` Q2 training tasks, the
    retrieval index) and its config sections (the embedded default's, at this size)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    protocol_student().save_pretrained(d / "student")
    tokenizer().save_pretrained(d / "student")
    random_student(7).save_pretrained(d / "teacher")
    tokenizer().save_pretrained(d / "teacher")
    ts = nq_tasks(tasks, n_questions=2, start=40, benchmark="q2_train")
    pq.write_table(pa.table({"task_id": [t.task_id for t in ts], "questions": [t.questions for t in ts],
                             "answers": [t.answers for t in ts], "benchmark": [t.benchmark for t in ts]}),
                   d / "q2_train.parquet")
    retriever().save(d / "index")
    cfg = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    cfg = {k: cfg[k] for k in ("train", "agent", "rollout")}
    # the tiny student has 4 layers (the default's critic: 6 of SmolLM2's 30)
    cfg["train"].update(steps=steps, batch_tasks=batch_tasks, checkpoint_every=1, critic_layers=None)
    cfg["rollout"].update(max_new_tokens=new_tokens, batch_size=batch_tasks)
    cfg["agent"].update(invalid_action="continue", max_observation_tokens=48, turns={"default": 3})
    return cfg
