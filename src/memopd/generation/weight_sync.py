"""vLLM rollouts during training, with the engine's weights synced from the trainer's policy.

One engine per rank, colocated with the trainer in its process and on its GPU (TRL's "colocate" mode,
verl's hybrid engine): in a single process the V1 engine core is kept in-process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`); under torchrun `distributed_executor_backend="external_launcher"`
makes each rank's engine a tensor-parallel-1 engine on its own GPU inside the trainer's process. Either
way the engine's model is a module of this process, so a sync hands it the policy's CUDA tensors
directly (`load_weights` maps the Hugging Face names, fusing q/k/v and gate/up itself): no file, no copy
through another process.

    llm = colocated_llm(student_dir, rollout_config(cfg), run.vllm, seed, world)   # run: train.config.RunConfig
    sync = WeightSync(llm, sleep=run.vllm.sleep)
    sync.sync(policy)      # before every rollout: the engine samples with the current policy
    ... VLLMBackend(..., llm=llm) rollouts ...
    sync.release()         # optional: free the engine's GPU memory during the update (sleep mode, level 2)

What must be exact is the record of sampled tokens: PPO's pi_old is re-scored by the trainer on the
exact packed states (after the RCE guard), not taken from the engine, so the engine's bf16 log-probs
only need to agree with the trainer's up to precision, which they do only when the weights are synced
(tests/test_train_gpu.py checks both).
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterator

import torch


def colocated_llm(model_dir, ro, engine_cfg, seed: int, world: int = 1):
    """A vLLM engine in this process on this rank's GPU, initialised from `model_dir` (its weights are
    replaced at the first sync). `engine_cfg`: config `train.vllm` (memopd.config.ColocatedEngineConfig); `ro`: the
    `rollout` section (memopd.config.RolloutConfig)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the engine core (and model) here
    from vllm import LLM  # GPU environment only (envs/gpu.yaml)

    kw = {}
    if world > 1:  # one engine per torchrun rank, on LOCAL_RANK's GPU, sharing the trainer's process group
        kw["distributed_executor_backend"] = "external_launcher"
    return LLM(model=str(model_dir), dtype=ro.dtype, seed=seed,
               gpu_memory_utilization=engine_cfg.gpu_memory_utilization, max_model_len=ro.vllm.max_model_len,
               enable_prefix_caching=True, enable_sleep_mode=engine_cfg.sleep, **kw)


def engine_model(llm) -> torch.nn.Module:
    """The torch module an in-process vLLM engine runs (V1 engine; the attribute path of vLLM >= 0.10)."""
    engine = llm.llm_engine
    for path in (("model_executor",), ("engine_core", "engine_core", "model_executor")):
        node = engine
        try:
            for name in path:
                node = getattr(node, name)
            return node.driver_worker.worker.model_runner.model
        except AttributeError:
            continue
    raise RuntimeError("the vLLM engine's model is not in this process: create the engine with colocated_llm "
                       "(VLLM_ENABLE_V1_MULTIPROCESSING=0, or external_launcher under torchrun)")


def policy_weights(policy) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of every policy weight, without a `.module` wrapper (DDP, or the
    FSDP `parallel.Root`), the fp32 master weights as they are (vLLM casts to its dtype while loading).
    FSDP shards are gathered one tensor at a time (`full_tensor`, a collective: every rank syncs its
    engine at the same step, in the same order), so at most one whole tensor is alive beyond the engine's;
    replicas are yielded without copies."""
    from memopd.parallel import full_tensor

    module = getattr(policy, "module", policy)
    for name, t in module.state_dict().items():
        yield name, full_tensor(t.detach())


def free_cached_memory() -> None:
    """Give the memory PyTorch's caching allocator still reserves (the scoring and update peak, freed but kept
    for reuse) back to the driver: vLLM's wake-up allocates its share through the driver, outside that cache,
    so without this the engine's share does not fit after the first update."""
    import gc

    gc.collect()  # tensors of the update still referenced only by reference cycles
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class WeightSync:
    """Copies the trainer's policy into a colocated vLLM engine; `sync` returns the seconds it took."""

    def __init__(self, llm, sleep: bool = False):
        self.llm, self.sleep, self.asleep = llm, sleep, False

    def sync(self, policy) -> float:
        t0 = time.perf_counter()
        if self.asleep:
            free_cached_memory()  # before the engine takes its share back
            self.llm.wake_up(tags=["weights"])  # the KV cache after the load: the gathered tensor never sits beside it
        engine_model(self.llm).load_weights(weights=policy_weights(policy))
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        # cached prefixes hold keys/values computed with the old weights: a hit would sample off-policy
        self.llm.reset_prefix_cache()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def release(self) -> None:
        """Sleep mode: drop the engine's weights and KV cache until the next sync, leaving the GPU memory to the
        update. Level 2 (vLLM's choice for weight updates, docs "Sleep Mode"): the sync overwrites every weight, so
        none is copied to host memory and back as level 1 would; the model's buffers (rotary tables) are kept."""
        if self.sleep and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True
