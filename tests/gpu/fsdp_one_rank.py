"""The FSDP2 path of the trainers on one rank (NCCL on a GPU, gloo on the CPU): a tiny Qwen2 sharded by
memopd.parallel (`fully_shard` per decoder layer, activation checkpointing), trained a few steps with clipping and
AdamW, compared with the same steps unsharded on the same device; then with bf16 mixed precision; then an async
sharded checkpoint (memopd.harness with a group of its own) saved, loaded into a fresh sharded model and trained on
to the same weights. The multi-rank path differs only in the number of shards. Prints one line per check and
"pass: ..." last; exits 1 on the first failure.

    python tests/gpu/fsdp_one_rank.py            # cuda when there is a GPU, else cpu
"""
from __future__ import annotations

import copy
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

STEPS, SAVE_AT = 4, 2


def tiny(device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(cfg).to(device)


def batches(device):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (2, 32), generator=g).to(device) for _ in range(STEPS + 1)]


def step(model, opt, ids, params) -> float:
    from memopd import parallel

    opt.zero_grad(set_to_none=True)
    loss = parallel.call(model, lambda m: m(input_ids=ids, labels=ids).loss)
    loss.backward()
    parallel.clip_grad_norm(params, 0.5)  # clips: the random model's gradients are larger
    opt.step()
    return loss.item()


def sharded(base, dtype):
    from memopd import parallel

    model = parallel.checkpoint_activations(copy.deepcopy(base))
    root = parallel.shard(model, dtype)
    opt = torch.optim.AdamW(root.parameters(), lr=1e-2)
    return root, opt


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        sys.exit(1)


def main() -> int:
    from memopd import parallel
    from memopd.dist import one_process_group
    from memopd.harness import Harness, Part

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if cuda:
        torch.cuda.set_device(device)
    one_process_group("nccl" if cuda else "gloo", timeout_min=2)  # its store listens on no network interface
    base, data = tiny(device), batches(device)

    plain = copy.deepcopy(base)
    p_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    ref = [step(plain, p_opt, ids, list(plain.parameters())) for ids in data[:STEPS]]
    root, opt = sharded(base, "float32")
    got = [step(root, opt, ids, list(root.parameters())) for ids in data[:STEPS]]
    want, have = parallel.full_state_dict(plain), parallel.full_state_dict(root)
    diff = max((want[k] - have[k]).abs().max().item() for k in want)
    check("fp32 sharded = unsharded", diff <= 1e-5 and max(abs(a - b) for a, b in zip(ref, got)) <= 1e-5,
          f"losses {[round(x, 4) for x in got]}, max |weight diff| {diff:.1e} after {STEPS} steps")

    bf_root, bf_opt = sharded(base, "bfloat16")
    bf = [step(bf_root, bf_opt, ids, list(bf_root.parameters())) for ids in data[:STEPS]]
    check("bf16 mixed precision", all(abs(a - b) <= 0.05 * abs(b) for a, b in zip(bf, ref)),
          f"losses {[round(x, 4) for x in bf]} against fp32 {[round(x, 4) for x in ref]} (within 5%)")

    group = dist.new_group(backend="gloo", timeout=timedelta(minutes=2))  # the background writer's own group
    with tempfile.TemporaryDirectory() as tmp:
        a_root, a_opt = sharded(base, "float32")
        saver = Harness(Path(tmp) / "ck", {"run": 1}, STEPS, SAVE_AT, "fsdp", group=group, progress=False,
                        parts=[Part("model", a_root, "optimizer", a_opt)])
        saver.loop(0, lambda i: str(step(a_root, a_opt, data[i], list(a_root.parameters()))), stop_after=SAVE_AT)
        b_root, b_opt = sharded(tiny(device), "float32")  # other initial weights: all must come from the files
        loader = Harness(Path(tmp) / "ck", {"run": 1}, STEPS, SAVE_AT, "fsdp", group=group, progress=False,
                         parts=[Part("model", b_root, "optimizer", b_opt)])
        start = loader.resume(loader.find())
        for i in range(start, STEPS):
            step(a_root, a_opt, data[i], list(a_root.parameters()))
            step(b_root, b_opt, data[i], list(b_root.parameters()))
        a, b = parallel.full_state_dict(a_root), parallel.full_state_dict(b_root)
        check("async sharded save and load", start == SAVE_AT and all(torch.equal(a[k], b[k]) for k in a),
              f"resumed at step {start}, {STEPS - start} more steps: identical weights")
    dist.destroy_process_group()
    print(f"pass: FSDP2 on one rank ({'nccl, ' + torch.cuda.get_device_name(0) if cuda else 'gloo, cpu'}): "
          "sharded = unsharded, bf16 mixed precision, async sharded checkpoint resumed exactly")
    return 0


if __name__ == "__main__":
    sys.exit(main())
