"""The bf16 RCE guard on Qwen2.5-0.5B-Instruct (a trained model: logits of trained magnitude) on the GPU, under bf16
autocast over fp32 weights as the training guard runs: every exact path passes, a pack read one position early
fails. Exit 75 (skip) only without a CUDA GPU or the weights in the Hugging Face cache (tests/gpu/absent.py)."""
from __future__ import annotations

import os
import random
import sys

from absent import SKIP, cached_weights, no_cuda
from dataclasses import replace

MODEL = os.environ.get("GPU_CHECK_RCE_MODEL", "Qwen/Qwen2.5-0.5B-Instruct")


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path, why = None, no_cuda()
    if not why:
        path, why = cached_weights(MODEL)
    if why:  # no GPU, or the weights not cached: nothing to check (any other error fails the check)
        print(f"skip: {why}")
        return SKIP
    import torch
    from transformers import AutoModelForCausalLM

    from memopd import rce
    from memopd.packing import pack
    from memopd.synthetic import random_episode

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).cuda().eval()
    rng = random.Random(0)
    pool = [rng.randrange(1000, 150000) for _ in range(20000)]
    eps = [random_episode(rng, pool, r, 6, 256, (64, 256), (32, 128), task_id=r)
           for r in ("full_retention", "summary_replacement", "sliding_window")]
    worst = []
    with torch.autocast("cuda", dtype=torch.bfloat16):
        for backend in ("sdpa", "flex", "auto"):
            r = rce.guard(model, eps, backend, dtype="bfloat16")  # raises RCEError on failure
            worst.append(f"{backend} |d logit| {r['max_abs_dlogit']:.3g} |d log p| {r['max_abs_dlogp']:.3g}")
        packs = []
        for p in (pack(ep) for ep in eps):
            gamma = p.gamma.clone()
            gamma[p.act_mask] -= 1
            packs.append(replace(p, gamma=gamma))
        shifted = rce.rce_packs(model, eps, packs, "sdpa", dtype="bfloat16")
    if shifted["passed"]:
        print(f"a pack read one position early passed the bf16 guard: {shifted['dlogit_over_tol']:.3g}x")
        return 1
    print(f"|logit| up to {r['max_abs_logit']:.3g}; " + "; ".join(worst)
          + f"; shifted pack {shifted['dlogit_over_tol']:.3g}x its tolerance")
    return 0


if __name__ == "__main__":
    sys.exit(main())
