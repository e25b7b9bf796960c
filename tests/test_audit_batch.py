"""`memopd audit batch`: a batch checked against the ledger of its rollout. Each planted error is found and put
down to its cause (running positions, leaked visibility, a re-tokenised call, a context copy carrying loss, a token
trained twice, engine log-probs renormalised over top-p, a numerical-only perturbation); an exact batch passes."""
from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch

from memopd.audit.adapters import BatchRow, packed_rows, read_batch
from memopd.audit.batch import audit, renormalised
from memopd.ledger import read_ledger, write_ledger
from memopd.packing import pack
from memopd.records import Episode, Invocation, flatten_history
from memopd.synthetic import RULES, random_episode
from test_sft import tiny


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = tiny(3).eval()
    return m


def _episodes():
    rng = random.Random(4)
    pool = list(range(3, 500))
    return [random_episode(rng, pool, rule, 3, 6, (3, 8), (2, 5), task_id=f"t{i}") for i, rule in enumerate(RULES)]


@torch.no_grad()
def _exact_logprobs(model, ep):
    """Each call alone, by hand: [input, action] at positions 0..n-1, the log-softmax at each action token."""
    out = []
    for inv in ep.invocations:
        ids = torch.tensor([inv.input_ids + inv.output_ids])
        lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        n = len(inv.input_ids)
        out.append([lp[n - 1 + o] for o in range(len(inv.output_ids))])
    return out


def _ledger(tmp_path, model, engine="exact", top_p=1.0, noise=0.0, eps=None):
    eps = eps or _episodes()
    rng = random.Random(9)
    for ep in eps:
        for inv, lps in zip(ep.invocations, _exact_logprobs(model, ep)):
            if engine == "top_p":
                lps = [renormalised(lp, top_p, 0) for lp in lps]
            inv.logprobs = [float(lp[t]) + rng.gauss(0, noise) for lp, t in zip(lps, inv.output_ids)]
    write_ledger(tmp_path / "ledger.jsonl", eps, {"temperature": 1.0, "top_p": top_p, "top_k": 0})
    return eps, read_ledger(tmp_path / "ledger.jsonl")[1]


def test_our_exact_packer_passes(model, tmp_path):
    eps, ledger = _ledger(tmp_path, model)
    r = audit(model, packed_rows([pack(eps[:2]), pack(eps[2:])]), ledger)
    assert r["passed"], r["findings"]
    assert r["placement"]["counts"]["exact"] == sum(len(i.output_ids) for e in eps for i in e.invocations)
    n, rep = r["numbers"]["numerical"], r["numbers"]["representation"]
    assert n["max_abs_dlogp"] < 1e-5 and rep["max_abs_dlogp"] < 1e-5 and rep["top1_changes"] == 0


@pytest.mark.parametrize("layout, cause", [("corrupt_positions", "positions"), ("corrupt_visibility", "leaked"),
                                           ("persistent", "leaked")])
def test_positions_and_visibility_are_representation_errors(model, tmp_path, layout, cause):
    eps, ledger = _ledger(tmp_path, model)
    r = audit(model, packed_rows([pack(eps, layout=layout)]), ledger)
    first_calls = sum(len(e.invocations[0].output_ids) for e in eps)  # call 0 sees only itself either way
    assert r["placement"]["counts"][cause] > 0 and r["placement"]["counts"]["exact"] >= first_calls
    assert any(cause in f for f in r["findings"]) and any("representation error" in f for f in r["findings"])
    assert r["numbers"]["numerical"]["max_abs_dlogp"] < 1e-5  # the engine's numbers are not what is wrong


def _row(eps):
    return packed_rows([pack(eps)])[0]


def test_a_retokenised_call_a_context_copy_and_a_token_twice_break_train_once(model, tmp_path):
    eps, ledger = _ledger(tmp_path, model)
    row = _row(eps)
    # a re-tokenised action: the trainer's ids for it differ from the sampled ones
    retok = replace(row, input_ids=list(row.input_ids), target_id=list(row.target_id))
    j = row.pred_index[3] + 1
    retok.input_ids[j] = retok.target_id[3] = 499 if row.input_ids[j] != 499 else 498
    r = audit(None, [retok], ledger, numbers=False)
    assert r["placement"]["counts"]["unmatched"] >= 1 and r["placement"]["untrained"] >= 1
    assert not r["placement"]["trains_once"]
    # a token trained twice
    twice = replace(row, pred_index=row.pred_index + row.pred_index[:1], target_id=row.target_id + row.target_id[:1],
                    old_logprobs=row.old_logprobs + [None])
    r = audit(None, [twice], ledger, numbers=False)
    assert r["placement"]["twice"] == 1 and any("more than once" in f for f in r["findings"])
    # a context copy carrying loss: a retained copy in a later call's context scored as if it were an action
    p = pack(eps)
    e = next(i for i, ep in enumerate(eps) if any(inv.retained for inv in ep.invocations))
    t, ret = next((t, inv.retained[0]) for t, inv in enumerate(eps[e].invocations) if inv.retained)
    where = ((p.segment == e) & (p.call == t) & (p.position_ids == ret.dst_start)).nonzero().item()
    # predicted, in call t's own state, by the token before it there (the prefix's last one when it opens the call)
    before = ((p.segment == e) & ((p.call == t) | (p.call == -1)) & (p.position_ids == ret.dst_start - 1)).nonzero()
    copy = replace(row, pred_index=row.pred_index + [before.max().item()], target_id=row.target_id + [row.input_ids[where]],
                   old_logprobs=row.old_logprobs + [None])
    r = audit(None, [copy], ledger, numbers=False)
    assert r["placement"]["counts"]["context copy"] == 1 and any("context copy" in f for f in r["findings"])


def test_renormalised_engine_logprobs_are_sampler_processing_not_noise(model, tmp_path):
    eps, ledger = _ledger(tmp_path, model, engine="top_p", top_p=0.9)
    r = audit(model, [_row(eps)], ledger)
    s, n = r["numbers"]["sampler"], r["numbers"]["numerical"]
    # exactly the renormalised values, off the full ones (the synthetic tokens outside the nucleus: left out)
    assert s["tokens"] > 20 and s["max_abs_dlogp"] < 1e-4 < n["p50_abs_dlogp"]
    assert any("sampler processing" in f for f in r["findings"])
    assert not any("representation" in f for f in r["findings"])


def test_a_numerical_perturbation_is_numerical_only(model, tmp_path):
    eps, ledger = _ledger(tmp_path, model, noise=1e-3)
    r = audit(model, [_row(eps)], ledger)
    n = r["numbers"]["numerical"]
    assert 1e-4 < n["p50_abs_dlogp"] < 1e-2 and n["false_clip_0.2"] == 0.0
    assert r["findings"] and all(f.startswith("numerical error") for f in r["findings"])
    assert r["numbers"]["representation"]["max_abs_dlogp"] < 1e-5


def _per_call(eps):
    return [(inv.input_ids, inv.output_ids) for ep in eps for inv in ep.invocations]


def test_each_frameworks_layout_one_row_per_call_is_exact(model, tmp_path):
    """Fixtures in each framework's field names (the adapters' docstring cites the files), built from our episodes
    one row per call: every loss token lands on its ledger token under the exact state."""
    eps, ledger = _ledger(tmp_path, model)
    calls = _per_call(eps)
    width = max(len(x) for x, _ in calls), max(len(a) for _, a in calls)
    verl = {"input_ids": [], "attention_mask": [], "position_ids": [], "response_mask": [], "rollout_log_probs": []}
    for x, a in calls:  # left-padded prompt, right-padded response (verl's DataProto)
        pad_l, pad_r = width[0] - len(x), width[1] - len(a)
        att = [0] * pad_l + [1] * (len(x) + len(a)) + [0] * pad_r
        verl["input_ids"].append([0] * pad_l + x + a + [0] * pad_r)
        verl["attention_mask"].append(att)
        verl["position_ids"].append([max(0, sum(att[:i + 1]) - 1) for i in range(len(att))])
        verl["response_mask"].append([1] * len(a) + [0] * pad_r)
        verl["rollout_log_probs"].append([0.0] * width[1])
    skyrl = {"prompt_token_ids": [x for x, _ in calls], "response_ids": [a for _, a in calls],
             "loss_masks": [[1] * len(a) for _, a in calls]}
    tinker = [{"model_input": {"tokens": (x + a)[:-1]},
               "loss_fn_inputs": {"target_tokens": (x + a)[1:], "mask": [0] * (len(x) - 1) + [1] * len(a)}}
              for x, a in calls]
    for fmt, data, n in (("verl", verl, len(calls)), ("skyrl", skyrl, len(calls)), ("tinker", tinker, len(calls))):
        (tmp_path / f"{fmt}.json").write_text(json.dumps(data))
        rows = read_batch(tmp_path / f"{fmt}.json", fmt)
        assert len(rows) == n
        r = audit(None, rows, ledger, numbers=False)
        c = r["placement"]["counts"]
        assert c["exact"] == sum(len(row.target_id) for row in rows) and not any(
            v for k, v in c.items() if k != "exact"), (fmt, c)


def _tinker_trajectory_to_data(calls):
    """tinker-cookbook's `trajectory_to_data` (tinker_cookbook/rl/data_processing.py at 9dfcc3a), by hand (the
    package does not resolve here): a call whose observation extends the datum so far appends to it, any other
    call starts a new datum; the input is the sequence shifted right, the targets shifted left, mask 1 on actions."""
    data, seq, mask = [], [], []

    def flush():
        data.append({"model_input": {"tokens": seq[:-1]},
                     "loss_fn_inputs": {"target_tokens": seq[1:], "mask": mask[1:]}})

    for x, a in calls:
        if seq and x[:len(seq)] == seq:
            delta = x[len(seq):]
        else:
            if seq:
                flush()
            seq, mask, delta = [], [], x
        seq, mask = seq + delta + a, mask + [0] * len(delta) + [1] * len(a)
    flush()
    return data


def _sampled_under_persistent_view(ep):
    """The episode as an agent shown its whole history would have sampled it: each call's input the earlier calls'
    inputs and responses in order (append-only), the responses unchanged."""
    ins, outs = [inv.input_ids for inv in ep.invocations], [inv.output_ids for inv in ep.invocations]
    invs = []
    for t, inv in enumerate(ep.invocations):
        ids, spans = flatten_history(ep.prefix_len, ins[:t + 1], outs[:t])
        invs.append(Invocation(ids, inv.output_ids, stop_reason="stop", retained=spans))
    return Episode(task_id=ep.task_id + "-persistent", prefix_len=ep.prefix_len, invocations=invs).validate()


def test_tinkers_merged_datums_are_exact(model, tmp_path):
    """tinker merges an append-only episode's calls into one datum and starts a new one where memory rewrites the
    context: a datum holding several calls still scores each action under its own call's state."""
    eps = _episodes()
    eps, ledger = _ledger(tmp_path, model, eps=eps + [_sampled_under_persistent_view(eps[0])])
    data = [_tinker_trajectory_to_data(_per_call([ep])) for ep in eps]
    assert len(data[-1]) == 1 < len(eps[-1].invocations)  # the append-only episode: one datum
    assert all(len(d) == len(ep.invocations) for d, ep in zip(data[:-1], eps[:-1]))  # memory rewrites: one a call
    (tmp_path / "tinker.json").write_text(json.dumps([d for ds in data for d in ds]))
    rows = read_batch(tmp_path / "tinker.json", "tinker")
    r = audit(None, rows, ledger, numbers=False)
    c = r["placement"]["counts"]
    assert c["exact"] == sum(len(inv.output_ids) for ep in eps for inv in ep.invocations), c
    assert not any(v for k, v in c.items() if k != "exact"), c


def test_trls_own_tree_packing_of_our_calls_is_exact(model, tmp_path):
    """TRL 1.16.0's AsyncGRPO packer (trl.experimental.async_grpo.packing.TreeRow, the `frameworks` extra) folds our
    calls, one sample each, into a prefix trie that shares the calls' common prefix: every trained token still lands
    on its own call's exact state, and the tree attention's log-probs equal the exact ones."""
    trl_packing = pytest.importorskip("trl.experimental.async_grpo.packing")
    eps, ledger = _ledger(tmp_path, model)
    row = trl_packing.TreeRow()
    for ep in eps[:3]:
        for inv in ep.invocations:
            ids = inv.input_ids + inv.output_ids
            row.add({"input_ids": torch.tensor(ids), "completion_mask": torch.tensor([0] * len(inv.input_ids) +
                     [1] * len(inv.output_ids)), "old_log_probs": torch.tensor([0.0] * len(inv.input_ids) +
                     inv.logprobs), "advantage": 1.0, "group_id": ep.task_id})
    packed = {k: v.tolist() for k, v in row.pack().items()}
    assert len(packed["input_ids"]) < sum(len(i.input_ids) + len(i.output_ids) for e in eps[:3] for i in e.invocations)
    (tmp_path / "trl.json").write_text(json.dumps([packed]))
    rows = read_batch(tmp_path / "trl.json", "trl")
    sub = read_ledger(tmp_path / "ledger.jsonl")[1][:3]
    r = audit(model, rows, sub)
    assert r["placement"]["counts"]["exact"] == sum(len(i.output_ids) for e in eps[:3] for i in e.invocations)
    assert r["passed"], r["findings"]
    assert r["numbers"]["representation"]["max_abs_dlogp"] < 1e-5


def test_mem1s_stitched_episode_has_running_positions(tmp_path, model):
    """MEM1 stitches an episode's calls into one sequence, each call's tokens seeing its own state through a 2-D
    mask, but at running positions: every call after the first is scored at positions it never had."""
    eps, ledger = _ledger(tmp_path, model)
    p = pack(eps[1], layout="corrupt_positions")  # one episode, calls apart, positions running
    idx = torch.arange(len(p))
    mask = p.visible(idx[:, None], idx[None, :]).int().tolist()
    loss = [0] * len(p)
    for i in p.action_index.tolist():
        loss[i] = 1
    (tmp_path / "mem1.json").write_text(json.dumps([{"input_ids": p.input_ids.tolist(), "position_ids":
                                                     p.position_ids.tolist(), "attention_mask_4d": mask,
                                                     "loss_mask": loss}]))
    r = audit(None, read_batch(tmp_path / "mem1.json", "mem1"), ledger, numbers=False)
    c = r["placement"]["counts"]
    assert c["exact"] == len(eps[1].invocations[0].output_ids) and c["positions"] > 0


def test_a_bad_batch_is_one_clear_error(tmp_path):
    from memopd.audit.adapters import BatchFormatError

    (tmp_path / "b.json").write_text(json.dumps({"prompt_token_ids": [[1, 2]], "response_ids": [[3]]}))
    with pytest.raises(BatchFormatError, match="skyrl batch: no field 'loss_masks'"):
        read_batch(tmp_path / "b.json", "skyrl")
    (tmp_path / "b.json").write_text(json.dumps([{"input_ids": [1, 2], "position_ids": [0, 1], "pred_index": [5],
                                                 "target_id": [2]}]))
    with pytest.raises(BatchFormatError, match="row 0: pred_index 5 outside the row's 2 tokens"):
        read_batch(tmp_path / "b.json", "rows")


def test_the_cli_writes_json_markdown_and_a_figure_and_refuses_a_bad_batch(model, tmp_path, capsys):
    from memopd.cli import main
    from memopd.records import save_episodes  # noqa: F401

    eps, _ = _ledger(tmp_path, model)
    model.save_pretrained(tmp_path / "model")
    p = pack(eps, layout="persistent")
    idx = torch.arange(len(p))
    (tmp_path / "rows.json").write_text(json.dumps([{
        "input_ids": p.input_ids.tolist(), "position_ids": p.position_ids.tolist(), "pred_index": p.pred_index.tolist(),
        "target_id": p.targets.tolist(), "mask": p.visible(idx[:, None], idx[None, :]).int().tolist()}]))
    main(["audit", "batch", "--batch", str(tmp_path / "rows.json"), "--format", "rows", "--ledger",
          str(tmp_path / "ledger.jsonl"), "--model", str(tmp_path / "model"), "--out", str(tmp_path / "a.json")])
    r = json.loads((tmp_path / "a.json").read_text())
    assert not r["passed"] and r["placement"]["counts"]["leaked"] > 0
    md = (tmp_path / "a.md").read_text()
    assert "| representation |" in md and "Finding: " in md and (tmp_path / "a.png").stat().st_size > 0
    capsys.readouterr()
    (tmp_path / "bad.json").write_text(json.dumps([{"input_ids": [1]}]))
    with pytest.raises(SystemExit) as e:
        main(["audit", "batch", "--batch", str(tmp_path / "bad.json"), "--format", "trl", "--ledger",
              str(tmp_path / "ledger.jsonl"), "--out", str(tmp_path / "b.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith("memopd audit batch: trl row 0: no field 'position_ids'")
    assert not (tmp_path / "b.json").exists()


def test_certify_passes_our_packer_and_fails_the_persistent_flattening(model, tmp_path, capsys):
    from memopd.cli import main

    eps, _ = _ledger(tmp_path, model)
    model.save_pretrained(tmp_path / "model")
    common = ["--model", str(tmp_path / "model"), "--ledger", str(tmp_path / "ledger.jsonl")]
    main(["certify", "--packer", "memopd.audit.adapters:exact_packer", *common, "--out", str(tmp_path / "ok.json")])
    cert = json.loads((tmp_path / "ok.json").read_text())
    assert cert["passed"] and set(cert["ledgers"]) == {"random", "real"}
    assert cert["ledgers"]["random"]["episodes"] == 10 and cert["ledgers"]["real"]["max_abs_ratio_minus_1"] < 1e-4
    assert "certify memopd.audit.adapters:exact_packer: PASS" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["certify", "--packer", "memopd.audit.adapters:persistent_packer", *common, "--out",
              str(tmp_path / "bad.json")])
    cert = json.loads((tmp_path / "bad.json").read_text())
    assert e.value.code == 1 and not cert["passed"] and cert["ledgers"]["real"]["placement"]["counts"]["leaked"] > 0
    assert cert["ledgers"]["real"]["max_abs_ratio_minus_1"] > 1e-4  # at lr = 0 its ratios are off 1


def test_layouts_side_by_side_on_the_same_episodes(model, tmp_path):
    from memopd.cli import main
    from memopd.records import save_episodes

    eps = _episodes()[2:4]  # summary_replacement, sliding_window
    save_episodes(tmp_path / "eps.parquet", eps)
    model.save_pretrained(tmp_path / "model")
    main(["audit", "representations", "--model", str(tmp_path / "model"), "--episodes", str(tmp_path / "eps.parquet"),
          "--repeats", "2", "--out", str(tmp_path / "r.csv")])
    import csv

    with open(tmp_path / "r.csv", newline="") as f:
        rows = {r["layout"]: r for r in csv.DictReader(f)}
    actions = sum(len(i.output_ids) for e in eps for i in e.invocations)
    assert set(rows) >= {"ours", "one row per call", "persistent", "mem1 stitched"}
    for name in ("ours", "one row per call") + (("trl tree",) if "trl tree" in rows else ()):
        assert int(rows[name]["exact_tokens"]) == actions and float(rows[name]["max_abs_dlogp"]) < 1e-5, name
    assert int(rows["persistent"]["off_state_tokens"]) > 0 and int(rows["mem1 stitched"]["off_state_tokens"]) > 0
    # by hand: ours holds each prefix once, one row per call holds it in every call
    per_call = sum(len(i.input_ids) + len(i.output_ids) for e in eps for i in e.invocations)
    assert int(rows["one row per call"]["packed_tokens"]) == per_call > int(rows["ours"]["packed_tokens"])
    assert float(rows["ours"]["tokens_vs_ours"]) == 1.0 and (tmp_path / "r.md").read_text().count("Finding:") == len(rows)


def test_the_sampling_support_by_hand():
    """vLLM's order: the top_k largest, then the smallest set of those whose mass reaches top_p (the token that
    crosses it included), renormalised; by a plain loop over a small distribution."""
    import math

    probs = [0.05, 0.4, 0.1, 0.3, 0.15]
    lp = torch.tensor([math.log(p) for p in probs])
    for top_p, top_k in ((0.7, 0), (0.71, 0), (1.0, 2), (0.5, 3), (0.9, 4)):
        order = sorted(range(5), key=lambda i: -probs[i])[: top_k or 5]
        mass = sum(probs[i] for i in order)
        keep, cum = [], 0.0
        for i in order:
            if cum / mass >= top_p:
                break
            keep.append(i)
            cum += probs[i]
        total = sum(probs[i] for i in keep)
        want = [math.log(probs[i] / total) if i in keep else -math.inf for i in range(5)]
        assert renormalised(lp, top_p, top_k).tolist() == pytest.approx(want), (top_p, top_k)
