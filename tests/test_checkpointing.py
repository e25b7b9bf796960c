"""Activation checkpointing (SFT and the PPO update) and FSDP2-sharded SFT.

Checkpointing recomputes each decoder layer in the backward: in fp32 the loss and every gradient must be
those of the plain forward, under each attention backend the trainers use (the packed backends switch the
attention implementation only around their forward, so the recomputation must switch it back: see
parallel._recompute_attention_as_forward). FSDP SFT on 2 gloo ranks must give the weights of one process
with twice the accumulation (the same bins per step), and a checkpoint of a sharded run (whole tensors,
written by rank 0) must resume to the uninterrupted run's weights."""
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_sft import CFG, examples, one_thread, tiny  # noqa: F401  (fixtures: the SFT tests' examples, one thread)
from test_train import _episodes, _free_port, _setup

from memopd import parallel
from memopd.sft.loss import target_loss
from memopd.sft.trainer import TrainConfig, train
from memopd.train.update import PPOConfig, ppo_update


def tiny_tied(seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=True, use_sliding_window=False))


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    return (a - b).abs().max().item() <= rel * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("mode,backend", [("packed", "segmented"), ("packed", "sdpa"), ("packed", "eager"),
                                          ("padded", "sdpa")])
def test_sft_checkpointing_gives_the_same_loss_and_gradients(examples, mode, backend):
    """One SFT micro-batch (a full pack) with and without checkpointing: the same loss and gradients (fp32)."""
    batch = examples[:6]
    out = {}
    for ckpt in (False, True):
        model = tiny().train()
        if ckpt:
            parallel.checkpoint_activations(model)
            assert parallel.is_checkpointed(model)
        s, n = target_loss(model, batch, mode, CFG.seq_len * 2, backend)
        (s / n).backward()
        out[ckpt] = (s.item(), {k: p.grad.clone() for k, p in model.named_parameters()})
    assert out[True][0] == pytest.approx(out[False][0], rel=1e-6)
    for k, g in out[False][1].items():
        assert _close(out[True][1][k], g, 1e-6), k


def test_sft_training_with_checkpointing_follows_the_plain_run(examples, tmp_path):
    """A few optimizer steps of the trainer with `activation_checkpointing`: the same losses and weights."""
    cfg = replace(CFG, steps=3, eval_every=0, checkpoint_every=1000, attention="segmented")
    runs = {}
    for ckpt in (False, True):
        model, logs = tiny(), []
        train(model, examples, [], replace(cfg, activation_checkpointing=ckpt), 0, tmp_path / str(ckpt),
              log=lambda m, s, logs=logs: logs.append(m["train_loss"]), progress=False)
        runs[ckpt] = (logs, model.state_dict())
    assert runs[True][0] == pytest.approx(runs[False][0], rel=1e-6)
    for k, v in runs[False][1].items():
        assert _close(runs[True][1][k], v, 1e-6), k


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_ppo_update_with_checkpointing_equals_the_plain_update(backend):
    """A memopd update (2 minibatches, OPD on) with checkpointed policy and critic (the critic's backbone is
    a causal LM inside ValueModel): the same metrics (losses, gradient norms) and weights."""
    runs = {}
    for ckpt in (False, True):
        policy, ref, critic, teacher, a_opt, c_opt = _setup()
        if ckpt:
            parallel.checkpoint_activations(policy)
            parallel.checkpoint_activations(critic)
            assert parallel.is_checkpointed(critic) and not parallel.is_checkpointed(ref)
        m = ppo_update(_episodes(), policy, ref, critic, teacher, a_opt, c_opt,
                       PPOConfig(method="memopd", opd_lambda=0.5, minibatch_episodes=2, attention=backend))
        runs[ckpt] = (m, {**{f"p.{k}": v for k, v in policy.state_dict().items()},
                          **{f"c.{k}": v for k, v in critic.state_dict().items()}})
    for k in ("actor/loss", "value/loss", "opd/loss", "actor/grad_norm", "critic/grad_norm"):
        assert runs[True][0][k] == pytest.approx(runs[False][0][k], rel=1e-6, abs=1e-9), k
    for k, v in runs[False][1].items():
        assert _close(runs[True][1][k], v, 1e-6), k


def test_prefix_shared_refuses_checkpointed_models():
    """prefix_shared runs the calls against the prefix's KV cache, which checkpointed layers drop."""
    policy, ref, critic, teacher, a_opt, c_opt = _setup()
    parallel.checkpoint_activations(policy)
    with pytest.raises(ValueError, match="prefix_shared"):
        ppo_update(_episodes(), policy, ref, critic, teacher, a_opt, c_opt,
                   PPOConfig(method="memopd", attention="prefix_shared", rce_sample=0))


def test_config_options_and_defaults():
    section = {k: v for k, v in CFG.__dict__.items() if k not in ("steps", "epochs", "shard", "activation_checkpointing")}
    section.update(min_reward=0.5, student={"steps": 5})
    plain = TrainConfig.from_section(section, "student")
    assert plain.shard == "none" and plain.activation_checkpointing is False  # the embedded default
    both = TrainConfig.from_section({**section, "shard": "fsdp", "activation_checkpointing": True}, "student")
    assert both.shard == "fsdp" and both.activation_checkpointing
    with pytest.raises(ValueError, match="shard"):
        TrainConfig.from_section({**section, "shard": "ddp"}, "student")


# --- FSDP2 SFT on 2 gloo ranks --------------------------------------------------------------------------

def _fsdp_worker(rank, world, port, examples, cfg, out, job):
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from memopd.parallel import full_state_dict as whole_tensors

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # a mismatched collective fails, not hangs
    make = tiny_tied if job == "resume" else tiny
    if job == "equal":
        model, logs = make(), []
        held = examples[:5]
        s = train(model, examples, held, cfg, 0, out + "/ck", log=lambda m, s: logs.append(m), progress=False)
        w = whole_tensors(model, keep=rank == 0)
        assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())  # really sharded
        if rank == 0:
            torch.save(w, out + "/w.pt")
            (Path(out) / "logs.json").write_text(json.dumps({"logs": logs, "heldout": s["heldout"]}))
    else:  # uninterrupted; killed after 4 steps (checkpoint at 3); resumed from it in a fresh model
        results = {}
        for name, stop in (("a", None), ("b", 4), ("c", None)):
            model = make()
            s = train(model, examples, [], cfg, 0, out + ("/a" if name == "a" else "/b"), progress=False,
                      stop_after=stop)
            results[name] = (s, whole_tensors(model, keep=rank == 0))
        if rank == 0:
            torch.save({k: w for k, (_, w) in results.items()}, out + "/w.pt")
            (Path(out) / "summary.json").write_text(json.dumps({k: s for k, (s, _) in results.items()}))
    dist.destroy_process_group()


def _spawn(*args):
    import torch.multiprocessing as mp

    # spawn, not fork: a child forked from a process whose thread pools run can corrupt its heap (seen once:
    # "malloc(): unaligned tcache chunk detected"); spawn re-imports torch, a few seconds
    mp.start_processes(_fsdp_worker, args=(2, _free_port(), *args), nprocs=2, start_method="spawn")


def test_fsdp_sft_on_two_ranks_equals_one_process(examples, tmp_path):
    """FSDP2 (fp32 shards, sum reduce-scatter) with activation checkpointing, world 2 x accumulation 1,
    against one plain process with accumulation 2 (the same bins per step): the same losses, gradient
    norms, held-out loss and weights (fp32, 1e-5 relative)."""
    cfg = replace(CFG, steps=4, eval_every=2, checkpoint_every=1000, attention="segmented")
    held = examples[:5]
    single, logs = tiny(), []
    s1 = train(single, examples, held, cfg, 0, tmp_path / "single", log=lambda m, s: logs.append(m), progress=False)
    _spawn(examples, replace(cfg, grad_accum=1, shard="fsdp", activation_checkpointing=True), str(tmp_path), "equal")
    w = torch.load(tmp_path / "w.pt", weights_only=True)
    moved = [k for k, v in single.state_dict().items() if not torch.equal(v, tiny().state_dict()[k])]
    assert moved
    for k, v in single.state_dict().items():
        assert _close(w[k], v, 1e-5), k
    two = json.loads((tmp_path / "logs.json").read_text())
    for a, b in zip(logs, two["logs"], strict=True):
        for key in a:
            if key != "tokens_per_s":
                assert b[key] == pytest.approx(a[key], rel=1e-5), key
    assert two["heldout"]["target_loss"] == pytest.approx(s1["heldout"]["target_loss"], rel=1e-5)


def test_fsdp_sft_checkpoint_resumes_to_the_same_weights(examples, tmp_path):
    """A sharded run (tied embeddings) killed after 4 steps resumes from its step-3 checkpoint to the weights
    of the uninterrupted run; a checkpoint holds whole tensors (the tied one once) that load into an
    unsharded model."""
    from memopd.checkpoint import load_tensors

    cfg = replace(CFG, steps=6, eval_every=0, checkpoint_every=3, grad_accum=1, shard="fsdp")
    _spawn(examples, cfg, str(tmp_path), "resume")
    w = torch.load(tmp_path / "w.pt", weights_only=True)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["b"] == {"completed": False, "step": 4, "total_steps": 6}
    assert s["c"]["resumed_from"] == 3 and s["a"]["resumed_from"] is None
    for k, v in w["a"].items():
        assert torch.equal(w["c"][k], v), k
    # the last checkpoint is at the last step, kept until the caller has exported the model (c finished)
    assert json.loads((tmp_path / "b/meta.json").read_text())["step"] == 6
    stored = load_tensors(tmp_path / "a" / "model.safetensors")  # a's last checkpoint, at step 6
    plain = tiny_tied()
    assert set(stored) == set(plain.state_dict())
    assert stored["lm_head.weight"].data_ptr() == stored["model.embed_tokens.weight"].data_ptr()  # stored once
    plain.load_state_dict(stored)
    state = torch.load(tmp_path / "a" / "state.pt", weights_only=True)
    assert any(k.endswith("model.embed_tokens.weight") for k in state["optimizer"]["state"])  # keyed by name


def test_a_checkpoints_state_is_mapped_not_read(tmp_path):
    """Resume on several ranks of a node: state.pt is memory-mapped, so opening it costs no host memory until a
    rank touches what it keeps (measured: the resident memory of a process before and after it opens a 400 MB state)."""
    import subprocess
    import sys

    torch.save({"optimizer": {"state": {0: {"exp_avg": torch.ones(100_000_000)}}}}, tmp_path / "state.pt")
    script = ("import re, sys, torch\nfrom memopd.checkpoint import read_state\n"
              "rss = lambda: int(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
              "before = rss()\ns = read_state(sys.argv[1])\nt = s['optimizer']['state'][0]['exp_avg']\n"
              "opened = rss()\nassert float(t[12345]) == 1.0 and t.numel() == 100_000_000\n"
              "print((opened - before) / 1024)\n")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True)
    assert float(out.stdout.strip()) < 50  # MB: a read of the file would add ~400
