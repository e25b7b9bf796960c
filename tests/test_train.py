"""One PPO / MemOPD step on tiny models: runs, changes weights, lambda = 0 equals PPO, RCE guard fires."""
import copy
import gc
import random

import pytest
import torch

from memopd.rce import RCEError
from memopd.synthetic import random_episode
from memopd import parallel
from memopd.train.update import PPOConfig, ValueModel, ppo_update, score_batch
from memopd.generation.weight_sync import policy_weights


def _lm(hidden, seed):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                        tie_word_embeddings=False, use_sliding_window=False)).eval()


def _setup():
    policy = _lm(32, 0)
    ref, critic, teacher = copy.deepcopy(policy), ValueModel(copy.deepcopy(policy)), _lm(48, 1)
    a_opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    c_opt = torch.optim.AdamW(critic.parameters(), lr=1e-3)
    return policy, ref, critic, teacher, a_opt, c_opt


def _episodes(n=4, seed=0):
    rng = random.Random(seed)
    pool = [rng.randrange(256) for _ in range(2000)]
    eps = [random_episode(rng, pool, "summary_replacement", 3, 8, (2, 8), (2, 6), task_id=f"e{i}") for i in range(n)]
    for e in eps:
        e.reward = rng.random()
    return eps


@pytest.mark.parametrize("method", ["ppo", "memopd", "memopd_persistent"])
def test_one_step_runs_and_changes_the_weights(method):
    policy, ref, critic, teacher, a_opt, c_opt = _setup()
    before = copy.deepcopy(policy.state_dict())
    t_before = copy.deepcopy(teacher.state_dict())
    m = ppo_update(_episodes(), policy, ref, critic, teacher, a_opt, c_opt,
                   PPOConfig(method=method, opd_lambda=0.5, minibatch_episodes=2))
    assert any(not torch.equal(before[k], v) for k, v in policy.state_dict().items())
    assert all(torch.equal(t_before[k], v) for k, v in teacher.state_dict().items())  # frozen
    assert m["rce/max_abs_dlogp"] <= 1e-5
    assert ("opd/loss" in m) == (method != "ppo")
    if method != "ppo":
        assert m["opd/loss"] > 0


def test_lambda_zero_never_scores_the_teacher_in_the_update():
    """A MemOPD run at lambda 0 is PPO with a teacher loaded: the update computes no OPD term (no teacher-head
    pass, no OPD metric), and its step equals plain PPO's."""
    runs = {}
    for method, lam in (("memopd", 0.0), ("ppo", 0.5)):
        policy, ref, critic, teacher, a_opt, c_opt = _setup()
        m = ppo_update(_episodes(), policy, ref, critic, teacher, a_opt, c_opt,
                       PPOConfig(method=method, opd_lambda=lam, minibatch_episodes=2))
        runs[method] = (m, policy.state_dict())
    assert "opd/loss" not in runs["memopd"][0]
    assert all(torch.equal(v, runs["ppo"][1][k]) for k, v in runs["memopd"][1].items())


def test_the_matched_control_moves_only_the_teacher_state():
    policy, ref, critic, teacher, _, _ = _setup()
    eps = _episodes()
    exact = score_batch(eps, policy, ref, critic, teacher, PPOConfig(method="memopd"))
    flat = score_batch(eps, policy, ref, critic, teacher, PPOConfig(method="memopd_persistent"))
    head = teacher.get_output_embeddings()
    for a, b in zip(exact, flat):
        assert torch.equal(a.old_logp, b.old_logp) and torch.equal(a.values, b.values)
        first = (a.packed.call[a.packed.action_index] == 0)[a.teach_rows]
        diff = (head(a.teacher_hidden) - head(b.teacher_hidden)).abs().amax(-1)
        assert diff[first].max() <= 1e-5  # call 0 is the same state in both layouts
        assert diff[~first].max() > 1e-3  # later calls: the flattening is another state


def test_rce_guard_fires_before_any_update():
    policy, ref, critic, teacher, a_opt, c_opt = _setup()
    before = copy.deepcopy(policy.state_dict())
    with pytest.raises(RCEError, match=r"episode \d+ task 'e\d' call"):
        ppo_update(_episodes(), policy, ref, critic, teacher, a_opt, c_opt, PPOConfig(attention="posids_no_mask"))
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_first_ratio_is_exactly_one(dtype):
    """pi_old (and the reference) are scored through the update's forward in the update's precision
    (fp32, or bf16 autocast over fp32 weights, which CPU autocast supports): at the first minibatch,
    before any step, exp(logp - old_logp) is exactly 1 and the KL to the reference exactly 0. Measured
    0.0 for both; a pure-bf16 pi_old against the autocast update differs by ~2e-3 in log p here."""
    policy, ref, critic, teacher, a_opt, c_opt = _setup()
    m = ppo_update(_episodes(), policy, ref, critic, teacher, a_opt, c_opt,
                   PPOConfig(dtype=dtype, opd_lambda=0.5, minibatch_episodes=2, ppo_epochs=2))
    assert m["ppo/first_ratio_err"] == 0.0 and m["reward/kl_ref"] == 0.0
    assert m["rce/max_abs_dlogp"] <= {"float32": 1e-5, "bfloat16": 5e-2}[dtype]
    assert m["ppo/ratio_max"] != 1.0  # later minibatches did move the policy


def _moved_fraction(before: dict, model) -> float:
    """Share of the decoder layers' weight-matrix elements an update changed."""
    after = {k: v for k, v in model.state_dict().items() if k.startswith("model.layers.") and v.dim() == 2}
    return sum((v != before[k]).sum().item() for k, v in after.items()) / sum(v.numel() for v in after.values())


def test_a_tiny_lr_bf16_update_moves_the_fp32_master_weights():
    """lr 1e-6 (paper scale): an Adam step is ~1e-6 per element. fp32 master weights under bf16
    autocast take it (measured 99.97% of the layers' weights move); the negative control, the same
    update on pure bf16 parameters (what the trainer did before), rounds it away: half a bf16 ulp of a
    weight of size 0.02 is ~6e-5, so only weights below ~1e-4 in size can move (measured 1.8%)."""
    fractions = {}
    for params in ("float32", "bfloat16"):
        policy, ref, critic, teacher, _, _ = _setup()
        if params == "bfloat16":
            policy, ref, critic, teacher = (m.to(torch.bfloat16) for m in (policy, ref, critic, teacher))
        a_opt = torch.optim.AdamW(policy.parameters(), lr=1e-6)
        c_opt = torch.optim.AdamW(critic.parameters(), lr=1e-6)
        before = {k: v.clone() for k, v in policy.state_dict().items()}
        ppo_update(_episodes(), policy, ref, critic, teacher, a_opt, c_opt,
                   PPOConfig(dtype="bfloat16", minibatch_episodes=4))
        fractions[params] = _moved_fraction(before, policy)
    assert fractions["float32"] > 0.99
    assert fractions["bfloat16"] < 0.05


def test_unknown_method_rejected():
    with pytest.raises(ValueError, match="unknown method"):
        PPOConfig(method="dpo")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DIST_CFG = dict(method="memopd", opd_lambda=0.5, minibatch_episodes=3, ppo_epochs=2, rce_sample=1)


def _dist_worker(rank, world, port, out, shard="none", dtype="float32"):
    import json
    import os
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # a mismatched collective fails, not hangs
    policy, ref, critic, teacher, a_opt, c_opt = _setup()
    if shard == "fsdp":  # what train_run does: shard the fp32 models, then build the optimizers on the shards
        policy, ref, critic = (parallel.shard(m, dtype) for m in (policy, ref, critic))
        a_opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
        c_opt = torch.optim.AdamW(critic.parameters(), lr=1e-3)
    eps = _episodes()
    ids = list(range(rank, len(eps), world))  # the loop's split: positions rank, rank + W, ...
    m = ppo_update([eps[i] for i in ids], policy, ref, critic, teacher, a_opt, c_opt,
                   PPOConfig(**DIST_CFG, dtype=dtype), ids=ids)
    # the policy as the vLLM weight sync reads it (whole tensors gathered from the shards under FSDP)
    state = {**{f"policy.{k}": v.clone() for k, v in policy_weights(policy)},
             **{f"critic.{k}": v for k, v in parallel.full_state_dict(critic).items()}}
    torch.save(state, f"{out}/rank{rank}.pt")
    if rank == 0:
        with open(f"{out}/metrics.json", "w") as f:
            json.dump(m, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("shard", ["none", "fsdp"])
def test_two_ranks_give_the_single_process_update(tmp_path, shard):
    """gloo on CPU (the same code runs NCCL under torchrun): 4 episodes over 2 ranks, minibatches of 3
    (so the 1-episode minibatch of each epoch lies on one rank only and the other contributes zero
    gradients, or with FSDP runs a zero-loss pass to match the collectives), 2 epochs, OPD on. The
    summed gradients must give the single-process weights; the metrics (losses, gradient norms,
    advantages' normalisation) must agree too. FSDP2 runs on CPU with gloo (torch 2.13): sharded fp32
    parameters, reduce-scatter, AdamW on the shards; the replicas of `none` vs the shards of `fsdp`."""
    import json

    import torch.multiprocessing as mp

    policy, ref, critic, teacher, a_opt, c_opt = _setup()
    single = ppo_update(_episodes(), policy, ref, critic, teacher, a_opt, c_opt, PPOConfig(**DIST_CFG))
    # spawn, not fork: a child forked from a process whose thread pools run can corrupt its heap (seen once:
    # "malloc(): unaligned tcache chunk detected"); spawn re-imports torch, a few seconds
    mp.start_processes(_dist_worker, args=(2, _free_port(), str(tmp_path), shard), nprocs=2, start_method="spawn")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert all(torch.equal(r0[k], r1[k]) for k in r0)  # the replicas stay identical
    want = {**{f"policy.{k}": v for k, v in policy.state_dict().items()},
            **{f"critic.{k}": v for k, v in critic.state_dict().items()}}
    moved = [k for k in want if not torch.equal(want[k], _setup()[0].state_dict().get(k[7:], want[k]))]
    assert moved  # the update did something to compare
    for k, v in want.items():
        assert (v - r0[k]).abs().max().item() <= 1e-5, k
    two = json.loads((tmp_path / "metrics.json").read_text())
    assert set(two) == set(single)
    for k in ("actor/loss", "value/loss", "opd/loss", "actor/grad_norm", "critic/grad_norm", "ppo/ratio_max",
              "reward/task", "reward/kl_ref", "tokens/actions", "tokens/packed", "rce/max_abs_dlogp"):
        assert abs(two[k] - single[k]) <= 1e-5 * max(1.0, abs(single[k])), k


def test_fsdp_bf16_first_ratio_is_exactly_one(tmp_path):
    """The paper-scale path on 2 gloo ranks: FSDP2 with bf16 all-gathered parameters (MixedPrecisionPolicy)
    under bf16 autocast. Scoring (full parameters held by `parallel.gathered`) and the update's sharded
    forward compute the same: the first ratio is exactly 1 and the KL to the reference exactly 0
    (measured 0.0 for both); the RCE guard holds at the bf16 tolerance."""
    import json

    import torch.multiprocessing as mp

    mp.start_processes(_dist_worker, args=(2, _free_port(), str(tmp_path), "fsdp", "bfloat16"), nprocs=2,
                       start_method="spawn")
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["ppo/first_ratio_err"] == 0.0 and m["reward/kl_ref"] == 0.0
    assert m["rce/max_abs_dlogp"] <= 5e-2


def test_the_engine_wakes_up_after_the_allocators_cache_is_freed(monkeypatch):
    """Sleep mode: the update's peak stays reserved by PyTorch's caching allocator until empty_cache(); vLLM's
    wake-up allocates through the driver, so the cache must be emptied first. The engine sleeps at level 2 (the
    sync overwrites every weight: no host copy), wakes its weights, takes the policy's, and only then its KV cache."""
    from types import SimpleNamespace

    from memopd.generation.weight_sync import WeightSync

    calls = []
    model = SimpleNamespace(load_weights=lambda weights: calls.append(("load_weights", len(list(weights)))))
    runner = SimpleNamespace(driver_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=SimpleNamespace(
        model=model))))
    llm = SimpleNamespace(llm_engine=SimpleNamespace(model_executor=runner),
                          sleep=lambda level: calls.append(("sleep", level)),
                          wake_up=lambda tags=None: calls.append(("wake_up", tags)),
                          reset_prefix_cache=lambda: calls.append("reset_prefix_cache"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # no GPU here: the engine and the allocator are fakes
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    # tensors held only by reference cycles are not in the allocator's free cache until collected
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("gc.collect") or 0)
    policy = torch.nn.Linear(2, 2)
    sync = WeightSync(llm, sleep=True)
    sync.sync(policy)  # awake: no wake-up, no cache to free
    sync.release()
    sync.sync(policy)
    sync.sync(policy)  # awake again: nothing to wake
    assert calls == [("load_weights", 2), "reset_prefix_cache", ("sleep", 2),
                     "gc.collect", "empty_cache", ("wake_up", ["weights"]), ("load_weights", 2),
                     ("wake_up", ["kv_cache"]), "reset_prefix_cache", ("load_weights", 2), "reset_prefix_cache"]


def test_the_update_metrics_are_batch_means_by_hand():
    """reduce_metrics in one process: per-minibatch values averaged over minibatches, maxima kept as maxima, the
    task reward a mean over episodes and the reference penalty a mean over action tokens (values by hand)."""
    from memopd.train.batching import RankShare, reduce_metrics

    share = RankShare(minibatches=[{"actor/loss": 1.0, "ppo/ratio_max": 1.5}, {"actor/loss": 3.0, "ppo/ratio_max": 1.2}],
                      packed_tokens=100, actions=40, reward=3.0, kl_ref=2.0, first_ratio_err=1e-7)
    m = reduce_metrics(share, n_episodes=4)
    assert m["actor/loss"] == 2.0 and m["ppo/ratio_max"] == (1.5 + 1.2) / 2
    assert m["reward/task"] == 3.0 / 4 and m["reward/kl_ref"] == 2.0 / 40
    assert m["tokens/packed"] == 100 and m["tokens/actions"] == 40 and m["ppo/first_ratio_err"] == 1e-7
