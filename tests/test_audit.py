"""A small alignment audit: what must hold on any model."""
import random

import pytest

from memopd.audit.alignment import action_domain, context_update_rows, state_rows, teacher_divergence
from memopd.outputs import markdown, write_table
from memopd.synthetic import RULES, random_episode


@pytest.fixture(scope="module")
def episodes():
    rng = random.Random(0)
    pool = [rng.randrange(512) for _ in range(4000)]
    return [random_episode(rng, pool, RULES[i % 5], 4, 12, (4, 16), (3, 10), task_id=f"a{i}") for i in range(5)]


def test_packed_rows_at_the_floor_and_flattening_far_above(tiny_lm, episodes):
    rows = {r["state"]: r for r in state_rows(tiny_lm, episodes, [
        "persistent_history", "independent_batched", "packed_sdpa", "packed_eager", "packed_prefix_shared",
        "corrupt_visibility", "corrupt_positions", "corrupt_both"])}
    for s in ("packed_sdpa", "packed_eager", "packed_prefix_shared"):
        assert rows[s]["max_abs_dlogp"] <= 1e-5 and rows[s]["top1_changes"] == 0 and rows[s]["false_clip_rate"] == 0
    assert rows["independent_batched"]["max_abs_dlogp"] <= 1e-5
    for s in ("persistent_history", "corrupt_visibility", "corrupt_positions", "corrupt_both"):
        assert rows[s]["max_abs_dlogp"] > 1e-3 and not rows[s]["at_floor"]
    assert rows["packed_sdpa"]["action_tokens"] == sum(len(i.output_ids) for e in episodes for i in e.invocations)


def test_teacher_divergence_is_zero_before_the_first_update(tiny_lm, episodes):
    rows = {r["invocation"]: r for r in teacher_divergence(tiny_lm, episodes)}
    assert rows["0"]["top1_agreement"] == 1.0 and rows["0"]["mean_kl"] < 1e-9
    assert rows["before_first_update"]["p99_abs_dlogp"] < 1e-5
    assert rows["after_first_update"]["p99_abs_dlogp"] > 1e-3


def test_context_updates_pass_for_every_rule(tiny_lm, episodes):
    rows = context_update_rows(tiny_lm, {RULES[i]: [episodes[i]] for i in range(5)}, ["sdpa", "prefix_shared"])
    assert len(rows) == 10 and all(r["passed"] for r in rows)


def test_tables_are_written_as_csv_and_markdown(tmp_path):
    rows = [{"state": "packed_sdpa", "max_abs_dlogp": 9.5e-7, "passed": True}]
    write_table(rows, tmp_path / "t.csv", "made by a test")
    assert (tmp_path / "t.csv").read_text().splitlines()[0] == "state,max_abs_dlogp,passed"
    assert "| packed_sdpa | 9.50e-07 | True |" in (tmp_path / "t.md").read_text()
    assert markdown(rows, "c").startswith("*c*")
    with pytest.raises(ValueError):
        write_table([], tmp_path / "e.csv", "x")


# --- action domain: the masks over y = [q, x_0, a_0, x_1, a_1, ...] ------------------------------------


def _expected_domain_masks(ep):
    """The three masks by a plain loop over the calls, independent of the packing compiler: q and x_0 are the
    prompt z_0; a token of x_t (t >= 1) is a retained copy if a recorded span covers it, else an observation."""
    exact, traj, resp = [False] * ep.prefix_len, [False] * ep.prefix_len, [False] * ep.prefix_len
    for t, inv in enumerate(ep.invocations):
        for i in range(ep.prefix_len, len(inv.input_ids)):
            kept = any(r.dst_start <= i < r.dst_start + r.length for r in inv.retained)
            exact.append(False)
            traj.append(t >= 1 and kept)
            resp.append(t >= 1)
        for _ in inv.output_ids:
            exact.append(True)
            traj.append(True)
            resp.append(True)
    return {"exact_action_mask": exact, "trajectory_mask": traj, "response_mask": resp}


def _hand_episode(retain=True):
    """q = 3 tokens; x_0 = 2; a_0 = 4; x_1 = a_0[1:3] retained + 3 observation tokens (23 repeats an id of a_0
    without being a copy); a_1 = 2; x_2 = a_1[0:1] + obs + a_0[0:2] + obs; a_2 = 3. Without `retain` the
    same lengths, all observations."""
    from memopd.records import Episode, Invocation, Retained

    q = [1, 2, 3]
    r1 = [Retained(0, 1, 3, 2)] if retain else []
    r2 = [Retained(1, 0, 3, 1), Retained(0, 0, 5, 2)] if retain else []
    x1 = [21, 22, 30, 23, 32] if retain else [33, 34, 30, 23, 32]
    x2 = [40, 50, 20, 21, 51] if retain else [52, 50, 53, 54, 51]
    return Episode("hand", 3, [
        Invocation(q + [10, 11], [20, 21, 22, 23]),
        Invocation(q + x1, [40, 41], retained=r1),
        Invocation(q + x2, [60, 61, 62], retained=r2),
    ]).validate()


def _bits(s):
    return [c == "1" for c in s.replace(" ", "")]


def test_domain_masks_on_a_hand_built_episode_position_by_position():
    from memopd.audit.alignment import domain_masks

    m = {k: v.tolist() for k, v in domain_masks(_hand_episode()).items()}
    #                        q    x_0  a_0   x_1    a_1  x_2    a_2
    assert m["exact_action_mask"] == _bits("000 00 1111 00000 11 00000 111")
    assert m["trajectory_mask"] == _bits("000 00 1111 11000 11 10110 111")  # actions + retained copies
    assert m["response_mask"] == _bits("000 00 1111 11111 11 11111 111")  # everything after z_0 = [q, x_0]
    rows = {r["mask"]: r for r in action_domain([_hand_episode()])}
    assert [rows[k]["selected_positions"] for k in ("exact_action_mask", "trajectory_mask", "response_mask")] == [
        9, 14, 19]
    assert [rows[k]["spurious_positions"] for k in ("exact_action_mask", "trajectory_mask", "response_mask")] == [
        0, 5, 10]


def test_domain_masks_match_an_independent_loop_over_the_calls(episodes):
    from memopd.audit.alignment import domain_masks

    rng = random.Random(1)
    pool = [rng.randrange(64) for _ in range(500)]  # a small vocabulary: observations often repeat action ids
    more = [random_episode(rng, pool, rule, 6, 7, (1, 9), (1, 8), task_id=rule) for rule in RULES]
    for ep in [*episodes, *more, _hand_episode(), _hand_episode(retain=False)]:
        got, want = domain_masks(ep), _expected_domain_masks(ep)
        for k in ("exact_action_mask", "trajectory_mask", "response_mask"):
            assert got[k].tolist() == want[k], (ep.task_id, k)


def test_the_prompt_z0_is_never_selected_so_x0_is_not_counted(episodes):
    from memopd.audit.alignment import domain_masks

    for ep in [*episodes, _hand_episode()]:
        m = domain_masks(ep)
        z0 = len(ep.invocations[0].input_ids)  # q and x_0 open y
        assert len(ep.invocations[0].input_ids) > ep.prefix_len  # x_0 is not empty: the check below has teeth
        assert not any(m[k][:z0].any() for k in m)
        after = sum(len(i.output_ids) for i in ep.invocations) + sum(
            len(i.input_ids) - ep.prefix_len for i in ep.invocations[1:])
        assert int(m["response_mask"].sum()) == after


def test_trajectory_mask_drops_observations_and_response_mask_keeps_them(episodes):
    """Fails if the two names are swapped: the trajectory mask adds exactly the retained copies, the response
    mask adds the copies and every observation token after the first call."""
    from memopd.audit.alignment import domain_masks

    for ep in episodes:
        m = domain_masks(ep)
        exact, traj, resp = m["exact_action_mask"], m["trajectory_mask"], m["response_mask"]
        copies = sum(r.length for inv in ep.invocations for r in inv.retained)
        observations = sum(len(i.input_ids) - ep.prefix_len for i in ep.invocations[1:]) - copies
        assert copies > 0 and observations > 0
        assert int((traj & ~exact).sum()) == copies
        assert int((resp & ~exact).sum()) == copies + observations
        assert not (exact & ~traj).any() and not (traj & ~resp).any()


def test_the_paper_ordering_exact_trajectory_response_on_episodes_with_retention(episodes):
    rows = {r["mask"]: r for r in action_domain(episodes)}
    ex, traj, resp = (rows[k] for k in ("exact_action_mask", "trajectory_mask", "response_mask"))
    assert ex["spurious_positions"] == 0 and ex["x_exact"] == 1
    assert ex["selected_positions"] < traj["selected_positions"] < resp["selected_positions"]
    assert 0 < traj["spurious_positions"] < resp["spurious_positions"]
    assert all(r["contains_exact"] for r in rows.values())
    assert all(r["selected_positions"] - r["spurious_positions"] == ex["selected_positions"] for r in rows.values())


def test_action_domain_step_states_the_ordering_and_the_paper_figures(episodes, tmp_path):
    from memopd.audit.steps import action_domain_step
    from memopd.records import save_episodes

    save_episodes(tmp_path / "with.parquet", episodes)
    rows = {r["mask"]: r for r in action_domain_step({}, str(tmp_path / "with.parquet"), str(tmp_path / "with.csv"))}
    ex, traj, resp = (rows[k]["selected_positions"] for k in ("exact_action_mask", "trajectory_mask", "response_mask"))
    md = (tmp_path / "with.md").read_text()
    caption = md.splitlines()[0]
    for cite in ("arXiv:2503.09516", "arXiv:2506.15841", "verl", "z_0 = [q, x_0]"):
        assert cite in caption
    assert f"exact < trajectory <= response holds here ({ex:,} < {traj:,} <= {resp:,})" in md
    assert "12,083" in md and "+66,830" in md and "+74,357" in md

    save_episodes(tmp_path / "without.parquet", [_hand_episode(retain=False)])
    action_domain_step({}, str(tmp_path / "without.parquet"), str(tmp_path / "without.csv"))
    md = (tmp_path / "without.md").read_text()
    assert "does NOT hold here (9 < 9 <= 19)" in md and "no response token was retained" in md


def test_packing_sweep_on_real_shaped_episodes_cut_to_t_calls(tiny_lm, episodes):
    from memopd.audit.packing_bench import run_real, truncate

    assert len(truncate(episodes[0], 2).invocations) == 2
    rows = run_real(tiny_lm, episodes, calls=[2, None], n_episodes=2, backends=["sdpa", "prefix_shared"],
                    repeats=1, log=lambda *a: None)
    assert {r["calls"] for r in rows} == {2, 4} and {r["episodes"] for r in rows} == {"real"}
    assert all(r["rce_max_abs_dlogp"] <= 1e-5 and r["token_ratio"] > 1 for r in rows)
    assert {r["path"] for r in rows} == {"independent_sequential", "independent_batched", "packed_sdpa",
                                         "packed_prefix_shared"}


def test_packing_benchmark_recomputes_layers_under_checkpointing_without_prefix_sharing(tiny_lm, episodes):
    """audit.packing.activation_checkpointing (paper scale): the timed forward+backward recomputes every decoder
    layer (autograd keeps less than half of the plain run's tensors), prefix_shared keeps its forward row only
    (its calls read the prefix KV cache that checkpointed layers drop), the other paths stay exact; the model's mode is restored."""
    import copy

    import torch

    from memopd.audit.packing_bench import measure
    from memopd.parallel import checkpoint_activations

    runs = {}
    for ckpt in (False, True):
        model = copy.deepcopy(tiny_lm)  # the shared fixture stays un-checkpointed
        if ckpt:
            checkpoint_activations(model)
        saved = [0]  # elements autograd keeps for the backward (a checkpointed layer keeps its input only)

        def keep(t, saved=saved):
            saved[0] += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            measure(model, episodes[:2], ["sdpa", "segmented"], repeats=1, kind="real", log=lambda *_: None,
                    untimed=("independent_sequential",))
        n = saved[0]
        rows = measure(model, episodes[:2], ["sdpa", "prefix_shared", "segmented"], repeats=1, kind="real",
                       log=lambda *_: None, untimed=("independent_sequential",))
        assert not model.training
        runs[ckpt] = (n, {(r["path"], r["pass"]) for r in rows}, rows)
    assert runs[True][0] < 0.5 * runs[False][0]
    assert ("packed_prefix_shared", "forward_backward") in runs[False][1]
    assert runs[True][1] == runs[False][1] - {("packed_prefix_shared", "forward_backward")}
    assert all(r["rce_max_abs_dlogp"] <= 1e-5 for r in runs[True][2])


def test_markdown_notes_follow_the_table():
    md = markdown([{"a": 1}], "cap", notes=["Finding: x."])
    assert md.splitlines()[0] == "*cap*" and md.rstrip().endswith("Finding: x.")
