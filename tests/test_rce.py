"""RCE: every exact backend reproduces independent calls; negative controls fail by a wide margin."""
import random
import re
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memopd import rce
from memopd.attention import (BACKENDS, attn_impl, dense_mask, independent_hidden, independent_logits, lm_logits,
                              packed_hidden, packed_logits, token_logprobs)
from memopd.packing import corrupt, flatten_persistent, pack
from memopd.rce import (RCE_TOLERANCES, RCEError, compare, gate, guard, rce_backend, rce_report, report_rows,
                        tolerances)
from memopd.synthetic import RULES, random_episode

TOL = 1e-5  # fp32
WIDE = 1e-3  # a negative control must miss by at least 100x the fp32 tolerance
CPU_BACKENDS = [b for b in BACKENDS if b != "flex"] + ["auto"]  # flex: its own test (compilation per shape)


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
        assert r["max_abs_dlogit"] <= TOL, (name, r["max_abs_dlogit"])
        assert r["passed"] and r["failed_on"] == [], name
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
    assert r["max_abs_dlogp"] <= TOL and r["max_abs_dlogit"] <= TOL and r["top1_agreement"] == 1.0 and r["passed"]


def test_auto_takes_flex_for_a_bounded_number_of_compiled_pack_lengths(tiny_lm, monkeypatch):
    """flex compiles a kernel per pack length; past the bound `auto` leaves it out for a new length (a path
    without L x L scores instead) and keeps it for a length already compiled. The compiles are counted by
    Dynamo, here on CPU with a bound of 2."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from memopd import attention
    from memopd.packing import pack

    monkeypatch.setattr(attention, "FLEX_SHAPES", 2)
    monkeypatch.setattr(attention, "_flex_lengths", set())
    torch._dynamo.reset()
    packs = [pack(_episodes(seed, "summary_replacement", 3, n=1)) for seed in (21, 22, 24, 25)]
    packs = list({len(p): p for p in packs}.values())[:3]  # three lengths
    assert len({len(p) for p in packs}) == 3
    paths = ["segmented", "prefix_shared", "calls", "flex", "sdpa"]
    graphs = counters["stats"]["unique_graphs"]
    for p in packs[:2]:
        assert attention.bounded(paths, len(p)) == paths  # under the bound: flex stays a candidate
        with torch.no_grad():
            attention.packed_logits(tiny_lm, p, "flex")
    assert counters["stats"]["unique_graphs"] - graphs >= 2  # a compile per new length
    assert "flex" not in attention.bounded(paths, len(packs[2])) and attention.bounded(paths, len(packs[0])) == paths


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
    with pytest.raises(RCEError, match=r"episode \d+ task 'suffix_retention\d' call [12]") as e:
        guard(tiny_lm, eps, "posids_no_mask")
    # a structural error moves both: the message names each quantity with its value and tolerance
    worst = r" \(worst: episode \d+ task 'suffix_retention\d' call [12]\)"
    assert re.search(r"max \|d log p\| [\d.e+-]+ > 0\.0001" + worst, str(e.value)), str(e.value)
    assert re.search(r"max \|d logit\| [\d.e+-]+ > 0\.001" + worst, str(e.value)), str(e.value)


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


# --- the gate: full-vocabulary max |d logit| AND max |d log p| of the sampled token -------------------

def _swapped_logits(n=6, v=32, delta=1e-2, seed=0):
    """(ref, packed, targets): packed swaps two non-target logits that differ by `delta` in every row, so the
    softmax normaliser, hence every sampled token's log-prob, is unchanged while two other logits move by
    `delta` (and the distribution the OPD term reads is another one)."""
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(n, v, generator=g, dtype=torch.float64) * 5
    targets = torch.randint(0, v - 2, (n,), generator=g)
    i, j = v - 2, v - 1  # never a target
    ref[:, j] = ref[:, i] + delta
    packed = ref.clone()
    packed[:, i], packed[:, j] = ref[:, j], ref[:, i]
    return ref, packed, targets


def test_other_logits_moving_fail_rce_although_the_sampled_log_probs_are_exact():
    ref, packed, targets = _swapped_logits()
    stats = compare(ref, packed, targets)
    assert stats["max_abs_dlogp"] <= 1e-6  # the sampled tokens alone look exact (log p is rounded to fp32) ...
    assert stats["max_abs_dlogit"] == pytest.approx(1e-2)  # ... the logit vector is not
    out = gate(stats, tolerances("float32"))
    assert not out["passed"] and out["failed_on"] == ["dlogit"]
    assert gate(stats, tolerances("float32", {"dlogit": 2e-2}))["passed"]  # within a looser |d logit| tolerance
    # and the converse: a sampled-token error alone fails on |d log p|
    shifted = ref.clone()
    shifted[torch.arange(len(targets)), targets] += 1e-3
    bad = gate(compare(ref, shifted, targets), {"dlogp": 1e-4, "dlogit": 1e-2})
    assert not bad["passed"] and bad["failed_on"] == ["dlogp"]
    assert gate(compare(ref, ref.clone(), targets), tolerances("float32"))["passed"]
    assert not gate({**stats, "max_abs_dlogit": float("nan")}, tolerances("float32", {"dlogit": 1.0}))["passed"]


def _one_logit_moved(real, delta=1e-2):
    """A packed_logits that returns the exact packed logits with one non-sampled logit per row (the least
    likely token) lowered by `delta`: the sampled token's log p moves by only ~p * delta (~2e-5 here)."""

    def packed_logits(model, packed, backend, index=None):
        out = real(model, packed, backend, index).clone()
        low = out.detach().clone()
        low[torch.arange(len(out)), packed.targets.to(out.device)] = float("inf")  # never the sampled token
        out[torch.arange(len(out)), low.argmin(-1)] -= delta
        return out

    return packed_logits


def test_guard_fails_on_a_logit_the_sampled_log_probs_do_not_see(tiny_lm, monkeypatch):
    eps = [replace(e, task_id=f"e{k}") for k, e in enumerate(_episodes(23, "full_retention", 3))]
    monkeypatch.setattr(rce, "packed_logits", _one_logit_moved(rce.packed_logits))
    r = rce_backend(tiny_lm, eps, "sdpa", dtype="float32")
    assert r["max_abs_dlogp"] <= 1e-4  # the sampled tokens alone pass (a gate on |d log p| only would let it through)
    assert r["max_abs_dlogit"] == pytest.approx(1e-2, rel=1e-3)
    assert not r["passed"] and r["failed_on"] == ["dlogit"]
    assert all(not c["passed"] and c["failed_on"] == ["dlogit"] for c in r["per_call"])
    with pytest.raises(RCEError, match=r"logit") as e:
        guard(tiny_lm, eps, "sdpa")
    msg = str(e.value)
    assert re.search(r"max \|d logit\| 0\.01\d* > 0\.001 \(worst: episode \d+ task 'e\d' call \d+\)", msg), msg
    assert "d log p" not in msg  # names only the quantity that failed
    rep = rce_report(tiny_lm, eps, ["sdpa"], dtype="float32")
    assert not rep["passed"] and not any(row["passed"] for row in report_rows(rep))


def test_every_report_states_the_dtype_and_both_tolerances(tiny_lm):
    eps = _episodes(31, "retrieval_refresh", 2)
    for dtype in ("float32", "bfloat16"):
        rep = rce_report(tiny_lm, eps, ["sdpa"], dtype=dtype)
        tol = RCE_TOLERANCES[dtype]
        assert rep["dtype"] == dtype and rep["passed"]
        assert rep["tolerance_dlogp"] == tol["dlogp"] and rep["tolerance_dlogit"] == tol["dlogit"]
        assert rep["tolerance"] == tol["dlogp"]  # the older single field: the |d log p| tolerance
        r = rep["backends"]["sdpa"]
        assert (r["tolerance_dlogp"], r["tolerance_dlogit"]) == (tol["dlogp"], tol["dlogit"])
        rows = report_rows(rep)
        assert len(rows) == 1 + len(r["per_call"]) and all(row["passed"] for row in rows)
        assert all((row["dtype"], row["tolerance_dlogp"], row["tolerance_dlogit"])
                   == (dtype, tol["dlogp"], tol["dlogit"]) for row in rows)
    assert RCE_TOLERANCES["float32"] == {"dlogp": 1e-4, "dlogit": 1e-3}
    assert all(t["dlogit"] >= t["dlogp"] for t in RCE_TOLERANCES.values())


def test_tolerance_overrides():
    assert tolerances("float32", 1e-3) == {"dlogp": 1e-3, "dlogit": 1e-3}  # a number: both
    assert tolerances("bfloat16", {"dlogit": 1.0}) == {"dlogp": RCE_TOLERANCES["bfloat16"]["dlogp"], "dlogit": 1.0}
    assert tolerances("float8", {"dlogp": 1e-2, "dlogit": 1e-1}) == {"dlogp": 1e-2, "dlogit": 1e-1}
    assert tolerances("float8", 0.1)["dlogit"] == 0.1
    with pytest.raises(ValueError, match="float8"):
        tolerances("float8")
    with pytest.raises(ValueError, match="logits"):
        tolerances("float32", {"logits": 1e-3})
    with pytest.raises(ValueError, match=">= 0"):
        tolerances("float32", -1.0)


def test_a_tolerance_override_reaches_the_gate(tiny_lm):
    eps = _episodes(37, "full_retention", 3)
    assert rce_report(tiny_lm, eps, ["posids_no_mask"], tolerance=100.0)["passed"]
    r = rce_report(tiny_lm, eps, ["posids_no_mask"], tolerance={"dlogp": 100.0})["backends"]["posids_no_mask"]
    assert not r["passed"] and r["failed_on"] == ["dlogit"] and r["tolerance_dlogp"] == 100.0
