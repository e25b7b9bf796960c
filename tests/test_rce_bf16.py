"""The half-precision RCE decision (rce.allowed): a correct bf16 pack passes whatever its logits' magnitude, a pack
read one position off fails at every magnitude.

Run as a script (`python tests/test_rce_bf16.py [layers]`), this file measures a correct bf16 pack and its
one-position shift on a random Qwen2 with Qwen2.5-3B's hidden size (2048, 16 heads, 2 KV heads), the head scaled
so the rows' largest logits reach |20|, |40|, |80| and |160|, and prints one JSON line per magnitude."""
from __future__ import annotations

import json
import random
import sys
from dataclasses import replace

import pytest
import torch

from memopd import rce
from memopd.packing import pack
from memopd.synthetic import random_episode


def _model(hidden: int, layers: int, heads: int, vocab: int, magnitude: float, eps):
    """A random Qwen2 whose LM head is scaled so the reference rows' largest |logit| averages `magnitude`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 8, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=8192,
                      tie_word_embeddings=False, use_sliding_window=False)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        now = rce.lm_logits(model, rce.independent_hidden(model, eps)).abs().amax(-1).mean()
        model.lm_head.weight.mul_(magnitude / now)
    return model


def _episodes(vocab: int, calls: int, prefix: int, obs: tuple, resp: tuple, seed: int = 1):
    rng = random.Random(seed)
    pool = [rng.randrange(vocab) for _ in range(20000)]
    return [random_episode(rng, pool, "summary_replacement", calls, prefix, obs, resp, task_id="e0")]


def _shifted(p):
    """The pack read one position early: each action token's logits taken where the previous token is predicted."""
    gamma = p.gamma.clone()
    gamma[p.act_mask] -= 1
    return replace(p, gamma=gamma)


def _bf16(model, eps, packs):
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as the training guard runs with train.dtype bfloat16
        return rce.rce_packs(model, eps, packs, "sdpa", dtype="bfloat16")


def test_ulps_and_allowed_tolerances_by_hand():
    """bf16 keeps 8 significand bits: spacing 2^(e - 7) in [2^e, 2^(e+1)); fp16 2^(e - 10). The allowed errors are
    the fixed tolerances up to |32| and 8 (|d logit|) / 4 (|d log p|) bf16 ulps beyond."""
    x = torch.tensor([1.0, 20.0, 31.9, 40.0, 100.0, 160.0])
    assert rce.ulp(x, "bfloat16").tolist() == [2 ** -7, 0.125, 0.125, 0.25, 0.5, 1.0]
    assert rce.ulp(torch.tensor([20.0]), "float16").tolist() == [2 ** -6]
    assert rce.ulp(torch.tensor([20.0]), "float32").tolist() == [2 ** -19]
    got = rce.allowed(x, rce.tolerances("bfloat16"), "bfloat16")
    assert got["dlogit"].tolist() == [1.0, 1.0, 1.0, 2.0, 4.0, 8.0]
    assert got["dlogp"].tolist() == [0.5, 0.5, 0.5, 1.0, 2.0, 4.0]
    assert rce.allowed(x, rce.tolerances("float32"), "float32")["dlogit"].tolist() == [1e-3] * 6


@pytest.fixture(scope="module")
def large():
    """One 4-call episode (~300 tokens) and a tiny model whose logits reach the bf16 binade [128, 256) (ulp 1)."""
    eps = _episodes(1024, 4, 40, (20, 40), (10, 20))
    return _model(256, 2, 4, 1024, 160.0, eps), eps


def test_a_correct_bf16_pack_with_large_logits_passes(large):
    """Its errors are a few ulps of 1.0: above the fixed |d logit| 1.0 / |d log p| 0.5, which would stop it on noise."""
    model, eps = large
    r = _bf16(model, eps, [pack(ep) for ep in eps])
    assert r["max_abs_logit"] >= 128 and r["passed"], r
    assert r["max_abs_dlogit"] > rce.RCE_TOLERANCES["bfloat16"]["dlogit"] or \
        r["max_abs_dlogp"] > rce.RCE_TOLERANCES["bfloat16"]["dlogp"], r


@pytest.mark.parametrize("magnitude,margin", [(1.0, 1.0), (20.0, 20.0), (160.0, 20.0)])
def test_a_pack_shifted_by_one_position_fails_at_every_magnitude(magnitude, margin):
    """Another position's logits: off by ~the logits' own size, > 20x the tolerance from |20| up. At |1| (a random
    model's scale, not a trained one's) that is ~1x the fixed bf16 bounds: fails, narrowly (fp32 sees it 1000x)."""
    eps = _episodes(1024, 4, 40, (20, 40), (10, 20))
    model = _model(256, 2, 4, 1024, magnitude, eps)
    r = _bf16(model, eps, [_shifted(pack(ep)) for ep in eps])
    assert not r["passed"] and set(r["failed_on"]) == {"dlogp", "dlogit"}, r
    assert r["dlogit_over_tol"] > margin and r["dlogp_over_tol"] > margin, r
    with pytest.raises(rce.RCEError, match=r"max \|d logit\| .* ulps of the row's largest logit"):
        raise rce.RCEError(rce.failure_message(r, "sdpa", rce.tolerances("bfloat16"), "bfloat16"))


def measure(layers: int = 2) -> list[dict]:
    """A correct bf16 pack and its one-position shift at hidden 2048 (one 6-call episode, ~1,600 tokens)."""
    torch.set_num_threads(1)
    eps, out = _episodes(4096, 6, 200, (100, 200), (40, 80)), []
    for magnitude in (20.0, 40.0, 80.0, 160.0):
        model = _model(2048, layers, 16, 4096, magnitude, eps)
        ok, bad = _bf16(model, eps, [pack(ep) for ep in eps]), _bf16(model, eps, [_shifted(pack(ep)) for ep in eps])
        u = rce.ulp(torch.tensor([ok["max_abs_logit"]]), "bfloat16").item()
        out.append({"magnitude": magnitude, "layers": layers, "pack_tokens": len(pack(eps[0])),
                    "max_abs_logit": ok["max_abs_logit"], "ulp": u, "dlogit": ok["max_abs_dlogit"],
                    "dlogp": ok["max_abs_dlogp"], "dlogit_ulps": ok["max_abs_dlogit"] / u,
                    "top1": ok["top1_agreement"], "passed": ok["passed"], "fixed_bounds_pass": ok["max_abs_dlogit"] <= 1.0
                    and ok["max_abs_dlogp"] <= 0.5, "shift_dlogit_over_tol": bad["dlogit_over_tol"],
                    "shift_dlogp_over_tol": bad["dlogp_over_tol"], "shift_passed": bad["passed"]})
        print(json.dumps(out[-1]), flush=True)
    return out


if __name__ == "__main__":
    measure(*(int(a) for a in sys.argv[1:]))
