"""The chunked full-vocabulary comparisons (rce, audit.alignment, audit.packing_bench) give the statistics of the
unchunked computation, written out here (all positions at once) as the reference.
Maxima, counts and top-1 figures must be bitwise equal; p99 and means equal (the same per-token vectors).

A CPU BLAS rounds a matrix product of 1-3 rows differently from a larger one (~1 ulp), so the LM head of the
tiny model is made row-count independent here (`rowwise_head`: one row at a time) for the bitwise comparisons;
with the real head the two agree to that rounding (test_with_the_blas_head_they_agree_to_rounding)."""
import random

import pytest
import torch

from memopd import rce
from memopd.attention import independent_logits, packed_logits, token_logprobs
from memopd.audit import alignment, packing_bench
from memopd.packing import flatten_persistent, pack
from memopd.synthetic import RULES, random_episode

CHUNKS = [1, 3, 10**6]  # one row, an odd size straddling calls and packs, one chunk for everything


@pytest.fixture(autouse=True)
def rowwise_head(tiny_lm, monkeypatch):
    head = tiny_lm.get_output_embeddings()

    def forward(h):
        flat = h.reshape(-1, h.shape[-1])
        rows = [torch.nn.functional.linear(flat[i : i + 1], head.weight, head.bias) for i in range(flat.shape[0])]
        out = torch.cat(rows) if rows else flat.new_zeros(0, head.weight.shape[0])
        return out.reshape(*h.shape[:-1], head.weight.shape[0])

    monkeypatch.setattr(head, "forward", forward)


def _episodes(seed=0, n=3, calls=4):
    rng = random.Random(seed)
    pool = [rng.randrange(512) for _ in range(4000)]
    return [random_episode(rng, pool, RULES[i % 5], calls, rng.randint(3, 16), (2, 14), (2, 11), task_id=f"c{i}")
            for i in range(n)]


@pytest.fixture(scope="module")
def episodes():
    return _episodes()


# --- the unchunked reference (all positions at once) --------------------------------------------------------

def _unchunked_compare(ref_logits, logits, targets, tol=None):
    """The statistics; with fp32 tolerances `tol` (fixed: no magnitude scaling) also the largest error / tolerance."""
    ref_logits, logits = ref_logits.double(), logits.double()
    dlp = (token_logprobs(logits, targets) - token_logprobs(ref_logits, targets)).abs()
    out = {"max_abs_dlogp": dlp.max().item(), "p99_abs_dlogp": torch.quantile(dlp, 0.99).item(),
           "mean_abs_dlogp": dlp.mean().item(), "max_abs_dlogit": (logits - ref_logits).abs().max().item(),
           "top1_agreement": (logits.argmax(-1) == ref_logits.argmax(-1)).double().mean().item(),
           "action_tokens": int(targets.numel()), "max_abs_logit": ref_logits.abs().max().item()}
    if tol is not None:
        out.update(dlogp_over_tol=out["max_abs_dlogp"] / tol["dlogp"], dlogit_over_tol=out["max_abs_dlogit"] / tol["dlogit"])
    return out


@torch.no_grad()
def _unchunked_rce_backend(model, episodes, backend, tol, ref_logits, layout="exact"):
    packs = [pack(ep, layout=layout) for ep in episodes]
    logits = torch.cat([packed_logits(model, p, backend) for p in packs])
    targets = torch.cat([p.targets for p in packs])
    out = rce.gate(_unchunked_compare(ref_logits, logits, targets, tol), tol)
    calls, offset = [], 0
    for e, p in enumerate(packs):
        for _, t, m in rce._per_call(p):
            sel = m.nonzero().squeeze(-1) + offset
            calls.append({"episode": e, "task_id": episodes[e].task_id, "call": t,
                          **rce.gate(_unchunked_compare(ref_logits[sel], logits[sel], targets[sel], tol), tol)})
        offset += p.targets.numel()
    out["per_call"] = calls
    return out


def _unchunked_state_logits(model, episodes, state):
    if state == "independent_batched":
        return independent_logits(model, episodes, batched=True)
    if state.startswith("packed_"):
        return torch.cat([packed_logits(model, pack(ep), state[len("packed_"):]) for ep in episodes])
    return torch.cat([packed_logits(model, alignment.STATES[state](ep), "auto") for ep in episodes])  # as alignment


@torch.no_grad()
def _unchunked_state_rows(model, episodes, states, clip=0.2, chunk=8):
    dlp, top1 = {s: [] for s in states}, dict.fromkeys(states, 0)
    for eps in alignment._chunks(episodes, chunk):
        ref = independent_logits(model, eps).double()
        targets = alignment._targets(eps)
        ref_lp = torch.log_softmax(ref, -1).gather(-1, targets[:, None]).squeeze(-1)
        ref_top = ref.argmax(-1)
        for state in states:
            logits = _unchunked_state_logits(model, eps, state).double()
            lp = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
            dlp[state].append(lp - ref_lp)
            top1[state] += int((logits.argmax(-1) != ref_top).sum())
    out = {}
    for state in states:
        d = torch.cat(dlp[state])
        a, ratio = d.abs(), torch.exp(d)
        out[state] = {"p99_abs_dlogp": torch.quantile(a, 0.99).item(), "max_abs_dlogp": a.max().item(),
                      "mean_abs_dlogp": a.mean().item(), "top1_changes": top1[state],
                      "false_clip_rate": ((ratio < 1 - clip) | (ratio > 1 + clip)).double().mean().item(),
                      "action_tokens": int(a.numel())}
    return out


@torch.no_grad()
def _unchunked_teacher_records(teacher, episodes):
    recs = []
    for e, ep in enumerate(episodes):
        exact, flat = pack(ep), flatten_persistent(ep)
        le, lf = packed_logits(teacher, exact, "auto").double(), packed_logits(teacher, flat, "auto").double()
        targets = exact.targets
        lpe, lpf = torch.log_softmax(le, -1), torch.log_softmax(lf, -1)
        kl = (lpe.exp() * (lpe - lpf)).sum(-1)
        dlp = (lpe.gather(-1, targets[:, None]) - lpf.gather(-1, targets[:, None])).abs().squeeze(-1)
        same = le.argmax(-1) == lf.argmax(-1)
        calls = exact.call[exact.action_index]
        for j in range(targets.numel()):
            recs.append((e, int(calls[j]), bool(same[j]), float(dlp[j]), float(kl[j])))
    return recs


# --- chunked == unchunked ---------------------------------------------------------------------------------------

def _backend_results(tiny_lm, eps, backends, chunk, tol):
    rep = rce.rce_report(tiny_lm, eps, backends, dtype="float32", chunk=chunk)
    return {b: {k: v for k, v in r.items() if not k.startswith("tolerance_")} for b, r in rep["backends"].items()}


@pytest.mark.parametrize("chunk", CHUNKS)
def test_rce_report_chunked_equals_unchunked(tiny_lm, episodes, chunk):
    """Every statistic, overall and per call, for exact backends and a negative control (whose errors are large,
    so the maxima, quantiles and top-1 figures are not trivially zero)."""
    tol = rce.tolerances("float32")
    backends = ["sdpa", "prefix_shared", "posids_no_mask"]
    with torch.no_grad():
        ref = independent_logits(tiny_lm, episodes)
    want = {b: _unchunked_rce_backend(tiny_lm, episodes, b, tol, ref) for b in backends}
    got = _backend_results(tiny_lm, episodes, backends, chunk, tol)
    assert got == want
    assert got["posids_no_mask"]["max_abs_dlogit"] > 1e-3 and got["posids_no_mask"]["top1_agreement"] < 1
    assert got["sdpa"]["action_tokens"] > 3 * 7  # several chunks of 3 and 7


@pytest.mark.parametrize("layout", ["persistent", "exact"])
def test_rce_backend_chunked_equals_unchunked_on_other_layouts_and_given_reference(tiny_lm, episodes, layout):
    tol = rce.tolerances("float32")
    with torch.no_grad():
        ref = independent_logits(tiny_lm, episodes)
    want = _unchunked_rce_backend(tiny_lm, episodes, "sdpa", tol, ref, layout=layout)
    for chunk in (2, 10**6):
        for kw in ({"ref_logits": ref}, {}):
            got = rce.rce_backend(tiny_lm, episodes, "sdpa", tol, layout=layout, dtype="float32", chunk=chunk, **kw)
            assert {k: v for k, v in got.items() if not k.startswith("tolerance_")} == want, (chunk, kw.keys())


def test_the_chunked_packed_path_is_taken_and_sees_every_logit(tiny_lm, monkeypatch):
    """Packs longer than a chunk go through packed hidden states + the LM head per chunk (not packed_logits):
    a logit moved at one position of such a pack is found, in the right call."""
    eps = _episodes(3, n=2, calls=3)
    monkeypatch.setattr(rce, "packed_logits", lambda *a, **k: pytest.fail("whole-pack logits for a long pack"))
    n0 = pack(eps[0]).targets.numel()
    real = rce.lm_logits
    calls = {"n": 0}

    def moved(model, hidden):  # per chunk: the packed logits, then the reference's
        out = real(model, hidden)
        calls["n"] += 1
        if calls["n"] == 3:  # the 2nd packed chunk of episode 0 (packed, ref, packed, ref ...)
            out = out.clone()
            out[1, 0] += 0.5
        return out

    monkeypatch.setattr(rce, "lm_logits", moved)
    r = rce.rce_backend(tiny_lm, eps, "sdpa", dtype="float32", chunk=3)
    assert n0 > 3 and r["max_abs_dlogit"] == pytest.approx(0.5, rel=1e-5) and "dlogit" in r["failed_on"]
    bad = [c for c in r["per_call"] if not c["passed"]]
    assert len(bad) == 1 and bad[0]["episode"] == 0


def test_guard_chunked_passes_and_fails_as_before(tiny_lm, episodes):
    rce.guard(tiny_lm, episodes, "sdpa", chunk=3)
    with pytest.raises(rce.RCEError, match="posids_no_mask"):
        rce.guard(tiny_lm, episodes, "posids_no_mask", chunk=3)


def test_compare_chunked_equals_unchunked():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(50, 97, generator=g) * 4
    logits = ref + torch.randn(50, 97, generator=g) * 1e-2
    targets = torch.randint(0, 97, (50,), generator=g)
    want = _unchunked_compare(ref, logits, targets)
    for chunk in CHUNKS:
        assert rce.compare(ref, logits, targets, chunk=chunk) == want


@pytest.mark.parametrize("chunk", CHUNKS)
def test_state_rows_chunked_equal_unchunked(tiny_lm, episodes, chunk):
    states = ["persistent_history", "independent_batched", "packed_sdpa", "corrupt_positions"]
    want = _unchunked_state_rows(tiny_lm, episodes, states, clip=0.01, chunk=2)  # a small clip: false clips happen
    rows = alignment.state_rows(tiny_lm, episodes, states, clip=0.01, chunk=2, logit_chunk=chunk)
    got = {r["state"]: {k: r[k] for k in want[r["state"]]} for r in rows}
    assert got == want
    assert want["persistent_history"]["top1_changes"] > 0 and want["persistent_history"]["false_clip_rate"] > 0


@pytest.mark.parametrize("chunk", CHUNKS)
def test_teacher_divergence_chunked_equals_unchunked(tiny_lm, episodes, chunk):
    """Every row (mean_kl sums the per-token KLs in order, so it sees each of them)."""
    want = {r["invocation"]: r for r in _rows_from(_unchunked_teacher_records(tiny_lm, episodes), episodes)}
    rows = {r["invocation"]: r for r in alignment.teacher_divergence(tiny_lm, episodes, logit_chunk=chunk)}
    assert rows == want
    assert rows["after_first_update"]["top1_changes"] > 0 and rows["after_first_update"]["mean_kl"] > 0


def _rows_from(recs, episodes):
    """The row aggregation of teacher_divergence applied to the unchunked per-token records."""

    def row(name, sel):
        if not sel:
            return None
        d = torch.tensor([r[3] for r in sel], dtype=torch.float64)
        return {"invocation": name, "calls": len({(r[0], r[1]) for r in sel}), "action_tokens": len(sel),
                "top1_agreement": sum(r[2] for r in sel) / len(sel), "top1_changes": sum(not r[2] for r in sel),
                "p99_abs_dlogp": torch.quantile(d, 0.99).item(), "mean_kl": sum(r[4] for r in sel) / len(sel)}

    fu = {e: alignment.first_update_call(ep) for e, ep in enumerate(episodes)}
    after = [r for r in recs if fu[r[0]] is not None and r[1] >= fu[r[0]]]
    before = [r for r in recs if not (fu[r[0]] is not None and r[1] >= fu[r[0]])]
    rows = [row(str(t), [r for r in recs if r[1] == t]) for t in sorted({r[1] for r in recs})]
    return [r for r in rows + [row("before_first_update", before), row("after_first_update", after)] if r]


def test_context_update_rows_chunked_equal_unchunked(tiny_lm, episodes):
    by_rule = {RULES[i]: [episodes[i]] for i in range(2)}
    want = alignment.context_update_rows(tiny_lm, by_rule, ["sdpa", "prefix_shared"], logit_chunk=10**6)
    assert alignment.context_update_rows(tiny_lm, by_rule, ["sdpa", "prefix_shared"], logit_chunk=2) == want
    tol = rce.tolerances("float32")
    for row in want:
        eps = by_rule[row["rule"]]
        with torch.no_grad():
            ref = _unchunked_rce_backend(tiny_lm, eps, row["backend"], tol, independent_logits(tiny_lm, eps))
        assert {k: row[k] for k in ref if k in row} == {k: ref[k] for k in ref if k in row}


# --- packing benchmark: RCE error and the timed log-probs -------------------------------------------------------

@pytest.mark.parametrize("chunk", CHUNKS)
def test_packing_rce_error_chunked_equals_unchunked(tiny_lm, episodes, chunk):
    paths, targets = packing_bench._paths(tiny_lm, episodes, ["sdpa"])
    paths["posids_no_mask"] = lambda e: rce.packed_hidden(tiny_lm, pack(episodes[e]), "posids_no_mask")
    targets = torch.cat(targets)
    with torch.no_grad():
        ref_h = torch.cat([paths["independent_sequential"](e) for e in range(len(episodes))])
        ref = rce.lm_logits(tiny_lm, ref_h)
        ref_lp = token_logprobs(ref, targets)
        for name, fn in paths.items():
            h = torch.cat([fn(e) for e in range(len(episodes))])
            logits = rce.lm_logits(tiny_lm, h)
            want = ((token_logprobs(logits, targets) - ref_lp).abs().max().item(), (logits - ref).abs().max().item())
            assert packing_bench.rce_error(tiny_lm, ref_h, h, targets, chunk=chunk) == want, name


def test_chunked_token_logprobs_and_their_gradients_equal_unchunked(tiny_lm, episodes, monkeypatch):
    eps = episodes[:2]
    targets = torch.cat([pack(ep).targets for ep in eps])
    with torch.no_grad():
        want = token_logprobs(independent_logits(tiny_lm, eps), targets)
        for chunk in CHUNKS:
            assert torch.equal(rce.independent_token_logprobs(tiny_lm, eps, targets, chunk=chunk), want)

    def grads(fn):
        tiny_lm.zero_grad(set_to_none=True)
        fn().sum().backward()
        return {n: p.grad.clone() for n, p in tiny_lm.named_parameters() if p.grad is not None}

    def h():
        return rce.packed_hidden(tiny_lm, pack(eps[0]), "sdpa")

    t = pack(eps[0]).targets
    ref = grads(lambda: token_logprobs(rce.lm_logits(tiny_lm, h()), t))
    for keep in (True, False):  # logits kept, or recomputed in the backward (checkpoint)
        monkeypatch.setattr(rce, "_KEEP_LOGITS", 1 << 40 if keep else 0)
        got = grads(lambda: rce.chunked_token_logprobs(tiny_lm, h(), t, chunk=3))
        assert got.keys() == ref.keys()
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], atol=1e-6, rtol=1e-5, msg=n)
    tiny_lm.zero_grad(set_to_none=True)


def test_with_the_blas_head_they_agree_to_rounding(tiny_lm, episodes, monkeypatch):
    monkeypatch.undo()  # the real LM head (BLAS)
    tol = rce.tolerances("float32")
    with torch.no_grad():
        ref = independent_logits(tiny_lm, episodes)
    want = _unchunked_rce_backend(tiny_lm, episodes, "posids_no_mask", tol, ref)
    got = rce.rce_backend(tiny_lm, episodes, "posids_no_mask", tol, dtype="float32", chunk=3)
    for k in ("max_abs_dlogp", "p99_abs_dlogp", "mean_abs_dlogp", "max_abs_dlogit"):
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), k
    assert got["top1_agreement"] == want["top1_agreement"] and got["action_tokens"] == want["action_tokens"]


def test_chunk_spans():
    assert rce.spans(7, 3) == [(0, 2), (2, 4), (4, 7)] and rce.spans(0, 3) == [] and rce.spans(3, 5) == [(0, 3)]
    assert rce.spans(2049, 1024) == [(0, 683), (683, 1366), (1366, 2049)]
    assert all(e - s <= 10 for s, e in rce.spans(1001, 10)) and len(rce.spans(1001, 10)) == 101
    with pytest.raises(ValueError):
        rce.spans(3, 0)


def test_the_plan_reads_the_chunk_the_code_uses():
    from memopd import plan

    assert plan.COMPARE_CHUNK == rce.CHUNK
