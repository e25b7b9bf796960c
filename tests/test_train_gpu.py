"""Training on a GPU: the PPO / MemOPD step on CUDA, vLLM rollouts whose weights are synced from the
trainer, and the paper-scale launch (torchrun). Every test here is `gpu`-marked (skipped without CUDA);
the vLLM ones also need vLLM (envs/gpu.yaml)."""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from agent_support import ROOT, protocol_student, random_student, tokenizer
from test_train import _episodes, _setup
from test_train_loop import setup  # noqa: F401  (fixture: student, teacher, tasks and index on disk)

from memopd.train.update import PPOConfig, ppo_update

pytestmark = pytest.mark.gpu

PPO_KEYS = ("actor/loss", "value/loss", "opd/loss", "actor/grad_norm", "critic/grad_norm")


def test_cuda_bf16_tiny_lr_moves_the_master_weights():
    """bf16 autocast over fp32 weights on CUDA at lr 1e-6: the first ratio is 1 and the weights move."""
    from test_train import _moved_fraction

    policy, ref, critic, teacher, _, _ = (m.cuda() if isinstance(m, torch.nn.Module) else m for m in _setup())
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    a_opt = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    c_opt = torch.optim.AdamW(critic.parameters(), lr=1e-6)
    m = ppo_update(_episodes(), policy, ref, critic, teacher, a_opt, c_opt,
                   PPOConfig(dtype="bfloat16", minibatch_episodes=4, attention="sdpa"))
    assert m["ppo/first_ratio_err"] <= 1e-2 and m["rce/max_abs_dlogp"] <= 5e-2
    assert _moved_fraction(before, policy) > 0.99


@pytest.mark.parametrize("backend", ["sdpa", "flex", "prefix_shared"])
def test_cuda_training_step_matches_cpu(backend):
    """One fp32 update on CUDA: the RCE guard holds at the fp32 tolerance on the GPU kernels, and losses
    and gradient norms are the CPU step's up to kernel summation order."""
    cfg = PPOConfig(method="memopd", opd_lambda=0.5, minibatch_episodes=2, attention=backend, rce_sample=2)
    cpu = ppo_update(_episodes(), *_setup(), PPOConfig(**{**cfg.__dict__, "attention": "sdpa"}))
    policy, ref, critic, teacher, _, _ = (m.cuda() if isinstance(m, torch.nn.Module) else m for m in _setup())
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    a_opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    c_opt = torch.optim.AdamW(critic.parameters(), lr=1e-3)
    gpu = ppo_update(_episodes(), policy, ref, critic, teacher, a_opt, c_opt, cfg)
    assert gpu["rce/max_abs_dlogp"] <= 1e-5
    assert any(not torch.equal(before[k], v) for k, v in policy.state_dict().items())
    assert next(policy.parameters()).is_cuda
    for k in PPO_KEYS:
        assert abs(gpu[k] - cpu[k]) <= 1e-3 * max(1.0, abs(cpu[k])), (k, gpu[k], cpu[k])


def _vllm():
    return pytest.importorskip("vllm", reason="needs vLLM (envs/gpu.yaml)")


def _engine_vs_trainer(llm, policy, prompts, max_new=16):
    """Greedy continuations by the engine; -> (engine log-probs, trainer log-probs of the same tokens,
    trainer's top-1 agreement with the engine's tokens), concatenated over prompts."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=max_new, logprobs=0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling_params=sp, use_tqdm=False)
    eng, hf, agree = [], [], []
    for p, o in zip(prompts, outs):
        ids = list(o.outputs[0].token_ids)
        eng += [o.outputs[0].logprobs[k][t].logprob for k, t in enumerate(ids)]
        with torch.no_grad():
            logits = policy(input_ids=torch.tensor([p + ids], device="cuda")).logits[0, len(p) - 1 : -1].float()
        lp = torch.log_softmax(logits, -1)
        hf += lp.gather(-1, torch.tensor(ids, device="cuda")[:, None]).squeeze(-1).tolist()
        agree += (logits.argmax(-1).cpu() == torch.tensor(ids)).tolist()
    return torch.tensor(eng), torch.tensor(hf), sum(agree) / len(agree)


def test_weight_sync_makes_the_engine_sample_from_the_trainer_policy(tmp_path):
    """A bf16 engine started from other weights (a random student) is synced from the trainer's fp32
    policy (the protocol-trained student): before the sync its log-probs of its own greedy tokens are far
    from the trainer's; after it they agree to bf16 precision and its greedy tokens are the trainer's
    argmax. The prompts are generated once before the sync, so a stale prefix cache would show. Then
    sleep mode: release (weights offloaded, KV cache dropped), sync again, still the trainer's model."""
    _vllm()
    from memopd.config import RolloutConfig
    from memopd.generation.weight_sync import WeightSync, colocated_llm, engine_model

    tok = tokenizer()
    random_student(7).save_pretrained(tmp_path / "init")
    tok.save_pretrained(tmp_path / "init")
    llm = colocated_llm(tmp_path / "init", RolloutConfig(dtype="bfloat16", vllm={"max_model_len": 1024}),
                        {"gpu_memory_utilization": 0.3, "sleep": True}, seed=0)
    policy = copy.deepcopy(protocol_student()).cuda().eval()  # the cached CPU model stays on the CPU
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in
               ("Question: who wrote the novel Dracula? <think>", "<search>capital of Australia</search>",
                "Answer the questions. 1. when did the Berlin wall fall")]
    eng, hf, agree = _engine_vs_trainer(llm, policy, prompts)
    assert (eng - hf).abs().mean() > 0.5  # not synced: another model

    sync = WeightSync(llm, sleep=True)
    seconds = sync.sync(policy)
    assert seconds > 0
    eng, hf, agree = _engine_vs_trainer(llm, policy, prompts)
    assert (eng - hf).abs().max() <= 0.1 and (eng - hf).abs().mean() <= 0.02, (eng - hf).abs()
    assert agree >= 0.9, agree
    want = policy.model.embed_tokens.weight
    w = dict(engine_model(llm).named_parameters())["model.embed_tokens.weight"][: want.shape[0]]  # vocab may be padded
    assert torch.equal(w, want.to(w.dtype))

    sync.release()
    assert sync.asleep
    sync.sync(policy)
    eng2, hf2, _ = _engine_vs_trainer(llm, policy, prompts)
    assert (eng2 - hf2).abs().max() <= 0.1, (eng2 - hf2).abs()


def _train_cmd(setup, out, launch, **train):
    d, cfg = setup
    engine = {"backend": "vllm", "dtype": "bfloat16", "vllm": {"max_model_len": 4096}}
    cfg = {**cfg, "rollout": {**cfg["rollout"], **engine},
           "train": {**cfg["train"], "steps": 2, "vllm": {"gpu_memory_utilization": 0.2}, **train}}
    return [*launch, "-m", "memopd.cli", "train", "--cfg", json.dumps(cfg), "--method", "memopd", "--seed", "0",
            "--student", str(d / "student"), "--teacher", str(d / "teacher"), "--tasks", str(d / "q2_train.parquet"),
            "--index", str(d / "index"), "--out-dir", str(out), "--export", str(out / "export")]


def _run(cmd, tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r


def test_train_run_with_vllm_rollouts(setup, tmp_path):  # noqa: F811
    """`memopd train` with rollout.backend vllm (its own process: one engine per process): every step
    syncs the engine (time/sync_s), rolls out with it and updates on the exact packed states; the RCE
    guard holds in fp32 and the final policy is exported."""
    _vllm()
    _run(_train_cmd(setup, tmp_path / "run", [sys.executable]), tmp_path)
    lines = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1]
    assert all(m["time/sync_s"] > 0 and m["rce/max_abs_dlogp"] <= 1e-5 for m in lines)
    assert all(m["episodes"] == setup[1]["train"]["batch_tasks"] and m["tokens/actions"] > 0 for m in lines)
    assert (tmp_path / "run/export/model.safetensors").exists()


@pytest.mark.parametrize("dtype,shard", [("float32", "none"), ("bfloat16", "fsdp")])
def test_torchrun_two_gpus(setup, tmp_path, dtype, shard):  # noqa: F811
    """The paper-scale launch: torchrun with one rank per GPU (NCCL), one colocated engine per rank; with
    FSDP2 (paper.yaml: bf16 autocast, fp32 shards) the engine is synced from the gathered shards. The
    first minibatch's ratio is 1 up to kernel differences between the no-grad and the grad pass."""
    _vllm()
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    _run(_train_cmd(setup, tmp_path / "run", launch, dtype=dtype, shard=shard), tmp_path)
    lines = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1] and all(m["world_size"] == 2 for m in lines)
    assert all(m["ppo/first_ratio_err"] <= {"float32": 1e-4, "bfloat16": 1e-2}[dtype] for m in lines)
    assert all(m["episodes"] == setup[1]["train"]["batch_tasks"] for m in lines)
    assert (tmp_path / "run/export/model.safetensors").exists()
