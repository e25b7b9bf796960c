"""Generation backends: sampling rules, stops, exact ids and log-probs (HF on CPU; CUDA and vLLM
tests are marked `gpu` and skipped without a GPU)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from agent_support import random_student, tokenizer
from memopd.generation.backends import (HFBackend, Sampling, VLLMBackend, growing_cache, prefill_groups, sample_next,
                                   shared_prefix_len)
from memopd.agent.protocol import encode
from memopd.attention import independent_logits, token_logprobs
from memopd.records import Episode, Invocation

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (envs/gpu.yaml)")


def test_sampling_rules():
    g = [torch.Generator().manual_seed(i) for i in range(4)]
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    top = logits.argmax(-1)
    assert torch.equal(sample_next(logits, Sampling(temperature=0), g), top)
    assert torch.equal(sample_next(logits, Sampling(top_k=1), g), top)
    assert torch.equal(sample_next(logits, Sampling(top_p=1e-6), g), top)
    two = logits.topk(2, -1).indices
    for _ in range(20):
        s = sample_next(logits, Sampling(top_k=2), g)
        assert ((two == s[:, None]).any(-1)).all()
    with pytest.raises(ValueError):
        Sampling(top_p=0.0)


def _prompts(tok):
    return [encode(tok, "who got the first nobel prize in physics"), encode(tok, "Paris"),
            encode(tok, "the quick brown fox jumps over the lazy dog " * 3)]


def _check_exact(model, prompts, gens, tol):
    """Recorded ids/log-probs against an independent recomputation of each call."""
    eps = [Episode(str(i), 0, [Invocation(p, g.output_ids, g.logprobs)]) for i, (p, g) in enumerate(zip(prompts, gens))]
    ref = token_logprobs(independent_logits(model, eps), torch.tensor([t for g in gens for t in g.output_ids]))
    beh = torch.tensor([lp for g in gens for lp in g.logprobs])
    assert (ref.cpu().double() - beh.double()).abs().max() < tol


def test_hf_backend_seeded_batched_and_exact():
    tok, model = tokenizer(), random_student(0)
    be = HFBackend(model, tok, Sampling(max_new_tokens=12))
    prompts = _prompts(tok)
    a = be.generate(prompts, [1, 2, 3])
    assert [g.output_ids for g in a] == [g.output_ids for g in be.generate(prompts, [1, 2, 3])]
    single = [be.generate([p], [s])[0] for p, s in zip(prompts, [1, 2, 3])]  # left padding changes nothing
    assert [g.output_ids for g in a] == [g.output_ids for g in single]
    for g in a:
        assert len(g.logprobs) == len(g.output_ids) and g.stop_reason in ("stop", "eos", "length")
        last = g.output_ids[-1]
        assert (g.stop_reason == "length") == (len(g.output_ids) == 12 and last != tok.eos_token_id and last not in be.stop_ids)
    _check_exact(model, prompts, a, tol=1e-4)


@pytest.mark.parametrize("reserve", [0, 3, 64])
def test_growing_cache_is_transformers_cache_without_the_copies(reserve):
    """growing_cache returns, at every prefill and decode step, keys and values equal to the bit to
    DynamicLayer's (torch.cat) ones, also after rows leave the batch and when its buffer has to grow
    (reserve 0 and 3 < the steps). A decode step writes into the buffer it has: over 6 steps of 9 + 6 tokens the
    buffer is replaced when it is full (no room at the start: once, doubling; 3 free places: once, at the step
    after rows left) and once after rows leave the batch (DynamicLayer's batch_select_indices replaces the
    keys), never otherwise (cat: at every step). The backend's tokens and log-probs are DynamicCache's, bit for bit."""
    from transformers import DynamicCache

    tok, model = tokenizer(), random_student(0)
    g = torch.Generator().manual_seed(0)
    ids, mask = torch.randint(2, len(tok), (3, 9), generator=g), torch.ones(3, 9, dtype=torch.long)
    mask[0, :4] = 0  # a left-padded row
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    caches = [DynamicCache(config=model.config), growing_cache(model.config, reserve)]
    with torch.no_grad():
        for c in caches:
            model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, cache=c)
        buffer, grown = caches[1].layers[0]._k.data_ptr(), 0
        rows = torch.arange(3)
        for step in range(6):
            if step == 3:  # row 1 leaves the batch
                rows = torch.tensor([0, 2])
                for c in caches:
                    c.batch_select_indices(torch.tensor([0, 2]))
                mask, pos = mask[rows], pos[rows]
                buffer = caches[1].layers[0]._k.data_ptr()
            tok_ids = torch.randint(2, len(tok), (len(rows), 1), generator=g)
            mask, pos = torch.cat([mask, torch.ones_like(mask[:, :1])], -1), pos[:, -1:] + 1
            for c in caches:
                model(input_ids=tok_ids, attention_mask=mask, position_ids=pos, use_cache=True, cache=c)
            for a, b in zip(caches[0].layers, caches[1].layers):
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
            grown += caches[1].layers[0]._k.data_ptr() != buffer
            buffer = caches[1].layers[0]._k.data_ptr()
        assert grown == {0: 2, 3: 1, 64: 1}[reserve]

    prompts = _prompts(tok)
    be = HFBackend(model, tok, Sampling(max_new_tokens=12))
    a = be.generate(prompts, [1, 2, 3])
    be.make_cache = lambda config, reserve: DynamicCache(config=config)
    b = be.generate(prompts, [1, 2, 3])
    assert [x.output_ids for x in a] == [x.output_ids for x in b] and [x.logprobs for x in a] == [x.logprobs for x in b]


def test_prefill_groups_and_shared_prefix_by_hand():
    # sorted 10, 11, 12 | 50 | 95, 100: adding 50 to the first would pad 4 x 50 = 200 > 1.1 x 83 positions;
    # 95 and 50 (190 > 1.1 x 145) part, 100 joins 95 (200 <= 1.1 x 195)
    assert prefill_groups([10, 100, 12, 95, 11, 50], slack=0.1) == [[0, 4, 2], [5], [3, 1]]
    assert prefill_groups([7, 7, 7]) == [[0, 1, 2]] and prefill_groups([5]) == [[0]]
    head = list(range(100, 140))
    assert shared_prefix_len([head + [1, 2], head + [3], head[:35] + [9] * 10], least=32) == 35
    assert shared_prefix_len([head, head + [5]], least=32) == 39  # the shortest row keeps its last token
    assert shared_prefix_len([head + [1], head + [1]], least=41) == 0 and shared_prefix_len([head + [1]]) == 0


def _mixed_prompts(tok, lengths, head=40, seed=0):
    """Prompts of a common `head`-token prefix plus random tails of `lengths` tokens."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randint(100, len(tok), (head,), generator=g).tolist()
    return [common + torch.randint(100, len(tok), (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("prefill", ["sorted", "shared"])
def test_grouped_prefill_is_the_padded_one(prefill):
    """Length-sorted groups (and the common prefix run once) give the one left-padded forward's greedy tokens,
    stop reasons and, within 1e-5, log-probs (rows of 41-160 tokens: 3 groups); both agree with every call
    recomputed alone (fp32 tolerance 1e-4)."""
    tok, model = tokenizer(), random_student(0)
    prompts = _mixed_prompts(tok, [1, 90, 6, 120, 3, 60, 118])
    assert len(prefill_groups([len(q) for q in prompts])) == 3 and shared_prefix_len(prompts) == 40
    greedy = Sampling(temperature=0.0, max_new_tokens=16)
    old = HFBackend(model, tok, greedy, prefill="padded").generate(prompts, list(range(7)))
    be = HFBackend(model, tok, greedy, prefill=prefill)
    assert be._plain_cache  # the grouped path runs (a sliding-window model would keep the padded one)
    new = be.generate(prompts, list(range(7)))
    assert [g.output_ids for g in new] == [g.output_ids for g in old]
    assert [g.stop_reason for g in new] == [g.stop_reason for g in old]
    d = max(abs(a - b) for x, y in zip(new, old) for a, b in zip(x.logprobs, y.logprobs))
    assert d < 1e-5
    _check_exact(model, prompts, new, tol=1e-4)


@pytest.mark.parametrize("prefill", ["sorted", "shared"])
def test_grouped_prefill_keeps_each_rows_seed(prefill):
    """A row's sample depends on its prompt and seed only: alone, first or last of batches whose other rows
    differ in number, length and common prefix (so its group, padding and shared prefix change), it samples
    the same tokens."""
    tok, model = tokenizer(), random_student(0)
    be = HFBackend(model, tok, Sampling(temperature=1.0, top_p=0.95, max_new_tokens=12), prefill=prefill)
    mine = _mixed_prompts(tok, [30])[0]
    others = [_mixed_prompts(tok, [2, 80, 31], seed=1), _mixed_prompts(tok, [29], seed=0), _mixed_prompts(tok, [5, 7], seed=2)]
    alone = be.generate([mine], [7])[0]
    for rest in others:
        for batch, where in (([mine] + rest, 0), (rest + [mine], len(rest))):
            seeds = [100 + i for i in range(len(batch))]
            seeds[where] = 7
            got = be.generate(batch, seeds)[where]
            assert got.output_ids == alone.output_ids
            assert max(abs(a - b) for a, b in zip(got.logprobs, alone.logprobs)) < 1e-5
    other_seed = be.generate([mine], [8])[0]
    assert other_seed.output_ids != alone.output_ids  # the seed matters: the test can see a wrong generator


def test_hf_backend_stops():
    tok, model = tokenizer(), random_student(0)
    be = HFBackend(model, tok, Sampling(max_new_tokens=4), stop_strings=("</search>", "</answer>", "nobel prize"))
    assert be.stop_ids == set(encode(tok, "</search>") + encode(tok, "</answer>"))  # single tokens: checked on ids
    assert be.stop_strings == ["nobel prize"]  # several tokens: checked on the decoded tail
    assert be._stopped(encode(tok, "x </search>")) == "stop"
    assert be._stopped(encode(tok, "who got the nobel prize")) == "stop"
    assert be._stopped(encode(tok, "who got the") + [tok.eos_token_id]) == "eos"
    assert be._stopped(encode(tok, "who got the")) is None


@pytest.mark.gpu
@needs_cuda
def test_hf_backend_cuda():
    tok, model = tokenizer(), random_student(0).cuda()
    be = HFBackend(model, tok, Sampling(max_new_tokens=16))
    prompts = _prompts(tok)
    gens = be.generate(prompts, [1, 2, 3])
    assert [g.output_ids for g in gens] == [g.output_ids for g in be.generate(prompts, [1, 2, 3])]
    _check_exact(model, prompts, gens, tol=1e-3)


@pytest.mark.gpu
@needs_cuda
@needs_vllm
def test_vllm_backend(tmp_path):
    tok, model = tokenizer(), random_student(0)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    be = VLLMBackend(str(tmp_path), tok, Sampling(max_new_tokens=16), dtype="float32", seed=0,
                     gpu_memory_utilization=0.3, max_model_len=512)
    prompts = _prompts(tok)
    gens = be.generate(prompts, [1, 2, 3])
    assert [g.output_ids for g in gens] == [g.output_ids for g in be.generate(prompts, [1, 2, 3])]  # seeded
    for g in gens:
        assert len(g.logprobs) == len(g.output_ids) and g.stop_reason in ("stop", "eos", "length")
        if g.stop_reason == "eos":
            assert g.output_ids[-1] == tok.eos_token_id
    _check_exact(model, prompts, gens, tol=5e-2)  # different kernels: a figure, loosely bounded


def test_bench_eval_on_real_episodes():
    """`memopd bench eval`'s work on real episodes: the rollout loop with the real BM25 retriever, each path's
    outcome the episodes' own call outputs, identical greedy outputs across paths."""
    from agent_support import nq_tasks, retriever
    from memopd.evaluation import bench as eval_bench
    from memopd.agent.rollout import rollout
    from memopd.config import AgentConfig

    tok, model = tokenizer(), random_student(0)
    tasks = nq_tasks(3, n_questions=2)
    agent = AgentConfig(max_observation_tokens=48, turns={"default": 3}, batch_size=3, invalid_action="continue")
    greedy = Sampling(temperature=0.0, max_new_tokens=8)
    rows = eval_bench.run(model, tok, eval_bench.episodes_work(tasks, tok, retriever(), agent), greedy,
                          paths=("padded", "shared"), repeats=1, log=lambda line: None)
    assert [r.path for r in rows] == ["padded", "shared"] and all(r.identical for r in rows)
    eps = rollout(tasks, HFBackend(model, tok, greedy, prefill="padded"), tok, retriever(), agent, progress=False)
    assert sum(len(e.invocations) for e in eps) == 9  # 3 calls each: prompts of several lengths were compared
    assert 0 < rows[1].max_abs_dlogp < 1e-5  # grouped forwards round differently, and by little
