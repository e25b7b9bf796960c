"""vLLM sleep -> allocation -> wake-up -> weight update, as a training step runs it (generation/weight_sync.py): the engine
sleeps, the update takes ~60 GB (GPU_CHECK_ALLOC_GB) and frees it, the engine wakes and takes the policy's weights.
With `free_cached_memory` (empty_cache) first the wake-up must succeed; without it PyTorch's allocator still holds the
60 GB, and the outcome is reported. Exit 75 (skip) only without vllm installed, a CUDA GPU or the model's weights in
the Hugging Face cache (tests/gpu/absent.py); an installed vllm that fails to import fails the check."""
from __future__ import annotations

import os
import sys

from absent import SKIP, cached_weights, missing_package, no_cuda

MODEL = os.environ.get("GPU_CHECK_MODEL", "Qwen/Qwen2.5-0.5B-Instruct")


def cycle(llm, sync, policy, gb: float, empty: bool) -> tuple[str, str]:
    """Sleep, allocate and free `gb` GB as an update would, then wake and sync: through WeightSync.sync (its
    empty_cache first) or, `empty` False, waking directly."""
    import torch

    from memopd.generation.weight_sync import engine_model, policy_weights

    sync.release()  # sleep level 2: the weights are dropped, so the text generated below shows the sync's weights
    block = torch.empty(int(gb * 1e9), dtype=torch.uint8, device="cuda")
    block.fill_(1)
    del block
    reserved = torch.cuda.memory_reserved() / 1e9
    if empty:
        sync.sync(policy)  # free_cached_memory, wake the weights, load_weights, wake the KV cache
    else:
        llm.wake_up(tags=["weights"])
        engine_model(llm).load_weights(weights=policy_weights(policy))
        llm.wake_up(tags=["kv_cache"])
        sync.asleep = False
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    out = llm.generate(["The capital of France is"], greedy, use_tqdm=False)[0].outputs[0].text
    return f"{'with' if empty else 'without'} empty_cache: {reserved:.1f} GB reserved at wake-up, generated {out!r:.30}", out


def main() -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if why := missing_package("vllm"):  # an optional package: nothing to check without it
        print(f"skip: {why}")
        return SKIP
    import vllm  # noqa: F401  installed: an import that fails is a failure of the check, not a skip

    path, why = None, no_cuda()
    if not why:
        path, why = cached_weights(MODEL)
    if why:
        print(f"skip: {why}")
        return SKIP
    from transformers import AutoModelForCausalLM

    from memopd.config import RolloutConfig
    from memopd.generation.weight_sync import WeightSync, colocated_llm

    llm = colocated_llm(path, RolloutConfig(dtype="bfloat16", vllm={"max_model_len": 4096}),
                        {"gpu_memory_utilization": 0.3, "sleep": True}, seed=0)
    sync = WeightSync(llm, sleep=True)
    policy = AutoModelForCausalLM.from_pretrained(path, torch_dtype="float32").cuda()
    gb = float(os.environ.get("GPU_CHECK_ALLOC_GB", "60"))
    line, out = cycle(llm, sync, policy, gb, empty=True)
    print(line, flush=True)
    if "Paris" not in out:  # level 2 dropped the weights: only the sync's can have written this answer
        print("FAIL: after sleep level 2 and the sync the engine does not answer with the policy's weights")
        return 1
    try:
        print(cycle(llm, sync, policy, gb, empty=False)[0], flush=True)
        without = "without empty_cache: woke too"
    except Exception as e:  # the failure free_cached_memory exists for
        without = f"without empty_cache: {type(e).__name__}: {str(e)[:80]}"
    print(f"with empty_cache: woke, synced and generated; {without}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
