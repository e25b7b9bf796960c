"""`auto` and its cost model (memopd.cost): the terms count what each path really computes (checked against the
rows a decoder layer actually sees, and the mask's visible pairs), the fit recovers known weights, auto only
picks paths the pack and model allow and stays exact; the benchmark's interleaving and intervals."""
import copy
import random

import numpy as np
import pytest
import torch

from memopd import cost
from memopd.attention import (AUTO, candidates, choose_backend, dense_mask, independent_hidden,
                              model_dims, pack_shape, packed_hidden, segment_blocks)
from memopd.audit.packing_bench import TARGETS, interleaved_times, summarize
from memopd.packing import flatten_persistent, pack
from memopd.parallel import checkpoint_activations
from memopd.stats import ratio_interval
from memopd.synthetic import random_episode


def _episodes(seed=0, n=2, calls=4, prefix=(5, 30), rule="summary_replacement"):
    rng = random.Random(seed)
    pool = [rng.randrange(512) for _ in range(4000)]
    return [random_episode(rng, pool, rule, calls, rng.randint(*prefix), (1, 20), (1, 12), task_id=f"e{i}")
            for i in range(n)]


def _rows_seen(model, fn) -> int:
    """Token rows (batch x length) the first decoder layer's MLP processes while fn() runs, summed over calls."""
    seen = []
    h = model.get_decoder().layers[0].mlp.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0] * i[0].shape[1]))
    try:
        with torch.no_grad():
            fn()
    finally:
        h.remove()
    return sum(seen)


@pytest.mark.parametrize("path", ["calls", "prefix_shared", "segmented", "sdpa"])
def test_linear_term_counts_the_rows_each_path_runs(tiny_lm, path):
    dims = model_dims(tiny_lm)
    for seed in range(3):
        p = pack(_episodes(seed))
        rows = _rows_seen(tiny_lm, lambda: packed_hidden(tiny_lm, p, path))
        assert cost.features(pack_shape(p), dims, path)["lin"] == rows * 2 * dims.layers * dims.layer_params


def test_layer_params_and_width_match_the_model(tiny_lm):
    dims = model_dims(tiny_lm)
    layer = tiny_lm.get_decoder().layers[0]
    linear = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    assert dims.layer_params == linear and dims.layers == len(tiny_lm.get_decoder().layers)
    assert dims.attn_width == layer.self_attn.q_proj.out_features


def test_attention_terms_count_pairs():
    """Dense paths pay every L x L pair, flex only the visible ones (counted on the mask), calls their padded
    batch, prefix sharing q x q plus each padded call over q + its own tokens."""
    dims = cost.Dims(layers=1, layer_params=1, attn_width=1)
    eps = _episodes(3)
    p = pack(eps)
    shape = pack_shape(p)
    assert shape == [(ep.prefix_len, [len(i.input_ids) - ep.prefix_len + len(i.output_ids) for i in ep.invocations])
                     for ep in eps]
    L = len(p)
    assert cost.features(shape, dims, "sdpa")["attn"] == 4 * L * L
    assert cost.features(shape, dims, "flex")["sparse"] == 4 * int(dense_mask(p).sum())
    lens = [len(i.input_ids) + len(i.output_ids) for ep in eps for i in ep.invocations]
    assert cost.features(shape, dims, "calls")["attn"] == 4 * len(lens) * max(lens) ** 2
    ps = 0
    for ep in eps:
        own = [len(i.input_ids) - ep.prefix_len + len(i.output_ids) for i in ep.invocations]
        ps += ep.prefix_len ** 2 + len(own) * max(own) * (ep.prefix_len + max(own))
    assert cost.features(shape, dims, "prefix_shared")["attn"] == 4 * ps
    assert cost.features(shape, dims, "prefix_shared")["inv"] == 2 * len(eps)
    no_prefix = random_episode(random.Random(2), list(range(99)), "summary_replacement", 3, 0, (1, 20), (1, 12))
    for p in (pack(eps), pack([random_episode(random.Random(1), list(range(99)), "full_retention", 1, 9, 5, 4)] * 3),
              pack([no_prefix, *eps])):  # calls without a prefix: each its own causal block
        blocks = segment_blocks(p)
        over_prefix = sum(k0 != k1 for _, _, k0, k1 in blocks)  # a call block over its prefix: 2 kernels on a CPU
        assert cost.features(pack_shape(p), dims, "segmented", "cuda")["inv"] == len(blocks)
        assert cost.features(pack_shape(p), dims, "segmented", "cpu")["inv"] == len(blocks) + over_prefix


class _Copies(torch.overrides.TorchFunctionMode):
    """Elements of the prefix's keys and values copied per call: repeat_interleave along the batch (prefix sharing
    repeats its cache for every call) and keys handed to SDPA longer than their queries with `concat` (segmented
    concatenates a call's prefix keys with its own)."""

    def __init__(self, concat: bool):
        super().__init__()
        self.concat, self.elements = concat, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.Tensor.repeat_interleave and kwargs.get("dim", args[2] if len(args) > 2 else None) == 0:
            self.elements += out.numel()
        if self.concat and func is torch.nn.functional.scaled_dot_product_attention and args[1].shape[-2] > args[0].shape[-2]:
            self.elements += args[1].numel() + args[2].numel()
        return out


@pytest.mark.parametrize("path,device", [("calls", "cpu"), ("prefix_shared", "cpu"), ("segmented", "cpu"),
                                         ("segmented", "cuda"), ("sdpa", "cpu")])
def test_copy_and_decoder_terms_count_what_each_path_does(tiny_lm, path, device, monkeypatch):
    """Segmented concatenates keys where its call blocks are not fused (on a GPU; forced here on the CPU)."""
    from memopd import attention

    monkeypatch.setattr(attention, "fused_prefix_blocks", lambda d, dropout=0.0: device == "cpu")
    dims = model_dims(tiny_lm)
    assert dims.kv_width * tiny_lm.config.num_attention_heads == dims.attn_width * tiny_lm.config.num_key_value_heads
    copied = 0
    for seed in range(3):
        rng = random.Random(seed)
        eps = _episodes(seed, prefix=(0, 30)) + [
            random_episode(rng, list(range(99)), "full_retention", 1, 9, 5, 4),  # one call: one block
            random_episode(rng, list(range(99)), "summary_replacement", 3, 0, (1, 20), (1, 12))]  # no prefix
        p = pack(eps)
        calls = []
        hook = tiny_lm.get_decoder().register_forward_hook(lambda *a, calls=calls: calls.append(1))
        try:
            with torch.no_grad(), _Copies(concat=path == "segmented") as rec:
                packed_hidden(tiny_lm, p, path)
        finally:
            hook.remove()
        f = cost.features(pack_shape(p), dims, path, device)
        assert f["copy"] == rec.elements and f["dec"] == len(calls), (seed, f, rec.elements, len(calls))
        copied += rec.elements
    assert (copied > 0) == (path == "prefix_shared" or (path, device) == ("segmented", "cuda"))  # not vacuous


def test_fit_recovers_known_weights():
    rng = np.random.default_rng(0)
    true = {"lin": 3e-11, "attn": 7e-12, "inv": 2e-3}
    rows = []
    for _ in range(30):
        f = {"lin": float(rng.uniform(1e8, 1e10)), "attn": float(rng.uniform(1e7, 1e10)), "inv": float(rng.integers(1, 9))}
        rows.append({"features": f, "seconds": sum(true[k] * f[k] for k in f)})
    got = cost.fit(rows)
    for k, v in true.items():
        assert got[k] == pytest.approx(v, rel=1e-6), k


def test_choose_takes_the_cheapest_priced_candidate():
    dims = cost.Dims(layers=2, layer_params=1000, attn_width=64)
    shape = [(512, [100] * 8)]  # a long shared prefix: prefix sharing computes far fewer rows
    assert cost.choose(shape, dims, ["calls", "prefix_shared", "sdpa"], cost.FLOPS_ONLY) == "prefix_shared"
    # invocations priced high enough, one decoder call wins
    assert cost.choose(shape, dims, ["prefix_shared", "calls"], {"lin": 1e-15, "attn": 1e-15, "inv": 1.0}) == "calls"
    # flex has no price on a weight set without `sparse`: never chosen there
    assert cost.choose([(0, [4])], dims, ["flex", "sdpa"], cost.FLOPS_ONLY) == "sdpa"
    with pytest.raises(ValueError, match="no weights"):
        cost.choose(shape, dims, ["flex"], cost.FLOPS_ONLY)


def test_auto_is_exact_and_respects_layout_and_checkpointing(tiny_lm):
    eps = _episodes(5, n=3)
    p = pack(eps)
    with torch.no_grad():
        ref = independent_hidden(tiny_lm, eps)
        assert (packed_hidden(tiny_lm, p, AUTO) - ref).abs().max() <= 1e-5
        assert (packed_hidden(tiny_lm, p, "calls") - ref).abs().max() <= 1e-5
    assert candidates(tiny_lm, flatten_persistent(eps)) == ["sdpa"]  # no blocked calls, no flex on a CPU
    assert choose_backend(tiny_lm, flatten_persistent(eps)) == "sdpa"
    ck = checkpoint_activations(copy.deepcopy(tiny_lm)).train()
    assert "prefix_shared" not in candidates(ck, p) and "calls" in candidates(ck, p)
    h = packed_hidden(ck, p, AUTO)
    h.sum().backward()  # prefix sharing would fail here: checkpointed layers drop its KV cache
    assert (h.detach() - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("fused", [True, False])
def test_segmented_gradients_equal_the_calls_run_one_by_one(tiny_lm, fused, monkeypatch):
    """Segmented's call blocks (fused: two CPU flash kernels merged by log-sum-exp, with their own backward;
    else one kernel over concatenated keys) give the hidden states and parameter gradients of every call run
    alone."""
    from memopd import attention

    monkeypatch.setattr(attention, "fused_prefix_blocks", lambda device, dropout=0.0: fused)
    eps = _episodes(11, n=2, calls=4, prefix=(8, 30))
    p = pack(eps)
    assert any(k0 != k1 for _, _, k0, k1 in segment_blocks(p))  # call blocks over a prefix: the fused path runs

    def grads(fn):
        tiny_lm.zero_grad(set_to_none=True)
        h = fn()
        (h * torch.linspace(-1, 1, h.numel()).view_as(h)).sum().backward()  # weights differ per position
        return h.detach(), {n: w.grad.clone() for n, w in tiny_lm.named_parameters() if w.grad is not None}

    h, g = grads(lambda: packed_hidden(tiny_lm, p, "segmented"))
    h_ref, g_ref = grads(lambda: independent_hidden(tiny_lm, eps))
    tiny_lm.zero_grad(set_to_none=True)
    assert (h - h_ref).abs().max() <= 1e-5
    assert g.keys() == g_ref.keys()
    for n in g_ref:
        assert (g[n] - g_ref[n]).abs().max() <= 1e-5 * g_ref[n].abs().max(), n  # fp32 rounding, relative


def test_calls_reads_prefix_positions_and_refuses_unknown_ones(tiny_lm):
    eps = _episodes(7, n=2)
    p = pack(eps)
    idx = torch.arange(len(p))
    with torch.no_grad():
        whole_calls, whole_sdpa = packed_hidden(tiny_lm, p, "calls", idx), packed_hidden(tiny_lm, p, "sdpa", idx)
        whole_ps = packed_hidden(tiny_lm, p, "prefix_shared", idx)
    assert (whole_calls - whole_sdpa).abs().max() <= 1e-5 and (whole_ps - whole_sdpa).abs().max() <= 1e-5


def test_interleaving_rotates_the_order_and_times_every_repeat():
    order = []
    fns = {n: (lambda n=n: order.append(n)) for n in "abc"}
    times = interleaved_times(fns, repeats=3, warmup=1)
    assert order == list("abc" "bca" "cab" "abc")
    assert all(len(t) == 3 and all(x >= 0 for x in t) for t in times.values())


def test_interleaved_runs_report_progress_with_time_left():
    import io

    from memopd.progress import Progress

    out = io.StringIO()
    bar = Progress("layouts", 6, "runs", stream=out)
    interleaved_times({"a": lambda: None, "b": lambda: None}, repeats=2, warmup=1, progress=bar)
    lines = out.getvalue().splitlines()
    assert [ln.rsplit(", ", 2)[-2:] for ln in lines] == [["a", "warm-up"], ["b", "warm-up"], ["b", "repeat 1"],
                                                          ["a", "repeat 1"], ["a", "repeat 2"], ["b", "repeat 2"]]
    assert lines[0].startswith("layouts: 1/6 runs")
    assert lines[-1].startswith("layouts: 6/6 runs") and lines[-1].endswith("b, repeat 2") and "left" in lines[-1]


def test_ratio_interval_is_the_median_with_a_bootstrap_band():
    base, path = [2.0, 2.2, 1.9, 2.1, 2.0, 4.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    m, lo, hi = ratio_interval(base, path)
    assert m == float(np.median(np.array(base) / np.array(path)))
    assert lo <= m <= hi and 1.9 <= lo and hi <= 4.0
    assert ratio_interval([3.0] * 5, [1.5] * 5) == (2.0, 2.0, 2.0)
    assert ratio_interval(base, path) == (m, lo, hi)  # seeded


def _row(path, pass_, x, lo, R=2.0, chose=""):
    return {"episodes": "synthetic", "calls": 4, "prefix_tokens": 512, "token_ratio": R, "path": path, "pass": pass_,
            "speedup_vs_batched": x, "speedup_lo": lo, "speedup_hi": x + 0.1, "auto_chose": chose,
            "rce_max_abs_dlogp": 0.0, "rce_max_abs_dlogit": 0.0}


def test_summary_applies_the_packing_targets():
    R = 2.0
    good = [_row("packed_prefix_shared", "forward", 0.86 * R, 1.2), _row("packed_prefix_shared", "forward_backward", 0.91 * R, 1.2),
            _row("packed_auto", "forward", 0.86 * R, 1.1, chose="prefix_shared"),
            _row("packed_auto", "forward_backward", 0.9 * R, 1.1, chose="prefix_shared")]
    assert summarize(good)[-1].startswith("1 of 1")
    slow_fb = good[:3] + [_row("packed_auto", "forward_backward", 0.89 * R, 1.1)]
    assert summarize(slow_fb)[-1].startswith("0 of 1")
    low = good[:2] + [_row("packed_auto", "forward", 0.86 * R, 0.99), good[3]]
    assert summarize(low)[-1].startswith("0 of 1") and "MISS" in summarize(low)[0]
    below_r = [dict(r, token_ratio=1.5, speedup_vs_batched=1.05) for r in good]  # R < 1.75: only the lower bound
    assert summarize(below_r)[-1].startswith("1 of 1")
    assert TARGETS == {"min_lower": 1.0, "r_from": 1.75, "forward": 0.85, "forward_backward": 0.9}


def test_auto_prices_the_pass_it_runs(tiny_lm, monkeypatch):
    """Scoring (no grad) uses the forward weights, the update (grad on) the forward + backward ones."""
    p = pack(_episodes(9, n=1))
    monkeypatch.setitem(cost.WEIGHTS, ("cpu", "float32", "forward"), {"lin": 0.0, "attn": 0.0, "inv": 1.0})
    monkeypatch.setitem(cost.WEIGHTS, ("cpu", "float32", "forward_backward"), {"lin": 1.0, "attn": 0.0, "inv": 0.0})
    with torch.no_grad():
        assert choose_backend(tiny_lm, p) == "calls"  # one attention call per layer: cheapest by calls
    assert choose_backend(tiny_lm, p) == "segmented"  # fewest rows (no repeated prefix), first on the tie
