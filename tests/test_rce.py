"""RCE: every exact backend reproduces independent calls; negative controls fail by a wide margin."""
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memopd.attention import (BACKENDS, attn_impl, dense_mask, independent_hidden, independent_logits, lm_logits,
                              packed_hidden, packed_logits, token_logprobs)
from memopd.packing import corrupt, flatten_persistent, pack
from memopd.rce import RCEError, guard, rce_report
from memopd.synthetic import RULES, random_episode

TOL = 1e-5  # fp32
WIDE = 1e-3  # a negative control must miss by at least 100x the fp32 tolerance
CPU_BACKENDS = [b for b in BACKENDS if b != "flex"]  # flex: its own test (compilation per shape)


def _episodes(seed, rule, n_calls=4, n=2):
    rng = random.Random(seed)
    pool = [rng.randrange(512) for _ in range(4000)]
    return [random_episode(rng, pool, rule, n_calls, rng.randint(1, 24), (1, 20), (1, 12), task_id=f"{rule}{i}")
            for i in range(n)]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), rule=st.sampled_from(RULES), n_calls=st.integers(1, 6))
def test_rce_holds_for_random_episodes_and_rewrites(tiny_lm, seed, rule, n_calls):
    eps = _episodes(seed, rule, n_calls)
    report = rce_report(tiny_lm, eps, CPU_BACKENDS, dtype="float32")
    for name, r in report["backends"].items():
        assert r["max_abs_dlogp"] <= TOL, (name, r["max_abs_dlogp"])
        assert r["top1_agreement"] == 1.0, name
        assert r["action_tokens"] == sum(len(i.output_ids) for e in eps for i in e.invocations)


def test_several_episodes_in_one_pack_are_exact(tiny_lm):
    eps = _episodes(7, "sliding_window", 5, n=3)
    p = pack(eps)
    with torch.no_grad():
        ref = token_logprobs(independent_logits(tiny_lm, eps), p.targets)
        for b in CPU_BACKENDS:
            assert (token_logprobs(packed_logits(tiny_lm, p, b), p.targets) - ref).abs().max() <= TOL, b


def test_flex_attention_forward_is_exact(tiny_lm):
    eps = _episodes(11, "retrieval_refresh", 5)
    r = rce_report(tiny_lm, eps, ["flex"])["backends"]["flex"]
    assert r["max_abs_dlogp"] <= TOL and r["top1_agreement"] == 1.0


def _sum_logprob_grads(model, fn):
    model.zero_grad(set_to_none=True)
    fn().sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), rule=st.sampled_from(RULES))
def test_gradients_match_independent_calls(tiny_lm, seed, rule):
    eps = _episodes(seed, rule, 4)
    p = pack(eps)
    ref = _sum_logprob_grads(tiny_lm, lambda: token_logprobs(independent_logits(tiny_lm, eps), p.targets))
    for b in CPU_BACKENDS:
        got = _sum_logprob_grads(tiny_lm, lambda: token_logprobs(packed_logits(tiny_lm, p, b), p.targets))
        assert got.keys() == ref.keys()
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], atol=1e-4, rtol=1e-4, msg=f"{b}: {n}")


# --- negative controls: each must fail RCE by a wide margin ---------------------------------------

def _dlogp(model, eps, packed, backend="sdpa"):
    with torch.no_grad():
        ref = token_logprobs(independent_logits(model, eps), packed.targets)
        return (token_logprobs(packed_logits(model, packed, backend), packed.targets) - ref).abs()


@pytest.mark.parametrize("rule", RULES)
def test_persistent_history_fails(tiny_lm, rule):
    eps = _episodes(3, rule, 4, n=1)
    assert _dlogp(tiny_lm, eps, flatten_persistent(eps)).max() > WIDE


@pytest.mark.parametrize("visibility, positions", [(True, False), (False, True), (True, True)])
def test_leaking_mask_and_running_positions_fail(tiny_lm, visibility, positions):
    eps = _episodes(5, "full_retention", 4, n=1)
    assert _dlogp(tiny_lm, eps, corrupt(pack(eps), visibility, positions)).max() > WIDE


def test_position_ids_without_a_mask_cut_the_prefix_off_later_calls(tiny_lm):
    eps = _episodes(9, "summary_replacement", 4, n=1)
    p = pack(eps)
    d = _dlogp(tiny_lm, eps, p, backend="posids_no_mask")
    first_call = p.call[p.action_index] == 0
    assert d[first_call].max() <= TOL  # q + call 0 is one contiguous run of positions: unharmed
    assert d[~first_call].max() > WIDE  # every later call restarts positions and loses q


def test_bool_mask_under_eager_is_silently_not_a_mask(tiny_lm):
    eps = _episodes(13, "full_retention", 4, n=1)
    p = pack(eps)
    with torch.no_grad(), attn_impl(tiny_lm, "eager"):
        h = tiny_lm.get_decoder()(input_ids=p.input_ids[None], position_ids=p.position_ids[None],
                                  attention_mask=dense_mask(p)).last_hidden_state[0, p.pred_index]
        ref = token_logprobs(independent_logits(tiny_lm, eps), p.targets)
    assert (token_logprobs(lm_logits(tiny_lm, h), p.targets) - ref).abs().max() > WIDE


def test_guard_names_the_episode_and_call(tiny_lm):
    eps = _episodes(17, "suffix_retention", 3)
    guard(tiny_lm, eps, "sdpa")  # exact: passes
    with pytest.raises(RCEError, match=r"episode \d+ task 'suffix_retention\d' call [12]"):
        guard(tiny_lm, eps, "posids_no_mask")


def test_batched_independent_calls_are_the_floor(tiny_lm):
    eps = _episodes(19, "sliding_window", 4)
    with torch.no_grad():
        a = independent_hidden(tiny_lm, eps)
        b = independent_hidden(tiny_lm, eps, batched=True)
    assert (lm_logits(tiny_lm, a) - lm_logits(tiny_lm, b)).abs().max() <= 1e-4
    assert a.shape[0] == pack(eps).targets.numel()


def test_prefix_shared_rejects_corrupted_visibility(tiny_lm):
    eps = _episodes(21, "full_retention", 2, n=1)
    with pytest.raises(ValueError, match="prefix_shared"):
        packed_hidden(tiny_lm, flatten_persistent(eps), "prefix_shared")
