"""Generation backends: sampling rules, stops, exact ids and log-probs (HF on CPU; CUDA and vLLM
tests are marked `gpu` and skipped without a GPU)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from agent_support import random_student, tokenizer
from memopd.agent.backends import HFBackend, Sampling, VLLMBackend, growing_cache, sample_next
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
