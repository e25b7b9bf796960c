"""The training run: real rollouts of a protocol-speaking tiny student, exact packed updates, resume."""
import copy
import json
import os
import re
import statistics

import pytest
import torch
import yaml
from safetensors.torch import load_file

from agent_support import ROOT, nq_tasks, protocol_student, random_student, retriever, tokenizer, training_dir
from memopd.config import AgentConfig, RolloutConfig
from memopd.report.results import table_rows
from memopd.train.loop import task_order, train_run
from memopd.schema import merge_files
from memopd.train.config import RunConfig, RunSections


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    cfg = training_dir(d, tasks=12, steps=3, batch_tasks=3, new_tokens=24)
    cfg["train"].update(keep_checkpoint=True)
    return d, cfg


def _run(setup, out, method="memopd", **kw):
    d, cfg = setup
    return train_run(cfg, method, 0, d / "student", d / "teacher", d / "q2_train.parquet", d / "index", out,
                     log=lambda *a: None, **kw)


def test_resume_after_an_interruption_matches_the_uninterrupted_run(setup, tmp_path):
    full = _run(setup, tmp_path / "full")
    _run(setup, tmp_path / "cut", stop_after=1)  # "killed" after one step (checkpoint written)
    assert not (tmp_path / "cut/model").exists()
    resumed = _run(setup, tmp_path / "cut")
    a, b = load_file(tmp_path / "full/model/model.safetensors"), load_file(tmp_path / "cut/model/model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    lines = [json.loads(x) for x in (tmp_path / "cut/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2] and len(resumed) == 2
    for m_full, m_cut in zip(full, lines):
        assert m_full["actor/loss"] == m_cut["actor/loss"] and m_full["reward/f1"] == m_cut["reward/f1"]
    # real multi-call episodes with memory updates were trained on, and RCE held on them
    assert max(m["rollout/calls_per_episode"] for m in full) > 1
    assert all(m["rce/max_abs_dlogp"] <= 1e-5 for m in full)
    assert all(k in full[0] for k in ("time/rollout_s", "time/score_s", "time/update_s", "opd/loss"))


def test_resume_refuses_another_runs_checkpoint_and_keeps_every_step_once(setup, tmp_path):
    """A checkpoint is resumed only by its own run: a changed config (or method) is refused before any model
    loads, naming what changed (failed before: any checkpoint/ was resumed). Its metrics come back with it:
    Snakemake deletes metrics.jsonl before it retries a job, and the resumed run's file still holds every
    step exactly once (failed before: the steps before the checkpoint were lost)."""
    from memopd.train.loop import ResumeMismatch

    d, cfg = setup
    cfg = {**cfg, "train": {**cfg["train"], "steps": 2}}
    out = tmp_path / "run"
    first = _run((d, cfg), out, stop_after=1)
    (out / "metrics.jsonl").unlink()  # what Snakemake does to the outputs of a job it retries
    changed = {**cfg, "train": {**cfg["train"], "lr_actor": 2 * cfg["train"]["lr_actor"]}}
    lr = cfg["train"]["lr_actor"]
    with pytest.raises(ResumeMismatch, match=re.escape(f"config.train.lr_actor: {lr} -> {2 * lr}")):
        _run((d, changed), out)
    with pytest.raises(ResumeMismatch, match=r"method: 'memopd' -> 'ppo'"):
        _run((d, cfg), out, method="ppo")
    weights = d / "student" / "model.safetensors"  # a student rebuilt upstream is another input
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    try:
        with pytest.raises(ResumeMismatch, match=r"student\.files\.model\.safetensors"):
            _run((d, cfg), out)
    finally:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    resumed = _run((d, cfg), out)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1] and [m["step"] for m in resumed] == [1]
    assert lines[0] == json.loads(json.dumps(first[0], sort_keys=True))
    # train.steps is not part of a run's identity (a finished run can be extended), but fewer steps than
    # the checkpoint holds would export a model trained further than asked
    with pytest.raises(ResumeMismatch, match="past train.steps 1"):
        _run((d, {**cfg, "train": {**cfg["train"], "steps": 1}}), out)


def test_a_teacher_with_another_tokenizer_is_refused_before_any_model_loads(setup, tmp_path):
    """OPD compares student and teacher id by id: the train step refuses a teacher whose tokenizer maps an
    id to another token (failed before: the run trained against it)."""
    import shutil

    from memopd.vocab import TokenizerMismatch

    d, cfg = setup
    teacher = shutil.copytree(d / "teacher", tmp_path / "teacher")
    spec = json.loads((teacher / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (teacher / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(TokenizerMismatch, match=f"tokenizers differ: id {vocab[b]}: "):
        train_run(cfg, "memopd", 0, d / "student", teacher, d / "q2_train.parquet", d / "index", tmp_path / "run",
                  log=lambda *a: None)
    assert not (tmp_path / "run").exists()  # refused before the run started


def _train_cli(setup, cfg, out, *extra):
    """`memopd train` as the rule runs it (memopd.cli.main)."""
    from memopd.cli import main

    d, _ = setup
    main(["train", "--cfg", json.dumps(cfg), "--method", "memopd", "--seed", "0", "--student", str(d / "student"),
          "--teacher", str(d / "teacher"), "--tasks", str(d / "q2_train.parquet"), "--index", str(d / "index"),
          "--out-dir", str(out), *extra])


def test_a_finished_run_deletes_its_checkpoint_unless_kept(setup, tmp_path):
    """Checkpoint retention (a paper-scale checkpoint is ~74 GB): a finished run keeps metrics.jsonl and
    model/ and deletes checkpoint/ once the model is exported (keep_checkpoint: false, both configs); an
    interrupted run keeps it, since resume needs it."""
    d, cfg = setup
    short = {**cfg, "train": {**cfg["train"], "steps": 2, "keep_checkpoint": False}}
    _train_cli(setup, short, tmp_path / "cut", "--stop-after", "1")
    assert (tmp_path / "cut/checkpoint/state.pt").exists()
    _train_cli(setup, short, tmp_path / "cut")
    assert not (tmp_path / "cut/checkpoint").exists() and (tmp_path / "cut/model/model.safetensors").exists()
    lines = [json.loads(x) for x in (tmp_path / "cut/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1]
    for name in ("config.yaml", "paper.yaml"):
        assert merge_files([ROOT / "config" / name])["train"]["keep_checkpoint"] is False


def test_a_failure_after_the_last_step_loses_no_step(setup, tmp_path, monkeypatch, capsys):
    """A tracking store that fails at the end (every write once training is over) costs the job at most its
    tracking.end_timeout_s: the records are kept in the spool, the model exported. A failure that does end the job
    after the last step (the export's copy) is one line, exit 2, and leaves the checkpoint: the rerun completes
    without training a step."""
    import shutil

    import memopd.tracking as tracking
    from mlflow.tracking import MlflowClient

    d, cfg = setup
    short = {**cfg, "train": {**cfg["train"], "steps": 2, "keep_checkpoint": False}}
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracking.init_store(uri, "memopd")

    def down(*a, **kw):
        raise ConnectionError("tracking server unreachable")

    monkeypatch.setattr(MlflowClient, "log_artifact", down)  # the run's last writes: artifact, then its end
    monkeypatch.setattr(MlflowClient, "set_terminated", down)
    track = json.dumps({"uri": uri, "experiment": "memopd", "spool": str(tmp_path / "spool"), "end_timeout_s": 2})
    _train_cli(setup, short, tmp_path / "run", "--tracking", track)
    assert (tmp_path / "run/model/model.safetensors").exists() and not (tmp_path / "run/checkpoint").exists()
    assert len(list((tmp_path / "spool").glob("*.jsonl"))) == 1  # the unsent end, kept for `tracking replay`
    monkeypatch.undo()

    copies = []
    monkeypatch.setattr(shutil, "copytree", lambda *a, **kw: copies.append(a) or (_ for _ in ()).throw(OSError("disk full")))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        _train_cli(setup, short, tmp_path / "late", "--export", str(tmp_path / "exported"))
    err = capsys.readouterr().err.strip().splitlines()  # after the weights' loading bars: one line, no traceback
    assert e.value.code == 2 and err[-1].startswith("memopd train: --export ") and "disk full" in err[-1]
    assert not any("Traceback" in x for x in err)
    assert copies and (tmp_path / "late/checkpoint/state.pt").exists()  # trained, not exported: kept
    model = load_file(tmp_path / "late/model/model.safetensors")
    monkeypatch.undo()
    import memopd.train.loop as loop

    monkeypatch.setattr(loop, "ppo_update", lambda *a, **kw: pytest.fail("the rerun trained a step"))
    _train_cli(setup, short, tmp_path / "late", "--export", str(tmp_path / "exported"))
    again = load_file(tmp_path / "exported/model.safetensors")
    assert all(torch.equal(model[k], again[k]) for k in model)
    assert not (tmp_path / "late/checkpoint").exists()
    assert [json.loads(x)["step"] for x in (tmp_path / "late/metrics.jsonl").read_text().splitlines()] == [0, 1]


def test_a_finished_run_with_a_kept_checkpoint_reruns_to_a_no_op(setup, tmp_path):
    """keep_checkpoint: true keeps checkpoint/ at the last step; running the same run again (a rerun of the job)
    resumes at train.steps and trains nothing: the policy and every step's metrics stay as they were."""
    d, cfg = setup
    kept = {**cfg, "train": {**cfg["train"], "steps": 2, "keep_checkpoint": True}}
    _run((d, kept), tmp_path / "run")
    assert (tmp_path / "run/checkpoint/state.pt").exists()
    model, metrics = tmp_path / "run/model/model.safetensors", tmp_path / "run/metrics.jsonl"
    before = (load_file(model), metrics.read_text())
    assert _run((d, kept), tmp_path / "run") == []
    after = load_file(model)
    assert all(torch.equal(before[0][k], after[k]) for k in after) and metrics.read_text() == before[1]


def test_the_data_order_is_the_same_for_every_method():
    assert task_order(10, 4, 3, seed=5) == task_order(10, 4, 3, seed=5)
    assert task_order(10, 4, 3, seed=5) != task_order(10, 4, 3, seed=6)
    assert all(len(b) == 3 for b in task_order(10, 4, 3, seed=5))


def test_result_tables_known_values():
    scores = {("ppo", "q2_test"): {0: {"f1": 0.2}, 1: {"f1": 0.4}},
              ("memopd", "q2_test"): {0: {"f1": 0.3}, 1: {"f1": 0.6}}}
    rows = {r["method"]: r for r in table_rows(scores, ["ppo", "memopd"], {"q2_test": "Q2"}, ["f1"])}
    assert rows["memopd"]["mean"] == pytest.approx(0.45)
    assert rows["memopd"]["rel_to_ppo_pct"] == pytest.approx(50.0)
    assert rows["memopd"]["diff_vs_ppo"] == pytest.approx(0.15)
    assert rows["ppo"]["rel_to_ppo_pct"] == 0.0 and rows["ppo"]["seeds"] == 2
    # two seeds: t(0.975, 1) = 12.706 (printed table) x the standard error 0.15 / sqrt(2)
    half = 12.706 * statistics.stdev([0.3, 0.6]) / 2 ** 0.5
    assert (rows["memopd"]["ci_low"], rows["memopd"]["ci_high"]) == pytest.approx((0.45 - half, 0.45 + half), rel=1e-4)
    assert rows["memopd"]["p"] == pytest.approx(0.5) and rows["memopd"]["noise"] == "inside the noise"


def test_result_tables_quote_the_paper_and_give_a_verdict_per_comparison():
    """Hand-made directions over six seeds: memopd above ppo on every seed on Q2 (the paper's +14.3% F1), below
    it on every seed on Q8 (against the paper's +283.2%), memopd_persistent above and below ppo (mixed). Q2 F1 is
    primary (trained on q2); Q8 and the other metrics are Holm-adjusted over the table's secondary comparisons."""
    from memopd.report.results import table_notes

    ppo = [0.2, 0.3, 0.25, 0.22, 0.28, 0.24]
    f1 = {("ppo", "q2_test"): ppo, ("memopd", "q2_test"): [v + d for v, d in zip(ppo, [.1, .05, .05, .08, .04, .06])],
          ("memopd_persistent", "q2_test"): [v + d for v, d in zip(ppo, [.1, -.1, .01, -.02, .03, -.01])],
          ("ppo", "q8_test"): ppo, ("memopd", "q8_test"): [v - d for v, d in zip(ppo, [.1, .1, .05, .04, .06, .07])],
          ("memopd_persistent", "q8_test"): ppo}
    scores = {k: {s: {"f1": v, "peak_context_tokens": 100.0 + v} for s, v in enumerate(vals)} for k, vals in f1.items()}
    rows = table_rows(scores, ["ppo", "memopd", "memopd_persistent"], {"q2_test": "Q2", "q8_test": "Q8"},
                      ["f1", "peak_context_tokens"], primary="Q2")
    got = {(r["method"], r["horizon"], r["metric"]): r for r in rows}
    assert got[("memopd", "Q2", "f1")]["paper_rel_to_ppo_pct"] == 14.3
    assert got[("memopd", "Q8", "f1")]["paper_rel_to_ppo_pct"] == 283.2
    assert got[("memopd_persistent", "Q2", "f1")]["paper_rel_to_ppo_pct"] != got[("memopd_persistent", "Q2", "f1")]["paper_rel_to_ppo_pct"]  # NaN
    assert got[("memopd", "Q2", "f1")]["noise"] == "outside the noise" and got[("ppo", "Q2", "f1")]["noise"] == ""
    assert got[("memopd_persistent", "Q2", "f1")]["noise"] == "inside the noise"
    assert {r["table_tests"] for r in rows if r["method"] != "ppo"} == {8}
    assert {r["family_size"] for r in rows if r["role"] == "primary"} == {2}
    secondary = [r for r in rows if r["role"] == "secondary"]
    assert len(secondary) == 6 and {r["role"] for r in rows if r["metric"] == "f1" and r["horizon"] == "Q2" and r["method"] != "ppo"} == {"primary"}
    # Holm over the 6 secondary p values, by hand: sorted, times 6, 5, ..., running maximum
    ps = sorted((r["p"], id(r)) for r in secondary)
    running = 0.0
    for k, (p, key) in enumerate(ps):
        running = max(running, min(1.0, (6 - k) * p))
        assert next(r for r in secondary if id(r) == key)["p_holm"] == pytest.approx(running)
    q8 = got[("memopd", "Q8", "f1")]
    assert q8["p"] == pytest.approx(2 / 64) and q8["p_holm"] > 0.05 and q8["noise"] != "outside the noise"
    notes = {n.split(")")[0] + ")": n for n in table_notes(rows)}
    assert set(notes) == {f"Finding ({m} vs ppo, {h}, f1)" for m in ("memopd", "memopd_persistent") for h in ("Q2", "Q8")}
    assert "paper +14.3%; outside the noise, the same direction as the paper" in notes["Finding (memopd vs ppo, Q2, f1)"]
    assert "primary (2 in the table), not adjusted; 8 comparisons in the table; 6 seeds" in notes["Finding (memopd vs ppo, Q2, f1)"]
    assert "exact p 0.0312 (smallest possible 0.0312)" in notes["Finding (memopd vs ppo, Q2, f1)"]
    assert "(secondary, over 6)" in notes["Finding (memopd vs ppo, Q8, f1)"]
    # below ppo on every seed (p 2/64 alone), but one of 6 secondary comparisons: Holm p 0.1875
    assert "Holm-adjusted p 0.1875 (secondary, over 6)" in notes["Finding (memopd vs ppo, Q8, f1)"]
    assert "paper +283.2%; inside the noise" in notes["Finding (memopd vs ppo, Q8, f1)"]
    assert "no paper figure; inside the noise" in notes["Finding (memopd_persistent vs ppo, Q2, f1)"]
    q16 = {("ppo", "q16_test"): [100.0, 110.0, 104.0, 98.0, 107.0, 101.0], ("memopd", "q16_test"): [80.0, 90.0, 85.0, 79.0, 88.0, 81.0]}
    scores = {k: {s: {"f1": 0.1, "peak_context_tokens": v} for s, v in enumerate(vals)} for k, vals in q16.items()}
    notes = table_notes(table_rows(scores, ["ppo", "memopd"], {"q16_test": "Q16"}, ["f1", "peak_context_tokens"]))
    peak = next(n for n in notes if "peak_context_tokens" in n)  # not EM/F1, but the paper reports it: -33.0%
    assert peak.startswith("Finding (memopd vs ppo, Q16, peak_context_tokens): -18.9% ") and "paper -33.0%" in peak
    # no primary (no trained horizon given): both comparisons secondary, Holm p 2 x 2/64 = 0.0625
    assert "Holm-adjusted p 0.0625 (secondary, over 2)" in peak
    assert "suggestive only (not outside the noise), the same direction as the paper" in peak
    welch = {("ppo", "q2_test"): {s: {"f1": v} for s, v in enumerate(ppo)},
             ("memopd", "q2_test"): {s + 10: {"f1": v + 0.2} for s, v in enumerate(ppo)}}  # other seeds: unpaired
    [note] = table_notes(table_rows(welch, ["ppo", "memopd"], {"q2_test": "Q2"}, ["f1"], primary="Q2"))
    assert "Welch 95% CI" in note and "exact p 0.0022" in note and "1 comparison in" in note  # 2 / C(12, 6): no overlap
    one = {("ppo", "q2_test"): {0: {"f1": 0.2}}, ("memopd", "q2_test"): {0: {"f1": 0.3}}}
    [note] = table_notes(table_rows(one, ["ppo", "memopd"], {"q2_test": "Q2"}, ["f1"]))
    assert "(difference +0.1000; no test (one value); 1 seed); paper +14.3%; no test (one seed" in note


def test_a_rank_share_of_a_batch_samples_the_single_process_episodes(setup):
    """rollout(tasks[r::W], indices=...) seeds every call by the task's batch position: rank r's share
    is exactly those episodes of the single-process rollout (batch_size 1: no padding effects)."""
    from agent_support import protocol_student, retriever, tokenizer
    from memopd.generation.backends import HFBackend, Sampling
    from memopd.agent.rollout import rollout
    from memopd.config import AgentConfig

    tasks = nq_tasks(4, n_questions=2, start=60)
    agent = AgentConfig(max_observation_tokens=48, turns={"default": 3}, batch_size=1)
    backend = HFBackend(protocol_student(), tokenizer(), Sampling(max_new_tokens=24))
    run = lambda ts, **kw: rollout(ts, backend, tokenizer(), retriever(), agent, seed=11, progress=False, **kw)
    whole = run(tasks)
    shares = [run(tasks[r::2], indices=list(range(r, 4, 2))) for r in (0, 1)]
    calls = lambda ep: [(inv.input_ids, inv.output_ids) for inv in ep.invocations]
    for r in (0, 1):
        assert [calls(e) for e in shares[r]] == [calls(e) for e in whole[r::2]]
    assert calls(run(tasks[1::2])[0]) != calls(whole[1])  # without indices the seeds differ


def _train_worker(rank, world, port, setup, out, stop_after=None):
    import os
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))  # setup_distributed then reuses it
    _run(setup, out, method="memopd_persistent", stop_after=stop_after)
    dist.destroy_process_group()


def _two_ranks(setup, out, stop_after=None):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_train_worker, args=(2, port, setup, out, stop_after), nprocs=2, start_method="spawn")


@pytest.mark.slow  # two gloo ranks in subprocesses: 10-20 s each
@pytest.mark.parametrize("shard", ["none", "fsdp"])
def test_two_ranks_train_like_one(setup, tmp_path, shard):
    """train_run under 2 gloo ranks (what torchrun runs): each rank rolls out and scores its share,
    gradients are summed, rank 0 alone writes metrics and model, every rank its part of the checkpoint. With
    rollouts batched one episode at a time (no padding effects) the episodes, metrics and weights are the single
    process's. With `train.shard: fsdp` (FSDP2 on CPU/gloo) the ranks generate with the gathered policy, and a run
    killed after step 1 resumes from that checkpoint."""
    d, cfg = setup
    cfg = {**cfg, "rollout": {**cfg["rollout"], "batch_size": 1}}
    single = _run((d, cfg), tmp_path / "one", method="memopd_persistent")
    cfg = {**cfg, "train": {**cfg["train"], "shard": shard}}
    if shard == "fsdp":
        _two_ranks((d, cfg), tmp_path / "two", stop_after=1)
        assert not (tmp_path / "two/model").exists() and (tmp_path / "two/checkpoint/.metadata").exists()
    _two_ranks((d, cfg), tmp_path / "two")
    lines = [json.loads(x) for x in (tmp_path / "two/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2] and all(m["world_size"] == 2 for m in lines)
    for a, b in zip(single, lines, strict=True):
        assert b["episodes"] == a["episodes"] == cfg["train"]["batch_tasks"]
        for k in ("reward/f1", "reward/em", "rollout/calls_per_episode", "tokens/actions", "tokens/packed"):
            assert a[k] == b[k], k  # the same episodes
        for k in ("actor/loss", "value/loss", "opd/loss", "actor/grad_norm", "reward/kl_ref"):
            assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(a[k])), k
    w1, w2 = (load_file(tmp_path / f"{n}/model/model.safetensors") for n in ("one", "two"))
    # measured ~6e-8 (float sums in another order); a wrong gradient scale moves them by ~lr = 1e-4
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) <= 1e-5
    assert {f.name for f in (tmp_path / "two/checkpoint").iterdir()} == {
        ".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json", "metrics.jsonl"}


def test_cli_train_writes_metrics_and_exports_the_policy(setup, tmp_path, capsys):
    """`memopd train` (what the `train` rule runs, alone or under torchrun) without tracking."""
    from memopd.cli import main

    d, cfg = setup
    cfg = {**cfg, "train": {**cfg["train"], "steps": 1}}
    # ppo scores no teacher: its run needs none (memopd methods refuse to start without one)
    main(["train", "--cfg", json.dumps(cfg), "--method", "ppo", "--seed", "1", "--student", str(d / "student"),
          "--tasks", str(d / "q2_train.parquet"), "--index", str(d / "index"),
          "--out-dir", str(tmp_path / "run"), "--export", str(tmp_path / "export")])
    with pytest.raises(SystemExit) as e:
        main(["train", "--cfg", json.dumps(cfg), "--method", "memopd", "--seed", "1", "--student", str(d / "student"),
              "--tasks", str(d / "q2_train.parquet"), "--index", str(d / "index"),
              "--out-dir", str(tmp_path / "run2"), "--export", str(tmp_path / "export2")])
    assert e.value.code == 2 and "needs --teacher" in capsys.readouterr().err and not (tmp_path / "run2").exists()
    lines = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 1 and lines[0]["world_size"] == 1 and lines[0]["method"] == "ppo"
    assert "time/sync_s" not in lines[0]  # no engine to sync with the hf backend
    assert load_file(tmp_path / "export/model.safetensors").keys() == load_file(d / "student/model.safetensors").keys()


def test_cli_train_gives_each_rank_its_share_of_the_threads(setup, tmp_path, monkeypatch):
    """`memopd train --threads 4` with two ranks on the node (torchrun's LOCAL_WORLD_SIZE): the run sees 2 threads,
    not the job's 4 on each rank."""
    import memopd.train.loop
    from memopd.cli import main

    d, cfg = setup
    seen = []
    monkeypatch.setattr(memopd.train.loop, "train_run", lambda *a, **kw: seen.append(torch.get_num_threads()) or [])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    before = torch.get_num_threads()
    try:
        main(["train", "--cfg", json.dumps(cfg), "--method", "ppo", "--seed", "1", "--student", str(d / "student"),
              "--tasks", str(d / "q2_train.parquet"), "--index", str(d / "index"), "--out-dir", str(tmp_path / "run"),
              "--threads", "4"])
    finally:
        torch.set_num_threads(before)
    assert seen == [2]


def test_the_rce_guard_tolerance_follows_the_training_dtype():
    from memopd.train.config import RunConfig

    paper = merge_files([ROOT / "config/paper.yaml"])["train"]
    assert RunConfig.from_section(paper, "memopd", 0).ppo.dtype == "bfloat16" == paper["dtype"]
    least = {"steps": 1, "batch_tasks": 1, "lr_actor": 1e-5, "lr_critic": 1e-4, "ppo": {}}
    assert RunConfig.from_section(least, "ppo", 0).ppo.dtype == "float32"


def test_the_train_section_is_typed_once_with_the_schemas_defaults():
    """RunConfig holds every default of the train section; those the config schema states agree with it; a
    misspelt key and prefix_shared with activation checkpointing are refused while parsing."""
    from dataclasses import fields

    from memopd.train.config import RunConfig
    from memopd.train.update import PPOConfig

    least = {"steps": 1, "batch_tasks": 1, "lr_actor": 1e-5, "lr_critic": 1e-4, "ppo": {}}
    run = RunConfig.from_section(least, "memopd", 3)
    assert (run.ppo.method, run.ppo.seed, run.dtype) == ("memopd", 3, "float32")
    # a config that does not say so deletes a finished run's checkpoint (~74 GB per run at paper scale)
    assert run.keep_checkpoint is False
    schema = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())["properties"]["train"]
    stated = {k: v["default"] for k, v in schema["properties"].items() if "default" in v}
    assert stated and all(getattr(run, k) == v for k, v in stated.items()), stated
    ppo_schema = schema["properties"]["ppo"]["properties"]
    field_of = {"lam": "gae_lambda", "opd_coef": "opd_lambda", "backend": "attention"}  # spelt otherwise in PPOConfig
    assert all(getattr(run.ppo, field_of.get(k, k)) == v["default"] for k, v in ppo_schema.items() if "default" in v)
    assert {field_of.get(k, k) for k in ppo_schema} == {f.name for f in fields(PPOConfig)} - {
        "method", "seed", "dtype", "vocab"}
    lambdas = {**least, "ppo": {"lam": 0.7, "opd_coef": 0.3}}
    got = RunConfig.from_section(lambdas, "memopd", 0).ppo
    assert (got.gae_lambda, got.opd_lambda) == (0.7, 0.3)
    got = RunConfig.from_section(lambdas, "ppo", 0).ppo
    assert (got.gae_lambda, got.opd_lambda) == (0.7, 0.0)  # no teacher: no OPD term, whatever the config says
    with pytest.raises(ValueError, match="gae_lambda"):  # the config spells it `lam`
        RunConfig.from_section({**least, "ppo": {"gae_lambda": 0.7}}, "memopd", 0)
    assert set(schema["properties"]) - {"ppo"} <= {f.name for f in fields(RunConfig)} | {"dtype"} | {
        "student", "teacher", "methods", "seeds", "benchmark", "horizons", "matched_control", "per_method"}
    # a method's own settings over the section's (train.per_method); the other methods keep the section's
    per = {**least, "ppo": {"beta": 0.001, "clip": 0.2}, "per_method": {"ppo": {"lr_actor": 3e-4, "ppo": {"beta": 0.01}}}}
    got = RunConfig.from_section(per, "ppo", 0)
    assert (got.lr_actor, got.ppo.beta, got.ppo.clip, got.lr_critic) == (3e-4, 0.01, 0.2, 1e-4)
    got = RunConfig.from_section(per, "memopd", 0)
    assert (got.lr_actor, got.ppo.beta, got.ppo.clip) == (1e-5, 0.001, 0.2)
    with pytest.raises(ValueError, match="per_method.ppo.ppo"):  # what the plan reads is one value for every method
        RunConfig.from_section({**per, "per_method": {"ppo": {"ppo": {"chunk_size": 64}}}}, "ppo", 0)
    with pytest.raises(ValueError, match="critic_layer"):
        RunConfig.from_section({**least, "critic_layer": 2}, "ppo", 0)
    with pytest.raises(ValueError, match="prefix_shared"):
        RunConfig.from_section({**least, "activation_checkpointing": True, "ppo": {"backend": "prefix_shared"}}, "ppo", 0)


def test_tied_weights_checkpoint_and_export_round_trip(tmp_path, monkeypatch):
    """SmolLM2 and Qwen2.5-3B tie lm_head to embed_tokens; safetensors' save_file refuses shared tensors
    (the first training checkpoint of a tied model crashed). The checkpoint stores the tied tensor once
    and resumes to identical, still tied weights and optimizer state; the export loads back tied. state.pt is
    read memory-mapped (one copy of its pages for every rank of a node: the plan's resume term)."""
    import copy

    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from memopd.harness import Harness, Part, export
    from memopd.train.update import ValueModel

    def tied(seed):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))

    policy = tied(0)
    assert policy.lm_head.weight.data_ptr() == policy.model.embed_tokens.weight.data_ptr()
    critic = ValueModel(copy.deepcopy(policy))
    a_opt, c_opt = torch.optim.AdamW(policy.parameters(), lr=1e-2), torch.optim.AdamW(critic.parameters(), lr=1e-2)
    policy(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    a_opt.step()
    saver = Harness(tmp_path / "ckpt", {"run": 1}, 3, 3, "t", parts=[Part("policy", policy, "actor_opt", a_opt),
                                                                     Part("critic", critic, "critic_opt", c_opt)])
    saver.save(3)
    stored = load_file(tmp_path / "ckpt/policy.safetensors")
    assert "lm_head.weight" not in stored or "model.embed_tokens.weight" not in stored  # stored once

    fresh = tied(1)
    fresh_critic = ValueModel(copy.deepcopy(fresh))
    a2, c2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2), torch.optim.AdamW(fresh_critic.parameters(), lr=1e-2)
    loads, torch_load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda f, **kw: loads.append((f, kw.get("mmap"))) or torch_load(f, **kw))
    loader = Harness(tmp_path / "ckpt", {"run": 1}, 3, 3, "t", parts=[Part("policy", fresh, "actor_opt", a2),
                                                                      Part("critic", fresh_critic, "critic_opt", c2)])
    assert loader.resume(loader.find()) == 3
    assert loads == [(tmp_path / "ckpt/state.pt", True)]
    for (k, v), w in zip(policy.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(v, w), k
    assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()  # still tied
    assert all(torch.equal(a, b) for a, b in zip(a_opt.state_dict()["state"][0].values(),
                                                  a2.state_dict()["state"][0].values()))
    # the export path of every trainer (save_pretrained with the gathered state dict)
    tok = type("Tok", (), {"save_pretrained": lambda self, d: None})()
    export(policy, tmp_path / "model", tok)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()
    assert torch.equal(back.lm_head.weight, policy.lm_head.weight)


def test_the_opd_kl_runs_over_the_tokenizers_ids(setup, tmp_path, monkeypatch):
    """train_run hands the update len(tokenizer) as the OPD vocabulary (heads padded past the tokenizer,
    as Qwen2.5's are, must not enter the KL); the update is stopped once it has seen its config."""
    import memopd.train.loop as loop
    from agent_support import tokenizer as tiny_tokenizer

    seen = []

    def stop(episodes, policy, ref, critic, teacher, a_opt, c_opt, cfg, ids=None):
        seen.append(cfg.vocab)
        raise RuntimeError("stop: config seen")

    monkeypatch.setattr(loop, "ppo_update", stop)
    with pytest.raises(RuntimeError, match="stop"):
        _run(setup, tmp_path / "run")
    assert seen == [len(tiny_tokenizer())]


def test_a_smaller_critic_keeps_the_students_first_layers(setup, tmp_path, monkeypatch):
    """train.critic_layers = N: the critic is the student's first N decoder layers + final norm + value head.
    Independent check: a freshly built N-layer model loaded with those weights gives the same hidden states.
    And train_run builds its critic that way (the update is stopped once it has seen the critic)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import memopd.train.loop as loop
    from memopd.train.update import ValueModel

    conf = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                tie_word_embeddings=True)
    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, **conf))
    critic = ValueModel(lm, layers=2)
    small = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **conf))
    missing, unexpected = small.load_state_dict(
        {k: v for k, v in lm.state_dict().items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < 2},
        strict=False)
    assert not unexpected and all(k.startswith("lm_head") for k in missing)
    ids = torch.tensor([[3, 5, 7, 11, 13, 17]])
    torch.testing.assert_close(critic.lm.model(input_ids=ids).last_hidden_state,
                               small.model(input_ids=ids).last_hidden_state, rtol=0, atol=0)
    with pytest.raises(ValueError, match="critic_layers 5"):
        ValueModel(LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, **conf)), layers=5)

    seen = []

    def stop(episodes, policy, ref, critic, teacher, a_opt, c_opt, cfg, ids=None):
        seen.append((len(policy.model.layers), len(critic.lm.model.layers)))
        raise RuntimeError("stop: critic seen")

    monkeypatch.setattr(loop, "ppo_update", stop)
    d, cfg = setup
    cfg = {**cfg, "train": {**cfg["train"], "critic_layers": 1}}
    with pytest.raises(RuntimeError, match="stop"):
        train_run(cfg, "ppo", 0, d / "student", None, d / "q2_train.parquet", d / "index", tmp_path / "run",
                  log=lambda *a: None)
    assert seen[0][1] == 1 and seen[0][0] > 1


def test_each_method_is_compared_with_its_sft_student_task_by_task(tmp_path):
    """vs_student_rows: per task, the method's score averaged over seeds minus the student's; the test over seeds
    (per seed the mean difference: t interval, exact sign-flip p) against plain loops; a gain on every seed is
    outside the noise, a zero-mean one inside; one seed: BCa over tasks and no test over seeds."""
    import csv
    import random as rnd

    from memopd.report.results import vs_student_rows

    def write(model, scores):
        (tmp_path / model).mkdir(parents=True, exist_ok=True)
        with open(tmp_path / model / "q2_test.csv", "w", newline="") as f:
            w = csv.DictWriter(f, ["task_id", "em", "f1"])
            w.writeheader()
            for t, v in scores.items():
                w.writerow({"task_id": t, "em": float(v > 0.5), "f1": v})

    rng = rnd.Random(0)
    tasks = [f"t{i}" for i in range(40)]
    student = {t: rng.random() for t in tasks}
    write("student_sft", student)
    gains = [0.1, 0.3, 0.2, 0.15, 0.25, 0.12]
    seeds = list(range(6))
    for s, g in zip(seeds, gains):
        write(f"ppo_seed{s}", {t: min(1.0, v + g) for t, v in student.items()})
        write(f"memopd_seed{s}", {t: student[t] + (0.05 if (i + s) % 2 else -0.05) for i, t in enumerate(tasks)})
    own = {"ppo": seeds, "memopd": seeds[:4]}  # each method on its own seeds
    rows = {(r["method"], r["metric"]): r for r in vs_student_rows(tmp_path, "student_sft", own, {"q2_test": "Q2"},
                                                                   primary="Q2")}
    per_seed = [sum(min(1.0, student[t] + g) - student[t] for t in tasks) / 40 for g in gains]
    r = rows[("ppo", "f1")]
    assert r["diff"] == pytest.approx(sum(per_seed) / 6) and r["student"] == pytest.approx(sum(student.values()) / 40)
    half = 2.571 * statistics.stdev(per_seed) / 6 ** 0.5  # t(0.975, 5) from a printed table
    assert (r["seed_ci_low"], r["seed_ci_high"]) == pytest.approx((r["diff"] - half, r["diff"] + half), rel=1e-3)
    assert 0 < r["ci_low"] <= r["diff"] <= r["ci_high"]  # two-level bootstrap: seeds, then tasks
    assert r["p"] == pytest.approx(2 / 64) and r["role"] == "primary" and r["noise"] == "outside the noise"
    m = rows[("memopd", "f1")]
    signs = [sum(0.05 if (i + s) % 2 else -0.05 for i in range(40)) / 40 for s in seeds[:4]]  # 0 on every seed
    assert m["diff"] == pytest.approx(sum(signs) / 4, abs=1e-12) and m["noise"] == "inside the noise"
    assert m["seeds"] == 4 and m["p"] == 1.0  # four zero differences: every sign pattern ties
    assert rows[("ppo", "em")]["role"] == "secondary" and rows[("ppo", "f1")]["table_tests"] == 4
    assert rows[("ppo", "f1")]["tasks"] == 40 and rows[("ppo", "f1")]["seeds"] == 6

    [one] = [r for r in vs_student_rows(tmp_path, "student_sft", {"ppo": [1]}, {"q2_test": "Q2"}) if r["metric"] == "f1"]
    assert one["p"] == "" and one["noise"] == "no test over seeds (1 seed); over tasks outside the noise (CI excludes 0)"
    assert one["ci_low"] < one["diff"] < one["ci_high"]

    write("memopd_seed1", {t: student[t] for t in tasks[:-1]})  # a task missing: refused, naming the file
    with pytest.raises(ValueError, match="memopd_seed1/q2_test.csv"):
        vs_student_rows(tmp_path, "student_sft", {"memopd": [0, 1]}, {"q2_test": "Q2"})


def test_training_checkpoints_activations_when_configured(setup, tmp_path, monkeypatch):
    """train.activation_checkpointing: policy and critic recompute their layers in the backward (the update's
    numbers are the same: tests/test_checkpointing.py); refused with an explicit prefix_shared before the first rollout
    (auto, the default, skips it)."""
    import memopd.train.loop as loop
    from memopd.parallel import is_checkpointed

    seen = []

    def stop(episodes, policy, ref, critic, teacher, a_opt, c_opt, cfg, ids=None):
        seen.append((is_checkpointed(policy), is_checkpointed(critic), is_checkpointed(ref)))
        raise RuntimeError("stop: models seen")

    monkeypatch.setattr(loop, "ppo_update", stop)
    d, cfg = setup
    for on in (False, True):
        run_cfg = {**cfg, "train": {**cfg["train"], "activation_checkpointing": on,
                                    "ppo": {**cfg["train"]["ppo"], "backend": "sdpa"}}}
        with pytest.raises(RuntimeError, match="stop"):
            train_run(run_cfg, "ppo", 0, d / "student", None, d / "q2_train.parquet", d / "index", tmp_path / f"r{on}",
                      log=lambda *a: None)
    assert seen == [(False, False, False), (True, True, False)]
    bad = {**cfg, "train": {**cfg["train"], "activation_checkpointing": True,
                            "ppo": {**cfg["train"]["ppo"], "backend": "prefix_shared"}}}
    with pytest.raises(ValueError, match="prefix_shared"):
        train_run(bad, "ppo", 0, d / "student", None, d / "q2_train.parquet", d / "index", tmp_path / "bad",
                  log=lambda *a: None)


def _identity(train: dict, method: str = "memopd", **sections) -> dict:
    """The resume identity of seed 0 of `method` under this train section and the embedded default's agent and
    rollout sections (`sections` replacing them)."""
    from memopd.train.loop import training_identity

    cfg = {k: v for k, v in merge_files([ROOT / "config" / "config.yaml"]).items() if k in ("agent", "rollout")}
    return training_identity(RunSections.parse({**cfg, **sections, "train": train}, method, 0), method, 0)


def _train(**changes) -> dict:
    """The embedded default's train section with `changes` (train.ppo's merged key by key)."""
    train = copy.deepcopy(merge_files([ROOT / "config" / "config.yaml"])["train"])
    ppo = changes.pop("ppo", {})
    return {**train, **changes, "ppo": {**train["ppo"], **ppo}}


def test_activation_checkpointing_is_not_part_of_a_runs_identity():
    """Recomputing layers changes how a step runs, not what it computes: a checkpoint resumes with it toggled."""
    assert _identity(_train(activation_checkpointing=False)) == _identity(_train(activation_checkpointing=True))
    assert _identity(_train(lr_actor=1e-5)) != _identity(_train(lr_actor=2e-5))


def test_memory_settings_are_not_part_of_a_runs_identity():
    """The natural fix of an out-of-memory step (a smaller vLLM share, a smaller chunk of logit rows) keeps the
    checkpoint usable; a change of what the update computes (the PPO clip) does not."""
    train = _train(vllm={"gpu_memory_utilization": 0.3, "sleep": True}, ppo={"clip": 0.2, "chunk_size": 512})
    smaller = _train(vllm={"gpu_memory_utilization": 0.2, "sleep": True}, ppo={"clip": 0.2, "chunk_size": 128})
    assert _identity(train) == _identity(smaller)
    assert _identity(train) == _identity({**train, "dist_timeout_min": 240})  # how long a rank waits: not the result
    assert _identity(train) != _identity(_train(vllm=train["vllm"], ppo={"clip": 0.1, "chunk_size": 512}))
    assert train["ppo"]["chunk_size"] == 512 and train["vllm"]["gpu_memory_utilization"] == 0.3  # left as it was


def test_a_runs_identity_is_its_typed_section():
    """A default written out or left out is the same run, and so is another method's own setting; the run's own
    setting (train.per_method) is part of it."""
    train = _train()
    assert train["shard"] == "none" == RunConfig.__dataclass_fields__["shard"].default
    assert _identity(train) == _identity({k: v for k, v in train.items() if k != "shard"})
    other = _train(per_method={"ppo": {"lr_actor": 9e-9}})
    assert _identity(train) == _identity(other)
    assert _identity(train, "ppo") != _identity(other, "ppo")
    own = _train(per_method={"memopd": {"ppo": {"opd_coef": 3.0}}})
    assert _identity(train) != _identity(own)
    assert _identity(train, "memopd") != _identity(train, "memopd_persistent")  # same settings, another method


def test_a_runs_identity_holds_the_typed_agent_and_rollout_sections():
    """The agent and rollout settings a run reads are part of its identity as typed: a default written out or left
    out is the same run, a changed setting another; the evaluation engine's GPU share, which a training run does not
    start, is not part of it."""
    base = merge_files([ROOT / "config" / "config.yaml"])
    agent, rollout, train = base["agent"], base["rollout"], _train()
    assert "top_p" in rollout and rollout["top_p"] == 1.0 == RolloutConfig().top_p
    assert _identity(train) == _identity(train, rollout={k: v for k, v in rollout.items() if k != "top_p"})
    assert _identity(train) == _identity(train, agent={**agent, "max_query_chars": AgentConfig().max_query_chars})
    assert _identity(train) != _identity(train, agent={**agent, "top_k": agent.get("top_k", 3) + 1})
    assert _identity(train) != _identity(train, rollout={**rollout, "temperature": 0.5})
    share = {**rollout, "vllm": {**(rollout.get("vllm") or {}), "gpu_memory_utilization": 0.5}}
    assert _identity(train) == _identity(train, rollout=share)
    assert _identity(train) != _identity(train, rollout={**share, "vllm": {**share["vllm"], "max_model_len": 999}})


def test_a_training_run_prints_its_progress_with_the_time_left(setup, tmp_path, capsys):
    """One line per step into a log file: the step count of the run (a resumed run counts on from its
    checkpoint) and the time left at this process's pace, which after 1 of 2 steps equals the time elapsed."""
    d, cfg = setup
    short = {**cfg, "train": {**cfg["train"], "steps": 2}}
    _run((d, short), tmp_path / "run", method="ppo", stop_after=1)
    _run((d, short), tmp_path / "run", method="ppo")
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("ppo seed 0: ")]
    pattern = r"ppo seed 0: (\d)/2 steps, (\w+) elapsed, ~(\w+) left"
    parsed = [re.fullmatch(pattern, x).groups() for x in lines]
    assert [p[0] for p in parsed] == ["1", "2"], lines
    assert parsed[0][2] == parsed[0][1]  # 1 step in t s, 1 step left: t s
    assert parsed[1][2] == "0s"  # resumed at step 1, the last step done


@pytest.mark.parametrize("method", ["memopd", "ppo"])
def test_models_are_sharded_as_they_come_and_the_teacher_loads_last(monkeypatch, method):
    """Under FSDP a rank holds at most the policy and one copy of it whole (the plan's load phase): the
    reference and the critic are sharded as soon as they are copied, then the policy, and only then is the
    teacher loaded. Recorded with a stand-in for `shard` (no process group) and for the model loader."""
    from memopd import parallel
    from memopd.train.config import RunConfig
    from memopd.train.loop import build_models

    cfg = yaml.safe_load((ROOT / "config/config.yaml").read_text())["train"]
    cfg.update(shard="fsdp", critic_layers=2, activation_checkpointing=False)
    run = RunConfig.from_section(cfg, method, 0)
    events, whole = [], set()  # whole: ids of the unsharded models alive

    def load(path, dtype, device):
        model = random_student(0)
        whole.add(id(model))
        events.append((f"load {path}", len(whole)))
        return model

    def shard(model, dtype):
        kind = "critic" if hasattr(model, "head") else "reference" if not any(
            p.requires_grad for p in model.parameters()) else "policy"
        events.append((f"shard {kind}", len(whole) + (id(model) not in whole)))  # the copy is whole till now
        whole.discard(id(model))
        return model

    monkeypatch.setattr(parallel, "shard", shard)
    policy, ref, critic, teacher = build_models(run, method, "student", "teacher", "cpu", world=2, load=load)
    order = [e for e, _ in events]
    assert order == ["load student", "shard reference", "shard critic", "shard policy",
                     *(["load teacher"] if method != "ppo" else [])]
    assert max(n for _, n in events) == 2  # the policy and one copy
    assert (teacher is None) == (method == "ppo") and len(critic.lm.model.layers) == 2
    assert not any(p.requires_grad for p in ref.parameters())


def test_memopd_self_distils_from_the_sft_student_itself(setup, tmp_path):
    """The regularisation control: the frozen teacher is the SFT student, scored on the exact state, so at the first
    update (the policy still the student) the reverse KL on the teacher tokens is 0; `memopd` with another teacher's
    is not."""
    d, cfg = setup
    one = {**cfg, "train": {**cfg["train"], "steps": 1}}

    def first(method, teacher, out):
        hist = train_run(one, method, 0, d / "student", teacher, d / "q2_train.parquet", d / "index", tmp_path / out,
                         log=lambda *a: None)
        return hist[0]

    own = first("memopd_self", d / "student", "self")
    assert own["opd/loss"] == pytest.approx(0.0, abs=1e-6)
    assert first("memopd", d / "teacher", "other")["opd/loss"] > 1e-3
    with pytest.raises(ValueError, match="needs a teacher"):
        first("memopd_self", None, "none")


def test_each_step_samples_with_its_own_seed_the_same_for_every_method(setup, tmp_path, monkeypatch):
    """The rollout of step s samples with seed * 1,000,003 + s: a new seed each step, the same for every method
    with the same seed (the real rollout runs; its seed argument is recorded)."""
    import importlib

    rollout_module = importlib.import_module("memopd.agent.rollout")  # the module (memopd.agent exports the function)
    real, seen = rollout_module.rollout, []

    def spy(*a, seed=None, **kw):
        seen.append(seed)
        return real(*a, seed=seed, **kw)

    monkeypatch.setattr(rollout_module, "rollout", spy)
    d, cfg = setup
    short = {**cfg, "train": {**cfg["train"], "steps": 2}}
    for method in ("ppo", "memopd"):
        _run((d, short), tmp_path / method, method=method)
    assert seen == [0, 1, 0, 1]


@pytest.mark.parametrize("section, bad, message", [
    ("train", {"lrr": 1}, r"memopd train: config section 'train': unknown train config keys \['lrr'\]"),
    ("agent", {"topk": 1}, r"memopd train: config section 'agent': unknown agent config keys \['topk'\]"),
    ("rollout", {"temp": 1}, r"memopd train: config section 'rollout': unknown rollout config keys \['temp'\]")])
def test_memopd_train_names_a_misspelt_key_in_one_line(tmp_path, capsys, section, bad, message):
    """A misspelt key of any section a run reads: one line naming the section and the key, exit 2, before any
    input is opened (the model paths here do not exist)."""
    from memopd.cli import main

    base = merge_files([ROOT / "config" / "config.yaml"])
    cfg = {k: base[k] for k in ("train", "agent", "rollout")}
    cfg[section] = {**cfg[section], **bad}
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["train", "--cfg", json.dumps(cfg), "--method", "ppo", "--seed", "0", "--student", str(tmp_path / "s"),
              "--tasks", str(tmp_path / "t.parquet"), "--index", str(tmp_path / "i"), "--out-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and re.fullmatch(message + ".*", err[0]), err
