"""A small audit end to end through `memopd audit ...` on real rollouts: a student given a few seconds of
SFT (so it writes tags and memory) samples the episodes with the real HF backend and a real BM25 index,
then every table step runs on them. What is asserted must hold on any model: packed at the fp32 floor,
persistent history and every corruption far above it, the exact action mask a strict subset of the
response mask, every table written with its caption, figures as PNG."""
from __future__ import annotations

import csv
import json

import pytest

import memopd.retrieval
from agent_support import nq_tasks, protocol_student, random_student, retriever, tokenizer
from memopd.audit.alignment import domain_masks
from memopd.audit.steps import read_episodes
from memopd.cli import main
from memopd.synthetic import RULES

FLOOR = 1e-5
BACKENDS = ["sdpa", "eager", "prefix_shared"]  # flex: covered by the RCE tests (its CPU compile costs ~10 s)
AUDIT = {"model": "student", "teacher": "teacher", "benchmark": "q2_test", "episodes": 4, "rule": "full_retention",
         "rule_episodes": 2, "invalid_action": "continue", "temperature": 1.0, "max_new_tokens": 24,
         "dtype": "float32", "clip": 0.2, "backends": BACKENDS,
         "packing": {"repeats": 1, "backends": None,
                     "synthetic": {"calls": [3], "prefix_tokens": [16], "response_tokens": 6, "observation_tokens": 8,
                                   "model": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                             "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 256}},
                     "real": {"calls": [2, None], "episodes": 2}}}
CFG = {"agent": {"rule": "summary_replacement", "turns": {"default": 3}, "max_observation_tokens": 32},
       "rollout": {"backend": "hf", "dtype": "float32", "batch_size": 8, "max_new_tokens": 64, "temperature": 1.0},
       "audit": AUDIT}


def _csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


pytestmark = pytest.mark.slow  # the module fixture rolls out real audit episodes (~30 s on 2 cores)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Roll out the audit episodes (main set + one file per rule) and build every table through the CLI."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path_factory.mktemp("audit")
    for name, model in (("student", protocol_student()), ("teacher", random_student(1))):
        model.save_pretrained(d / name)
        tokenizer().save_pretrained(d / name)
    tasks = nq_tasks(4, n_questions=2, start=40, benchmark="q2_test")
    pq.write_table(pa.table({"task_id": [t.task_id for t in tasks], "questions": [t.questions for t in tasks],
                             "answers": [t.answers for t in tasks], "benchmark": [t.benchmark for t in tasks]}),
                   d / "q2_test.parquet")
    mp = pytest.MonkeyPatch()
    # the real BM25 over real passages (the audit rollout opens its index with memopd.retrieval.load_retriever)
    mp.setattr(memopd.retrieval, "load_retriever", lambda path: retriever())
    agent = ["--cfg", json.dumps(CFG), "--seed", "3", "--model", str(d / "student"), "--benchmark",
             str(d / "q2_test.parquet"), "--index", "unused"]
    try:
        main(["audit", "rollouts", *agent, "--out", str(d / "episodes.parquet")])
        for rule in RULES:
            main(["audit", "rollouts", *agent, "--rule", rule, "--limit", "2",
                  "--out", str(d / f"episodes_{rule}.parquet")])
    finally:
        mp.undo()
    cfg = ["--cfg", json.dumps(AUDIT)]
    eps = ["--episodes", str(d / "episodes.parquet")]
    t, f = d / "tables", d / "figures"
    model = ["--model", str(d / "student")]
    main(["audit", "alignment", *cfg, *model, *eps, "--out", str(t / "alignment_audit.csv")])
    main(["audit", "state-corruption", *cfg, *model, *eps, "--out", str(t / "state_corruption.csv")])
    main(["audit", "teacher-divergence", *cfg, "--teacher", str(d / "teacher"), *eps,
          "--out", str(t / "teacher_divergence.csv"), "--figure", str(f / "teacher_divergence.png")])
    main(["audit", "action-domain", *cfg, *eps, "--out", str(t / "action_domain.csv")])
    main(["audit", "context-updates", *cfg, *model, "--episodes", *[str(d / f"episodes_{r}.parquet") for r in RULES],
          "--out", str(t / "context_updates.csv")])
    main(["audit", "packing-efficiency", *cfg, *model, *eps, "--out", str(t / "packing_efficiency.csv"),
          "--figure", str(f / "packing_efficiency.png")])
    return d


def test_audit_episodes_are_real_multi_call_rollouts_with_memory(run):
    episodes, meta = read_episodes(run / "episodes.parquet")
    assert meta["episodes"] == 4 and meta["model"] == "student" and meta["rule"] == "full_retention"
    assert meta["invalid_action"] == "continue" and meta["max_new_tokens"] == 24
    assert meta["multi_call_episodes"] > 0 and meta["memory_updates"] > 0 and meta["retained_tokens"] > 0
    for rule in RULES:
        eps, m = read_episodes(run / f"episodes_{rule}.parquet")
        assert m["rule"] == rule and len(eps) == 2 and all(e.metrics["rule"] == rule for e in eps)


def test_packed_at_the_floor_persistent_far_above(run):
    rows = {r["state"]: r for r in _csv(run / "tables/alignment_audit.csv")}
    assert set(rows) == {"persistent_history", "independent_batched", *(f"packed_{b}" for b in BACKENDS)}
    for b in BACKENDS:
        r = rows[f"packed_{b}"]
        assert float(r["max_abs_dlogp"]) <= FLOOR and r["top1_changes"] == "0" and float(r["false_clip_rate"]) == 0
    assert float(rows["independent_batched"]["max_abs_dlogp"]) <= FLOOR
    assert float(rows["persistent_history"]["max_abs_dlogp"]) > 100 * FLOOR
    assert rows["persistent_history"]["at_floor"] == "False"
    md = (run / "tables/alignment_audit.md").read_text()  # ours beside the paper's figures
    assert f"p99 {float(rows['persistent_history']['p99_abs_dlogp']):.3g}" in md and "(paper, Qwen2.5-3B: p99 1.774, 651" in md
    n = sum(len(i.output_ids) for e in read_episodes(run / "episodes.parquet")[0] for i in e.invocations)
    assert all(int(r["action_tokens"]) == n and r["trajectories"] == "4" for r in rows.values())


def test_every_corruption_far_above_the_floor(run):
    rows = {r["state"]: r for r in _csv(run / "tables/state_corruption.csv")}
    assert float(rows["exact (packed_sdpa)"]["max_abs_dlogp"]) <= FLOOR
    for s in ("corrupt_visibility", "corrupt_positions", "corrupt_both"):
        assert float(rows[s]["max_abs_dlogp"]) > 100 * FLOOR, s
    # both corruptions together are the persistent-history layout
    ph = {r["state"]: r for r in _csv(run / "tables/alignment_audit.csv")}["persistent_history"]
    assert float(rows["corrupt_both"]["max_abs_dlogp"]) == pytest.approx(float(ph["max_abs_dlogp"]), rel=1e-6)
    md = (run / "tables/state_corruption.md").read_text()
    assert "Finding: the paper's ordering" in md and "260 top-1 changes, false clip rate 0.0497; here" in md


def test_exact_action_mask_is_a_strict_subset_of_the_response_mask(run):
    """exact <= trajectory (actions + retained copies) <= response (everything after z_0 = [q, x_0]); on real
    rollouts with retained memory both inclusions are strict (every later call's context has a turn hint)."""
    episodes, _ = read_episodes(run / "episodes.parquet")
    strict = False
    for ep in episodes:
        m = domain_masks(ep)
        exact, traj, resp = m["exact_action_mask"], m["trajectory_mask"], m["response_mask"]
        assert not (exact & ~traj).any() and not (traj & ~resp).any()
        assert not resp[: len(ep.invocations[0].input_ids)].any()  # the prompt z_0 is never trained
        strict |= bool((traj & ~exact).any())
    assert strict
    rows = {r["mask"]: r for r in _csv(run / "tables/action_domain.csv")}
    assert rows["exact_action_mask"]["spurious_positions"] == "0"
    assert 0 < int(rows["trajectory_mask"]["spurious_positions"]) < int(rows["response_mask"]["spurious_positions"])
    assert all(r["contains_exact"] == "True" for r in rows.values())
    assert "exact < trajectory <= response holds here" in (run / "tables/action_domain.md").read_text()


def test_teacher_divergence_only_after_the_first_update(run):
    rows = {r["invocation"]: r for r in _csv(run / "tables/teacher_divergence.csv")}
    assert float(rows["0"]["p99_abs_dlogp"]) < FLOOR and float(rows["0"]["top1_agreement"]) == 1.0
    assert float(rows["before_first_update"]["p99_abs_dlogp"]) < FLOOR
    assert float(rows["after_first_update"]["p99_abs_dlogp"]) > 100 * FLOOR
    md = (run / "tables/teacher_divergence.md").read_text()
    assert f"top-1 agreement {float(rows['after_first_update']['top1_agreement']):.3f}" in md
    assert "(paper, Qwen2.5-7B: top-1 agreement 0.812, p99 19.854, mean KL 0.793, 444 top-1 changes)" in md


def test_context_updates_at_the_floor_for_every_rule(run):
    rows = _csv(run / "tables/context_updates.csv")
    assert {(r["rule"], r["backend"]) for r in rows} == {(r, b) for r in RULES for b in BACKENDS}
    assert all(r["passed"] == "True" and float(r["max_abs_dlogp"]) <= FLOOR for r in rows)
    assert any(int(r["memory_updates"]) > 0 for r in rows if r["rule"] == "full_retention")
    assert "(paper: every rule at the numerical floor)" in (run / "tables/context_updates.md").read_text()


def test_packing_efficiency_real_and_synthetic_with_rce(run):
    rows = _csv(run / "tables/packing_efficiency.csv")
    assert {r["episodes"] for r in rows} == {"synthetic", "real"}
    assert {r["pass"] for r in rows} == {"forward", "forward_backward", "rce"}  # rce: the untimed paths
    assert {r["path"] for r in rows if r["pass"] == "rce"} == {"independent_sequential", "packed_eager"}
    for r in rows:
        assert float(r["rce_max_abs_dlogp"]) <= FLOOR and float(r["token_ratio"]) > 1
        if r["pass"] != "rce" and r["repeats"] != "1":  # one repeat: no interval (nan)
            assert float(r["speedup_lo"]) <= float(r["speedup_vs_batched"]) <= float(r["speedup_hi"])
    assert {r["calls"] for r in rows if r["episodes"] == "real"} >= {"2"}


def test_packing_efficiency_with_activation_checkpointing(run, tmp_path):
    """audit.packing.activation_checkpointing (paper scale) reaches the real episodes' timing: prefix_shared keeps
    only its forward rows there (the synthetic sweep's own model is not checkpointed), and the caption says so."""
    cfg = {**AUDIT, "packing": {**AUDIT["packing"], "activation_checkpointing": True}}
    main(["audit", "packing-efficiency", "--cfg", json.dumps(cfg), "--model", str(run / "student"),
          "--episodes", str(run / "episodes.parquet"), "--out", str(tmp_path / "p.csv"), "--figure", str(tmp_path / "p.png")])
    rows = _csv(tmp_path / "p.csv")
    shared = {(r["episodes"], r["pass"]) for r in rows if r["path"] == "packed_prefix_shared"}
    assert shared == {("synthetic", "forward"), ("synthetic", "forward_backward"), ("real", "forward")}
    assert {(r["path"], r["pass"]) for r in rows if r["episodes"] == "real"} >= {
        ("packed_sdpa", "forward_backward"), ("independent_batched", "forward_backward")}
    assert "forward+backward with activation checkpointing (prefix_shared: forward only)" in (
        tmp_path / "p.md").read_text()


def test_the_alignment_table_rebuilds_from_what_an_archive_keeps(run, tmp_path):
    """An archive keeps the audit's rows as its table holds them, the device and the episodes' record
    (memopd.report.archived_tables): the table rebuilt from that alone is the audit's, byte for byte; the flex note
    of the caption follows the device the rows were scored on, not the machine that rebuilds them."""
    from memopd.report.archived_tables import keep_alignment, rebuild_alignment

    keep_alignment(run / "tables/alignment_audit.csv", run / "episodes.parquet", tmp_path / "archive")
    rebuild_alignment(AUDIT, tmp_path / "archive", tmp_path / "alignment_audit.csv")
    for ext in ("csv", "md"):
        assert (tmp_path / f"alignment_audit.{ext}").read_bytes() == (run / f"tables/alignment_audit.{ext}").read_bytes()
    kept = tmp_path / "archive/audit/alignment_audit.json"
    record = json.loads(kept.read_text())
    table = _csv(run / "tables/alignment_audit.csv")  # each value kept as the audit's type: bool, int, float
    assert [r["at_floor"] for r in record["rows"]] == [r["at_floor"] == "True" for r in table]
    assert [r["top1_changes"] for r in record["rows"]] == [int(r["top1_changes"]) for r in table]
    assert all(type(r["max_abs_dlogp"]) is float for r in record["rows"])
    for device, note in (("cpu", True), ("cuda", False)):
        kept.write_text(json.dumps({**record, "device": device}))
        rebuild_alignment({**AUDIT, "backends": [*BACKENDS, "flex"]}, tmp_path / "archive", tmp_path / "a.csv")
        caption = (tmp_path / "a.md").read_text().splitlines()[0]
        assert f"scored in float32 on {device} (" in caption and ("flex on CPU" in caption) == note


TABLES = ["alignment_audit", "state_corruption", "teacher_divergence", "action_domain", "context_updates",
          "packing_efficiency"]


@pytest.mark.parametrize("table", TABLES)
def test_every_table_has_csv_and_captioned_markdown(run, table):
    rows = _csv(run / f"tables/{table}.csv")
    md = (run / f"tables/{table}.md").read_text()
    caption = md.splitlines()[0]
    assert rows and caption.startswith("*") and caption.endswith("*")
    assert "student" in caption and "trajectories" in caption and "q2_test" in caption
    if table != "action_domain":  # counts only: no model, dtype or backend is involved
        assert "float32" in caption
    assert md.count("\n|") >= len(rows) + 1


@pytest.mark.parametrize("figure", ["teacher_divergence", "packing_efficiency"])
def test_figures_are_png(run, figure):
    data = (run / f"figures/{figure}.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_each_table_is_its_own_snakemake_target():
    from test_workflow import snakemake

    targets = [f"results/tables/{t}.{ext}" for t in TABLES for ext in ("csv", "md")]
    targets += ["results/figures/teacher_divergence.png", "results/figures/packing_efficiency.png"]
    for target in ("results/tables/alignment_audit.csv", "results/figures/packing_efficiency.png"):
        res = snakemake("-n", "--quiet", "rules", "--forceall", target)
        assert res.returncode == 0, res.stderr
        assert "audit_episodes" in res.stdout + res.stderr
    res = snakemake("-n", "--quiet", "rules", "--forceall", *targets)
    assert res.returncode == 0, res.stderr
    out = res.stdout + res.stderr
    for rule in ("audit_alignment", "audit_state_corruption", "audit_teacher_divergence", "audit_action_domain",
                 "audit_context_updates", "audit_packing_efficiency", "audit_rule_episodes"):
        assert rule in out
