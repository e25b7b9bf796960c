"""SFT: turn-level examples, bin packing, the target-only loss (packed = per example = padded), the
trainer's resumption, distributed equivalence, and the `memopd sft` commands end to end."""
import hashlib
import json
import random
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memopd.packing import PackingLimitError
from memopd.records import Episode, load_episodes
from memopd.sft.data import StepPlan, bin_pack, example_len, of_layouts, persistent_state, split_heldout, turn_examples
from memopd.sft.loss import packed_target_loss, padded_target_loss
from memopd.sft.trainer import TrainConfig, evaluate, lr_factor, train
from memopd.synthetic import RULES, random_episode

# a complete `sft` section for the tiny models of these tests
TINY_SFT = {"min_reward": 0.5, "seq_len": 64, "grad_accum": 1, "lr": 3e-3, "min_lr_ratio": 0.1, "warmup_steps": 1,
            "weight_decay": 0.0, "betas": [0.9, 0.95], "adam_eps": 1e-8, "clip": 1.0, "eval_fraction": 0.2,
            "eval_every": 0, "checkpoint_every": 10, "precision": "fp32", "mode": "packed", "backend": "segmented",
            "log_every": 1, "student": {"steps": 2}, "teacher": {"steps": 2}}

POOL = list(range(3, 512))
CFG = TrainConfig(seq_len=160, grad_accum=2, lr=3e-3, min_lr_ratio=0.1, warmup_steps=2, weight_decay=0.01,
                  betas=(0.9, 0.95), adam_eps=1e-8, clip=1.0, eval_fraction=0.1, eval_every=4, checkpoint_every=3,
                  precision="fp32", mode="packed", attention="sdpa", log_every=1, steps=8)


def tiny(seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=False, use_sliding_window=False))


def episodes(n=30, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ep = random_episode(rng, POOL, RULES[i % len(RULES)], 3, 12, (4, 24), (2, 12), task_id=f"task{i}")
        ep.reward = [0.0, 0.4, 1.0][i % 3]
        out.append(ep)
    return out


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # tiny models on shared cores: one intra-op thread is ~30x faster than two competing threads
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def examples():
    return turn_examples(episodes(), min_reward=0.5)[0]


# --- data -------------------------------------------------------------------------------------------

def test_turn_examples_filter_exact_ids_dedup_and_stats():
    eps = episodes(9)
    eps.append(replace(eps[2], task_id="copy-of-task2"))  # a duplicate trajectory (reward 1.0)
    ex, stats = turn_examples(eps, min_reward=0.5)
    kept = [e for e in eps if e.reward >= 0.5]
    assert stats["trajectories_generated"] == 10 and stats["trajectories_kept"] == len(kept) == 4
    assert stats["turn_candidates"] == 12 and stats["duplicates_dropped"] == 3 and stats["turn_examples"] == 9
    # exact ids of every kept call, in order, each a one-call episode naming its source
    calls = [inv for e in kept[:3] for inv in e.invocations]
    assert [x.invocations[0].input_ids for x in ex] == [c.input_ids for c in calls]
    assert [x.invocations[0].output_ids for x in ex] == [c.output_ids for c in calls]
    assert all(len(x.invocations) == 1 and x.prefix_len == 12 for x in ex)
    assert ex[4].metrics == {"source_task": "task5", "source_episode": 5, "call": 1, "layout": "exact"}
    with pytest.raises(ValueError, match="task0"):
        turn_examples([replace(eps[0], reward=None)], 0.5)


def test_persistent_examples_are_the_calls_of_the_packed_transcript():
    """A call's persistent-layout example is the packed persistent transcript up to that call's response: the same
    ids (read from the packing compiler), and the same logits for every response token under a model."""
    from memopd.packing import pack

    model = tiny().eval()
    for ep in episodes(6)[:6]:
        p = pack(ep, layout="persistent")
        ids = p.input_ids.tolist()
        calls = p.call[p.action_index].tolist()
        with torch.no_grad():
            whole = model(p.input_ids[None], position_ids=p.position_ids[None]).logits[0]
        for t, inv in enumerate(ep.invocations):
            first = p.action_index[calls.index(t)].item()  # the first response token of call t in the transcript
            state = persistent_state(ep, t)
            assert state == ids[:first], (ep.task_id, t)
            x = torch.tensor(state + list(inv.output_ids))
            with torch.no_grad():
                alone = model(x[None]).logits[0]
            n = len(inv.output_ids)
            mine = p.pred_index[[i for i, c in enumerate(calls) if c == t]]
            torch.testing.assert_close(alone[len(state) - 1:len(state) - 1 + n], whole[mine], rtol=1e-4, atol=1e-5)


def test_turn_examples_in_both_states_and_a_role_that_trains_on_them():
    eps = episodes(9)
    exact, _ = turn_examples(eps, min_reward=0.5)
    both, stats = turn_examples(eps, min_reward=0.5, layouts=("exact", "persistent"))
    kept = [e for e in eps if e.reward >= 0.5]
    persistent = of_layouts(both, ("persistent",))
    assert of_layouts(both, ("exact",)) == exact
    # the first call's persistent state is its exact state: a duplicate, dropped
    assert len(persistent) == sum(len(e.invocations) - 1 for e in kept)
    assert stats["turn_examples_by_layout"] == {"exact": len(exact), "persistent": len(persistent)}
    x = persistent[0]
    assert x.metrics["layout"] == "persistent" and x.task_id.endswith("@persistent")
    src = kept[0]
    assert x.invocations[0].input_ids == persistent_state(src, 1) and x.invocations[0].output_ids == src.invocations[1].output_ids
    with pytest.raises(ValueError, match="unknown SFT example layouts"):
        turn_examples(eps, 0.5, layouts=("flat",))
    from memopd.sft.commands import example_layouts

    cfg = {**TINY_SFT, "teacher": {"steps": 2, "layouts": ["persistent", "exact"]}}
    assert TrainConfig.from_section(cfg, "teacher").layouts == ("persistent", "exact")
    assert TrainConfig.from_section(cfg, "student").layouts == ("exact",)
    assert example_layouts(cfg) == ("exact", "persistent") and example_layouts(TINY_SFT) == ("exact",)
    with pytest.raises(ValueError, match="sft layouts"):
        TrainConfig.from_section({**TINY_SFT, "teacher": {"steps": 2, "layouts": ["flat"]}}, "teacher")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 50), max_size=60), st.integers(50, 120))
def test_bin_pack_never_exceeds_never_drops(lengths, max_len):
    bins = bin_pack(lengths, max_len)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))  # each item once, whole
    assert all(sum(lengths[i] for i in b) <= max_len for b in bins)
    # best fit is near optimal here: at most one bin more than the volume bound, plus half-full slack
    assert len(bins) <= 2 * -(-sum(lengths) // max_len) + 1


def test_too_long_example_is_an_error_naming_it(examples):
    lengths = [example_len(x) for x in examples]
    i = lengths.index(max(lengths))  # the first of the longest: the one that cannot fit one token less
    with pytest.raises(PackingLimitError, match=examples[i].task_id):
        bin_pack(lengths, lengths[i] - 1, [x.task_id for x in examples])
    with pytest.raises(PackingLimitError, match=examples[i].task_id):
        train(tiny(), examples, [], replace(CFG, seq_len=lengths[i] - 1), 0, "/nonexistent", progress=False)


def test_step_plan_is_deterministic_and_covers_each_epoch(examples):
    lengths = [example_len(x) for x in examples]
    a = StepPlan(lengths, 160, 2, seed=5, epochs=2)
    b = StepPlan(lengths, 160, 2, seed=5, epochs=2)
    assert [a.step(s) for s in range(a.total_steps)] == [b.step(s) for s in range(b.total_steps)]
    first = a._stream[: a._epoch_bins[0]]
    assert sorted(i for bin_ in first for i in bin_) == list(range(len(examples)))
    assert a.total_steps == -(-sum(a._epoch_bins[:2]) // 2) and a.epochs_seen >= 2
    assert StepPlan(lengths, 160, 2, seed=6, steps=3).step(0) != a.step(0)  # the seed orders the data


def test_heldout_split_keeps_trajectories_whole(examples):
    train_ex, held = split_heldout(examples, 0.3, seed=1)
    src = lambda xs: {x.metrics["source_task"] for x in xs}  # noqa: E731
    assert held and not src(train_ex) & src(held) and len(train_ex) + len(held) == len(examples)
    assert split_heldout(examples, 0.3, seed=1)[1] == held


# --- loss ---------------------------------------------------------------------------------------------

def _alone_nll(model, x: Episode) -> torch.Tensor:
    """Hand computation: the example run alone, full logits, -log p of each target token, summed."""
    inv = x.invocations[0]
    ids = torch.tensor([inv.input_ids + inv.output_ids])
    logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    n_in = len(inv.input_ids)
    return -sum(logp[n_in - 1 + k, t] for k, t in enumerate(inv.output_ids))


def test_loss_is_on_target_tokens_only(examples):
    model = tiny().eval()
    batch = examples[:5]
    seen = {}
    hook = model.model.norm.register_forward_hook(lambda m, i, out: seen.__setitem__("h", out) or out.retain_grad())
    s, n = packed_target_loss(model, batch)
    hook.remove()
    s.backward()
    # the hand computation: per example, alone, summed over its target tokens
    with torch.no_grad():
        ref = sum(_alone_nll(model, x) for x in batch)
    assert n == sum(len(x.invocations[0].output_ids) for x in batch)
    assert abs(s.item() - ref.item()) <= 1e-4 * abs(ref.item())
    # only the positions that predict target tokens receive gradient: context positions carry none
    from memopd.packing import pack

    p = pack(batch)
    g = seen["h"].grad[0].abs().sum(-1)
    is_pred = torch.zeros(len(p), dtype=torch.bool)
    is_pred[p.pred_index] = True
    assert (g[~is_pred] == 0).all() and (g[is_pred] > 0).all() and is_pred.sum() == n


def test_packed_loss_equals_per_example_and_padded_with_gradients(examples):
    """The packed loss (dense mask or segment by segment) and the padded loss equal the mean over all
    target tokens of the examples run one at a time; so do their gradients."""
    batch = examples[:7]
    ref_model = tiny()
    n = sum(len(x.invocations[0].output_ids) for x in batch)
    ref = sum(_alone_nll(ref_model, x) for x in batch) / n
    ref.backward()
    paths = {"packed/sdpa": lambda m: packed_target_loss(m, batch, backend="sdpa"),
             "packed/segmented": lambda m: packed_target_loss(m, batch, backend="segmented"),
             "padded": lambda m: padded_target_loss(m, batch)}
    for path, loss in paths.items():
        model = tiny()
        s, n_path = loss(model)
        assert n_path == n and abs(s.item() / n - ref.item()) < 1e-5, path
        (s / n).backward()
        for (name, a), b in zip(ref_model.named_parameters(), model.parameters()):
            scale = a.grad.abs().max().item() + 1e-8
            assert (a.grad - b.grad).abs().max().item() <= 1e-4 * scale + 1e-7, (path, name)


def test_segmented_blocks_of_examples_and_episodes(examples):
    """One causal block per one-call example; a multi-call episode: its prefix, then each call on the prefix and
    itself. The blocks cover the pack in order (tests/test_rce.py checks the numbers against independent calls)."""
    from memopd.attention import packed_hidden, segment_blocks
    from memopd.packing import flatten_persistent, pack

    ep = episodes(1)[0]
    p = pack(examples[:3])
    starts = [0] + [int(x) for x in torch.unique_consecutive(p.segment, return_counts=True)[1].cumsum(0)]
    assert segment_blocks(p) == [(a, b, a, a) for a, b in zip(starts, starts[1:])]
    q = ep.prefix_len
    blocks, at = [(0, q, 0, 0)], q
    for inv in ep.invocations:
        n = len(inv.input_ids) - q + len(inv.output_ids)
        blocks.append((at, at + n, 0, q))
        at += n
    assert segment_blocks(pack(ep)) == blocks
    with pytest.raises(ValueError, match="blocked"):
        packed_hidden(tiny(), flatten_persistent(ep), "segmented")


# --- trainer ------------------------------------------------------------------------------------------

def test_lr_schedule():
    f = [lr_factor(s, 4, 20, 0.1) for s in range(20)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0] and f[4] == 1.0
    assert all(a >= b for a, b in zip(f[4:], f[5:])) and abs(lr_factor(20, 4, 20, 0.1) - 0.1) < 1e-12


def test_resume_after_interruption_matches_uninterrupted(examples, tmp_path):
    train_ex, held = split_heldout(examples, CFG.eval_fraction, 0)
    logs_a, logs_b = [], []
    a = tiny()
    sa = train(a, train_ex, held, CFG, 0, tmp_path / "a", log=lambda m, s: logs_a.append((s, m)), progress=False)
    assert sa["completed"] and sa["steps"] == 8 and sa["resumed_from"] is None
    # the same run, killed after 5 steps: its last checkpoint is from step 3, step 4-5 are lost
    b = tiny()
    part = train(b, train_ex, held, CFG, 0, tmp_path / "b", progress=False, stop_after=5)
    assert part == {"completed": False, "step": 5, "total_steps": 8}
    assert json.loads((tmp_path / "b/meta.json").read_text())["step"] == 3
    state = torch.load(tmp_path / "b/state.pt", weights_only=True)  # tensors and numbers only
    assert set(state) == {"optimizer", "scheduler", "rng"}
    # a fresh model object from the same init, resumed from the checkpoint
    c = tiny()
    sc = train(c, train_ex, held, CFG, 0, tmp_path / "b", log=lambda m, s: logs_b.append((s, m)), progress=False)
    assert sc["resumed_from"] == 3 and sc["steps"] == 8
    for (name, p), q in zip(a.named_parameters(), c.parameters()):
        assert (p - q).abs().max().item() <= 1e-6, name
    assert abs(sa["heldout"]["target_loss"] - sc["heldout"]["target_loss"]) <= 1e-6
    losses = lambda logs: {s: m["train_loss"] for s, m in logs if "train_loss" in m}  # noqa: E731
    la, lb = losses(logs_a), losses(logs_b)
    assert sorted(lb) == [4, 5, 6, 7, 8] and all(abs(la[s] - lb[s]) <= 1e-6 for s in lb)
    # a checkpoint of another run (other config) is never resumed
    d = tiny()
    sd = train(d, train_ex, held, replace(CFG, lr=1e-3), 0, tmp_path / "b", progress=False, stop_after=1)
    assert sd["step"] == 1  # started from scratch, not from step 3


def test_snapshots_are_the_weights_after_their_steps(examples, tmp_path):
    train_ex, held = split_heldout(examples, CFG.eval_fraction, 0)
    cfg = replace(CFG, snapshots=(3, 5))
    snaps = {}

    def keep(info):
        snaps[info["step"]] = ({k: v.clone() for k, v in model.state_dict().items()}, info)

    model = tiny()
    full = train(model, train_ex, held, cfg, 0, tmp_path / "full", progress=False, snapshot=keep)
    assert sorted(snaps) == [3, 5] and all(i["steps"] == 8 and i["fingerprint"] == full["fingerprint"]
                                           for _, i in snaps.values())
    for step in (3, 5):  # the same run cut after `step` steps: its weights are the snapshot's
        cut = tiny()
        train(cut, train_ex, held, cfg, 0, tmp_path / f"cut{step}", progress=False, stop_after=step)
        for k, v in cut.state_dict().items():
            assert torch.equal(v, snaps[step][0][k]), (step, k)
    with pytest.raises(ValueError, match="snapshots"):
        TrainConfig.from_section({**TINY_SFT, "student": {"steps": 4, "snapshots": [4]}}, "student")
    with pytest.raises(ValueError, match="snapshots"):
        TrainConfig.from_section({**TINY_SFT, "student": {"steps": 9, "snapshots": [5, 2]}}, "student")


def test_snapshot_cli_publishes_the_runs_own_snapshot_only(tmp_path, capsys):
    from memopd.cli import main
    from memopd.models import load_model, train_tokenizer
    from memopd.records import save_episodes

    init = tmp_path / "init"
    tiny().save_pretrained(init)
    train_tokenizer([f"word{i} thing{i % 7}" for i in range(200)], 300, init, min_frequency=2)
    save_episodes(tmp_path / "ex.parquet", turn_examples(episodes(), min_reward=0.5)[0])
    sft = {**TINY_SFT, "seq_len": 160, "student": {"steps": 4, "snapshots": [2, 3]}}
    main(["sft", "train", "--cfg", json.dumps(sft), "--seed", "1", "--threads", "1", "--role", "student",
          "--examples", str(tmp_path / "ex.parquet"), "--init", str(init), "--out", str(tmp_path / "sft")])
    main(["sft", "snapshot", "--model", str(tmp_path / "sft"), "--step", "2", "--out", str(tmp_path / "s2")])
    rec = json.loads((tmp_path / "s2" / "memopd_model.json").read_text())
    final = json.loads((tmp_path / "sft" / "memopd_model.json").read_text())
    assert rec["snapshot"]["step"] == 2 and rec["snapshot"]["fingerprint"] == final["sft"]["fingerprint"]
    s2, last = load_model(tmp_path / "s2"), load_model(tmp_path / "sft")
    assert any(not torch.equal(a, b) for a, b in zip(s2.parameters(), last.parameters()))
    capsys.readouterr()
    for step, why in ((5, "no snapshot after step 5"), (3, "another run")):
        if step == 3:  # a snapshot left by a run of other settings
            path = tmp_path / "sft" / "snapshots" / "step_3" / "memopd_model.json"
            path.write_text(json.dumps({**rec, "snapshot": {**rec["snapshot"], "fingerprint": "0" * 16}}))
        with pytest.raises(SystemExit) as e:
            main(["sft", "snapshot", "--model", str(tmp_path / "sft"), "--step", str(step), "--out",
                  str(tmp_path / f"s{step}")])
        assert e.value.code == 2 and why in capsys.readouterr().err and not (tmp_path / f"s{step}").exists()


def test_training_lowers_the_target_loss(examples):
    cfg = replace(CFG, steps=30, lr=1e-2, warmup_steps=3, eval_every=0, checkpoint_every=1000)
    model = tiny()
    before = evaluate(model, examples, cfg)["target_loss"]
    logs = []
    train(model, examples, [], cfg, 0, "/nonexistent-unused", log=lambda m, s: logs.append(m), progress=False)
    after = evaluate(model, examples, cfg)["target_loss"]
    assert after < before - 0.5 and logs[-1]["lr"] < logs[5]["lr"]


def test_every_batch_mode_trains_the_same_objective(examples):
    """packed (dense mask), packed (segmented) and padded training: the same per-step losses."""
    curves = {}
    for mode, backend in (("packed", "sdpa"), ("packed", "segmented"), ("padded", "sdpa")):
        logs = []
        train(tiny(), examples, [], replace(CFG, mode=mode, attention=backend, steps=4, checkpoint_every=1000), 0,
              "/nonexistent-unused", log=lambda m, s: logs.append(m["train_loss"]), progress=False)
        curves[f"{mode}/{backend}"] = logs
    ref = curves.pop("packed/sdpa")
    for path, losses in curves.items():
        assert len(losses) == 4 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, ref)), path


def test_config_from_section_merges_the_role_and_rejects_unknown_keys():
    section = {k: v for k, v in CFG.__dict__.items() if k not in ("steps", "epochs")}
    section.update(min_reward=0.5, student={"steps": 5}, teacher={"epochs": 2, "lr": 1e-4})
    assert TrainConfig.from_section(section, "student").steps == 5
    t = TrainConfig.from_section(section, "teacher")
    assert t.epochs == 2 and t.steps is None and t.lr == 1e-4
    with pytest.raises(ValueError, match="bogus"):
        TrainConfig.from_section({**section, "bogus": 1}, "student")
    with pytest.raises(ValueError, match="exactly one"):
        TrainConfig.from_section({**section, "student": {"steps": 5, "epochs": 1}}, "student")


def _ddp_worker(rank, world, port, examples, cfg, out):
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model = tiny()
    logs = []
    train(model, examples, [], cfg, 0, out + "/ck", log=lambda m, s: logs.append(m), progress=False)
    if rank == 0:
        torch.save({k: v.detach() for k, v in model.state_dict().items()}, out + "/w.pt")
        (Path(out) / "logs.json").write_text(json.dumps(logs))
    dist.destroy_process_group()


def test_two_ranks_equal_one_rank_with_twice_the_accumulation(examples, tmp_path):
    """DDP (gloo on CPU; the same code runs NCCL under torchrun): world 2 x accumulation 1 takes the
    same bins per step as world 1 x accumulation 2, so the weights must agree."""
    import socket

    import torch.multiprocessing as mp

    cfg = replace(CFG, steps=4, eval_every=0, checkpoint_every=1000)
    single, logs = tiny(), []
    train(single, examples, [], cfg, 0, tmp_path / "single", log=lambda m, s: logs.append(m), progress=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # spawn, not fork: a child forked from a process whose thread pools run can corrupt its heap (seen once:
    # "malloc(): unaligned tcache chunk detected"); spawn re-imports torch, a few seconds
    mp.start_processes(_ddp_worker, args=(2, port, examples, replace(cfg, grad_accum=1), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    w = torch.load(tmp_path / "w.pt", weights_only=True)
    for k, v in single.state_dict().items():
        assert (v - w[k]).abs().max().item() <= 1e-5, k
    # Adam hides a wrong gradient scale in the weights; the loss and the gradient norm do not
    for a, b in zip(logs, json.loads((tmp_path / "logs.json").read_text()), strict=True):
        for key in ("train_loss", "grad_norm", "target_tokens"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), key


@pytest.mark.gpu
def test_bf16_autocast_training_on_gpu(examples, tmp_path):
    model = tiny().cuda()
    cfg = replace(CFG, precision="bf16", attention="segmented", steps=20, lr=1e-2, eval_every=0, checkpoint_every=1000)
    before = evaluate(model, examples, cfg)["target_loss"]
    train(model, examples, [], cfg, 0, tmp_path / "ck", progress=False)
    assert next(model.parameters()).dtype == torch.float32  # fp32 master weights
    assert evaluate(model, examples, cfg)["target_loss"] < before - 0.3


@pytest.mark.gpu
def test_torchrun_multi_gpu(tmp_path):
    """Two GPUs under torchrun (NCCL, DDP) follow one GPU with twice the accumulation: same losses and
    gradient norms per step (GPU kernels reassociate sums, so tolerances are looser than on CPU)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    import subprocess
    import sys

    from memopd.records import save_episodes

    save_episodes(tmp_path / "ex.parquet", turn_examples(episodes(), 0.5)[0])
    script = tmp_path / "run.py"
    script.write_text(f"""
import json, sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
from dataclasses import replace
from test_sft import tiny, CFG
from memopd.records import load_episodes
from memopd.dist import dist_info, setup_distributed
from memopd.sft.trainer import train
dev = setup_distributed()
model, logs = tiny().to(dev), []
cfg = replace(CFG, steps=4, grad_accum=int(sys.argv[1]), eval_every=0, checkpoint_every=1000)
train(model, load_episodes({str(tmp_path / "ex.parquet")!r}), [], cfg, 0, sys.argv[2] + ".ck",
      log=lambda m, s: logs.append(m), progress=False)
if dist_info()[0] == 0:
    torch.save({{k: v.cpu() for k, v in model.state_dict().items()}}, sys.argv[2])
    open(sys.argv[2] + ".json", "w").write(json.dumps(logs))
""")

    def run(n, acc, out):
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                        str(script), acc, str(out)], check=True, timeout=600)

    run(2, "1", tmp_path / "two.pt")
    run(1, "2", tmp_path / "one.pt")
    la = json.loads((tmp_path / "two.pt.json").read_text())
    lb = json.loads((tmp_path / "one.pt.json").read_text())
    for a, b in zip(la, lb, strict=True):
        assert a["target_tokens"] == b["target_tokens"]
        assert abs(a["train_loss"] - b["train_loss"]) <= 1e-4 * abs(b["train_loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-3 * abs(b["grad_norm"])
    wa, wb = torch.load(tmp_path / "two.pt", weights_only=True), torch.load(tmp_path / "one.pt", weights_only=True)
    assert all((wa[k] - wb[k]).abs().max() <= 2e-3 for k in wa)


def test_bench_runs_every_path_on_the_same_batches(examples):
    from memopd.sft.bench import bench_sft

    seg, dense, padded = bench_sft(tiny(), examples, 160, 1e-3, seed=0, warmup=1, progress=False)
    assert [r["path"] for r in (seg, dense, padded)] == ["packed/segmented", "packed/sdpa", "padded"]
    assert seg["real_tokens"] == dense["real_tokens"] == padded["real_tokens"] == seg["computed_tokens"] > 0
    assert padded["computed_tokens"] > padded["real_tokens"] and seg["padding_fraction"] == 0
    for r in (dense, padded):  # the same objective on the same weights
        assert abs(r["first_loss"] - seg["first_loss"]) < 1e-5
    assert padded["speedup_over_padded"] == 1.0


# --- LM pre-training stage --------------------------------------------------------------------------

def test_lm_examples_make_every_token_a_target_once():
    from memopd.sft.data import lm_examples

    texts = [list(range(10, 10 + n)) for n in (1, 2, 7, 8, 9, 16, 17)]
    ex = lm_examples(texts, max_len=8)
    targets, firsts = {}, {}
    for x in ex:
        x.validate()
        assert example_len(x) <= 8
        inv = x.invocations[0]
        targets.setdefault(x.metrics["source_task"], []).extend(inv.output_ids)
        firsts.setdefault(x.metrics["source_task"], inv.input_ids)
    # every token after a text's first is predicted exactly once, in order; a 1-token text gives nothing
    assert targets == {str(i): t[1:] for i, t in enumerate(texts) if len(t) > 1}
    assert all(firsts[str(i)] == t[:1] for i, t in enumerate(texts) if len(t) > 1)
    assert [len(x.invocations[0].output_ids) for x in ex if x.metrics["source_task"] == "6"] == [7, 7, 2]
    with pytest.raises(ValueError):
        lm_examples(texts, max_len=1)


def test_copy_examples_target_is_the_context_span():
    from memopd.sft.data import copy_examples

    texts = [list(range(100 * i, 100 * i + 60)) for i in range(1, 6)] + [[7, 8]]
    ex = copy_examples(texts, per_text=3, span=(4, 9), sep=[1], eos=2, seed=0)
    assert 3 * 5 <= len(ex) <= 3 * 6  # the 2-token text can only give spans that fit
    for x in ex:
        x.validate()
        inv = x.invocations[0]
        span = inv.input_ids[:-1]
        assert inv.input_ids[-1] == 1 and inv.output_ids == span + [2] and 4 <= len(span) <= 9
        src = texts[int(x.task_id.split("/")[1])]
        assert any(src[i : i + len(span)] == span for i in range(len(src)))
    again = copy_examples(texts, per_text=3, span=(4, 9), sep=[1], eos=2, seed=0)
    assert [x.invocations[0].output_ids for x in again] == [x.invocations[0].output_ids for x in ex]
    other = copy_examples(texts, per_text=3, span=(4, 9), sep=[1], eos=2, seed=1)
    assert [x.invocations[0].output_ids for x in other] != [x.invocations[0].output_ids for x in ex]
    assert copy_examples(texts, per_text=0, span=(4, 9), sep=[1], eos=2, seed=0) == []


def test_repeat_examples_are_random_sequences_given_twice():
    from memopd.sft.data import repeat_examples

    vocab = list(range(100, 140))
    ex = repeat_examples(vocab, 400, (3, 9), sep=[7, 8], eos=2, seed=5)
    assert len(ex) == 400 and len({x.task_id for x in ex}) == 400
    for x in ex:
        inv = x.invocations[0]
        s = inv.output_ids[:-1]
        assert inv.input_ids == s + [7, 8] and inv.output_ids[-1] == 2 and 3 <= len(s) <= 9
        assert set(s) <= set(vocab) and x.metrics["source_task"] == x.task_id
    drawn = [t for x in ex for t in x.invocations[0].output_ids[:-1]]
    counts = np.bincount(drawn, minlength=140)[100:]
    assert counts.min() > 0.5 * len(drawn) / 40 and counts.max() < 1.5 * len(drawn) / 40  # uniform over vocab
    lengths = [len(x.invocations[0].output_ids) - 1 for x in ex]
    assert set(lengths) == set(range(3, 10))  # every length of the range occurs
    same = repeat_examples(vocab, 400, (3, 9), sep=[7, 8], eos=2, seed=5)
    assert [x.invocations[0].input_ids for x in same] == [x.invocations[0].input_ids for x in ex]
    other = repeat_examples(vocab, 400, (3, 9), sep=[7, 8], eos=2, seed=6)
    assert [x.invocations[0].input_ids for x in other] != [x.invocations[0].input_ids for x in ex]
    assert repeat_examples([], 0, (3, 9), [7], 2, 0) == []
    for bad in [(0, 4), (5, 4)]:
        with pytest.raises(ValueError, match="length"):
            repeat_examples(vocab, 1, bad, [7], 2, 0)


def test_sft_repeats_config_and_its_tokens(tmp_path):
    from memopd.models import train_tokenizer
    from memopd.sft.commands import stage_repeats

    section = {**TINY_SFT, "repeats": 30, "repeat_length": [2, 5]}
    cfg = TrainConfig.from_section(section, "student")
    assert cfg.repeats == 30 and cfg.repeat_length == (2, 5)
    assert TrainConfig.from_section(TINY_SFT, "student").repeats == 0
    role = {**section, "student": {"steps": 2, "repeats": 3}}
    assert TrainConfig.from_section(role, "student").repeats == 3
    for bad in [{"repeats": -1}, {"repeats": 1, "repeat_length": [0, 3]}, {"repeats": 1, "repeat_length": [4, 3]},
                {"repeats": 1, "repeat_length": [4, 32]}]:  # 2 x 32 + 2 tokens > seq_len 64
        with pytest.raises(ValueError, match="repeat"):
            TrainConfig.from_section({**TINY_SFT, **bad}, "student")
    assert TrainConfig.from_section({**TINY_SFT, "repeats": 1, "repeat_length": [4, 31]}, "student").repeats == 1
    train_tokenizer([f"the river {i} flows into the sea near town {i % 5}" for i in range(40)], 300, tmp_path,
                    min_frequency=2)
    from memopd.models import load_tokenizer
    tok = load_tokenizer(tmp_path)
    ex = stage_repeats(str(tmp_path), cfg, seed=1)
    added = set(tok.get_added_vocab().values())
    assert len(added) > 2 and len(ex) == 30
    drawn = {t for x in ex for t in x.invocations[0].output_ids[:-1]}
    assert not drawn & added and drawn <= set(range(len(tok)))
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    for x in ex:
        inv = x.invocations[0]
        assert inv.input_ids == inv.output_ids[:-1] + newline and inv.output_ids[-1] == tok.eos_token_id
    assert stage_repeats(str(tmp_path), TrainConfig.from_section(TINY_SFT, "student"), seed=1) == []


def test_fingerprint_is_what_the_run_computes_not_how_it_is_laid_out(examples, tmp_path):
    import os
    from dataclasses import asdict

    from memopd.sft.trainer import fingerprint

    init = tmp_path / "model.safetensors"
    init.write_bytes(b"weights")
    base = fingerprint(CFG, 0, examples, 1, init)
    for changed in (dict(repeats=3), dict(repeat_length=(1, 2)), dict(layouts=("exact", "persistent")), dict(lr=1e-3)):
        assert fingerprint(replace(CFG, **changed), 0, examples, 1, init) != base, changed
    assert fingerprint(replace(CFG, activation_checkpointing=True), 0, examples, 1, init) == base
    assert fingerprint(replace(CFG, shard="fsdp"), 0, examples, 1, init) != base  # its optimizer state differs
    assert fingerprint(replace(CFG, snapshots=(2,)), 0, examples, 1, init) != base  # each asked snapshot written
    # by hand: the identity's JSON (config less the layout fields, seed, the weights file's size and mtime, world
    # size, the examples' tokens) and its SHA-256
    config = {k: v for k, v in asdict(CFG).items() if k not in ("activation_checkpointing", "shard", "snapshots")}
    tokens = hashlib.sha256()
    for x in examples:
        inv = x.invocations[0]
        tokens.update(np.array(inv.input_ids + [-1] + inv.output_ids + [-2], dtype=np.int64).tobytes())
    st = init.stat()
    identity = {"config": config, "seed": 0, "world": 1, "examples": tokens.hexdigest(),
                "init": {"path": str(init), "files": {"model.safetensors": [st.st_size, st.st_mtime_ns]}}}
    assert base == hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]
    os.utime(init, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the initial model rebuilt: another run
    assert fingerprint(CFG, 0, examples, 1, init) != base


def test_copy_examples_with_a_long_context_hold_the_source_text_among_others():
    from memopd.sft.data import copy_examples

    texts = [list(range(100 * i, 100 * i + 20)) for i in range(1, 9)]  # disjoint ids: a text is found by its ids
    ex = copy_examples(texts, per_text=2, span=(3, 5), sep=[1], eos=2, seed=0, context=4)
    assert len(ex) == 2 * 8
    places = set()
    for x in ex:
        inv = x.invocations[0]
        src = texts[int(x.task_id.split("/")[1])]
        chunks, cur = [], []
        for t in inv.input_ids:  # the context: 4 whole texts, each followed by the separator
            if t == 1:
                chunks.append(cur)
                cur = []
            else:
                cur.append(t)
        assert cur == [] and len(chunks) == 4 and all(c in texts for c in chunks)
        assert src in chunks
        places.add(chunks.index(src))
        span = inv.output_ids[:-1]
        assert inv.output_ids[-1] == 2 and 3 <= len(span) <= 5
        assert any(src[i : i + len(span)] == span for i in range(len(src)))
    assert len(places) > 1  # the source text is not always at the same place
    with pytest.raises(ValueError, match="context"):
        copy_examples(texts, per_text=1, span=(3, 5), sep=[1], eos=2, seed=0, context=0)


def test_pretrain_stage_takes_its_budgets_and_no_heldout():
    from memopd.sft.trainer import pretrain_steps, stage_section

    section = {k: v for k, v in CFG.__dict__.items() if k not in ("steps", "epochs")}
    section.update(min_reward=0.5, student={"steps": 5}, teacher={"epochs": 2},
                   pretrain={"copy": {"per_text": 1, "span": [4, 8]}, "student": {"steps": 11, "lr": 2e-3}})
    pre = TrainConfig.from_section(stage_section(section, "pretrain"), "student")
    assert pre.steps == 11 and pre.lr == 2e-3 and pre.eval_fraction == 0.0 and pre.seq_len == CFG.seq_len
    assert TrainConfig.from_section(stage_section(section, "sft"), "student").steps == 5
    assert pretrain_steps(section, "student") == 11 and pretrain_steps(section, "teacher") == 0
    with pytest.raises(ValueError, match="no section for role 'teacher'"):
        TrainConfig.from_section(stage_section(section, "pretrain"), "teacher")
    with pytest.raises(ValueError, match="stage"):
        stage_section(section, "bogus")


def test_pretrain_cli_then_sft_from_its_output(tmp_path, capsys):
    """`sft lm-data` (corpus -> LM + copy examples) and `sft train --stage pretrain`, whose output SFT then
    starts from; the model record keeps both stages."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from memopd.cli import main
    from memopd.models import train_tokenizer

    texts = [f"passage {i} says that the river {i % 7} flows into the sea near town {i % 5}" for i in range(40)]
    pq.write_table(pa.table({"id": [f"p{i}" for i in range(40)], "title": [f"T{i}" for i in range(40)],
                             "text": texts, "source": ["test"] * 40}), tmp_path / "corpus.parquet")
    init = tmp_path / "init"
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
                                 use_sliding_window=False)).save_pretrained(init)
    train_tokenizer(texts, 300, init, min_frequency=2)
    sft = {**TINY_SFT, "pretrain": {"lm_text": True, "copy": {"per_text": 1, "span": [3, 6]}, "student": {"steps": 3}}}
    common = ["--cfg", json.dumps(sft), "--seed", "3"]
    main(["sft", "lm-data", *common, "--corpus", str(tmp_path / "corpus.parquet"), "--tokenizer", str(init),
          "--out", str(tmp_path / "lm.parquet"), "--stats", str(tmp_path / "lm.json")])
    stats = json.loads((tmp_path / "lm.json").read_text())
    assert stats["passages"] == 40 and stats["lm_examples"] == 40 and stats["copy_examples"] == 40
    lm = load_episodes(tmp_path / "lm.parquet")
    assert len(lm) == 80 and all(example_len(x) <= 64 for x in lm)
    capsys.readouterr()
    main(["sft", "train", *common, "--threads", "1", "--stage", "pretrain", "--role", "student",
          "--examples", str(tmp_path / "lm.parquet"), "--init", str(init), "--out", str(tmp_path / "student_lm")])
    assert "no held-out examples" in capsys.readouterr().out  # pre-training holds none out: no "loss nan"
    main(["sft", "train", *common, "--threads", "1", "--role", "student", "--examples", str(tmp_path / "lm.parquet"),
          "--init", str(tmp_path / "student_lm"), "--out", str(tmp_path / "student_sft")])
    assert re.search(r"held-out target loss \d+\.\d{4} ->", capsys.readouterr().out)
    info = json.loads((tmp_path / "student_sft" / "memopd_model.json").read_text())
    assert info["pretrain"]["steps"] == 3 and info["pretrain"]["config"]["eval_fraction"] == 0.0
    assert info["sft"]["steps"] == 2 and info["init"] == str(tmp_path / "student_lm")
    # sft.repeats: that many more training examples in either stage, the held-out split unchanged
    with_repeats = {**sft, "repeats": 7, "repeat_length": [4, 12], "pretrain": {**sft["pretrain"], "student": {"steps": 3, "repeats": 4}}}
    common = ["--cfg", json.dumps(with_repeats), "--seed", "3", "--threads", "1", "--role", "student"]
    main(["sft", "train", *common, "--stage", "pretrain", "--examples", str(tmp_path / "lm.parquet"),
          "--init", str(init), "--out", str(tmp_path / "rep_lm")])
    main(["sft", "train", *common, "--examples", str(tmp_path / "lm.parquet"), "--init", str(tmp_path / "rep_lm"),
          "--out", str(tmp_path / "rep_sft")])
    rep = json.loads((tmp_path / "rep_sft" / "memopd_model.json").read_text())
    assert rep["pretrain"]["train_examples"] == info["pretrain"]["train_examples"] + 4
    assert rep["sft"]["train_examples"] == info["sft"]["train_examples"] + 7
    assert rep["sft"]["heldout_examples"] == info["sft"]["heldout_examples"] > 0
    assert rep["sft"]["fingerprint"] != info["sft"]["fingerprint"]
    sft["pretrain"]["lm_text"] = False
    main(["sft", "lm-data", "--cfg", json.dumps(sft), "--seed", "3", "--corpus", str(tmp_path / "corpus.parquet"),
          "--tokenizer", str(init), "--out", str(tmp_path / "copy.parquet"), "--stats", str(tmp_path / "copy.json")])
    assert json.loads((tmp_path / "copy.json").read_text())["lm_examples"] == 0
    assert len(load_episodes(tmp_path / "copy.parquet")) == 40


def test_sft_commands_open_the_process_group_with_the_configs_timeout(tmp_path, monkeypatch):
    """`memopd sft train` and `sft eval` pass sft.dist_timeout_min to the process group (ranks wait in a barrier while
    rank 0 writes a checkpoint of up to ~92 GB) and give each rank of the node its share of --threads."""
    import memopd.dist
    from memopd.cli import main

    class Opened(Exception):
        pass

    seen = []

    def setup_distributed(timeout_min=None):  # records the call, then stops the command before any work
        seen.append((timeout_min, torch.get_num_threads()))
        raise Opened

    monkeypatch.setattr(memopd.dist, "setup_distributed", setup_distributed)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    (tmp_path / "examples.parquet").touch()
    (tmp_path / "model").mkdir()
    sft = {**TINY_SFT, "dist_timeout_min": 7.5}
    common = ["--cfg", json.dumps(sft), "--seed", "3", "--threads", "4", "--role", "student",
              "--examples", str(tmp_path / "examples.parquet")]
    before = torch.get_num_threads()
    try:
        for argv in (["sft", "train", *common, "--init", str(tmp_path / "model"), "--out", str(tmp_path / "out")],
                     ["sft", "eval", *common, "--name", "x", "--model", str(tmp_path / "model"),
                      "--out", str(tmp_path / "eval.json")]):
            with pytest.raises(Opened):
                main(argv)
    finally:
        torch.set_num_threads(before)
    assert seen == [(7.5, 2), (7.5, 2)]


def test_a_role_trains_on_its_layouts_and_is_held_out_on_the_exact_states(tmp_path):
    """`sft examples` writes every state some role asks for; `sft train` trains each role on its own (the teacher
    on both here, the student on the exact states) and evaluates both on the exact states of the held-out split."""
    from memopd.cli import main
    from memopd.models import train_tokenizer
    from memopd.records import save_episodes

    init = tmp_path / "init"
    tiny().save_pretrained(init)
    train_tokenizer([f"word{i} and word{i + 1}" for i in range(60)], 300, init, min_frequency=2)
    save_episodes(tmp_path / "traj.parquet", episodes())
    sft = {**TINY_SFT, "teacher": {"steps": 1, "layouts": ["exact", "persistent"]}, "student": {"steps": 1},
           "seq_len": 256}
    common = ["--cfg", json.dumps(sft), "--seed", "3"]
    main(["sft", "examples", *common, "--teacher", "scripted", "--episodes", str(tmp_path / "traj.parquet"),
          "--out", str(tmp_path / "ex.parquet"), "--stats", str(tmp_path / "ex.json")])
    examples = load_episodes(tmp_path / "ex.parquet")
    train_ex, held = split_heldout(examples, sft["eval_fraction"], 3)
    assert of_layouts(examples, ("persistent",)) and held
    for role in ("student", "teacher"):
        main(["sft", "train", *common, "--threads", "1", "--role", role, "--examples", str(tmp_path / "ex.parquet"),
              "--init", str(init), "--out", str(tmp_path / role)])
        info = json.loads((tmp_path / role / "memopd_model.json").read_text())["sft"]
        layouts = ("exact", "persistent") if role == "teacher" else ("exact",)
        assert info["train_examples"] == len(of_layouts(train_ex, layouts)), role
        assert info["heldout_examples"] == len(of_layouts(held, ("exact",))), role
