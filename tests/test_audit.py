"""A small alignment audit: what must hold on any model."""
import random

import pytest

from memopd.audit.alignment import action_domain, context_update_rows, state_rows, teacher_divergence
from memopd.report.tables import markdown, write_table
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


def test_exact_action_mask_is_a_strict_subset_of_the_response_mask(episodes):
    rows = {r["mask"]: r for r in action_domain(episodes)}
    assert rows["exact_action_mask"]["spurious_positions"] == 0
    assert 0 < rows["response_mask"]["spurious_positions"] < rows["trajectory_mask"]["spurious_positions"]


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


def test_domain_masks_nest_and_the_response_mask_adds_exactly_the_retained_copies(episodes):
    from memopd.audit.alignment import domain_masks

    for ep in episodes:
        m = domain_masks(ep)
        exact, resp, traj = m["exact_action_mask"], m["response_mask"], m["trajectory_mask"]
        assert not (exact & ~resp).any() and not (resp & ~traj).any()
        assert int((resp & ~exact).sum()) == sum(r.length for inv in ep.invocations for r in inv.retained) > 0
        assert int(traj.sum()) == sum(len(i.input_ids) - ep.prefix_len + len(i.output_ids) for i in ep.invocations)
    rows = {r["mask"]: r for r in action_domain(episodes)}
    assert all(r["contains_exact"] for r in rows.values()) and rows["exact_action_mask"]["x_exact"] == 1


def test_packing_sweep_on_real_shaped_episodes_cut_to_t_calls(tiny_lm, episodes):
    from memopd.audit.packing_bench import run_real, truncate

    assert len(truncate(episodes[0], 2).invocations) == 2
    rows = run_real(tiny_lm, episodes, calls=[2, None], n_episodes=2, backends=["sdpa", "prefix_shared"],
                    repeats=1, log=lambda *a: None)
    assert {r["calls"] for r in rows} == {2, 4} and {r["episodes"] for r in rows} == {"real"}
    assert all(r["rce_max_abs_dlogp"] <= 1e-5 and r["token_ratio"] > 1 for r in rows)
    assert {r["path"] for r in rows} == {"independent_sequential", "independent_batched", "packed_sdpa",
                                         "packed_prefix_shared"}


def test_markdown_notes_follow_the_table():
    md = markdown([{"a": 1}], "cap", notes=["Finding: x."])
    assert md.splitlines()[0] == "*cap*" and md.rstrip().endswith("Finding: x.")
