"""Precision and sharding of trained models (SFT's model; PPO's policy, critic and the policy's reference copy).

Precision: the trained parameters and their AdamW state are always fp32 ("master weights"); with
`train.dtype: bfloat16` the forward (and so the backward) runs under `torch.autocast(bf16)`. Pure bf16
parameters would lose the update: at lr 1e-6 an Adam step (~lr per element) is far below half a bf16
ulp of a weight of size ~1e-2 (~6e-5), so it rounds away (tests/test_train.py shows both).

Sharding (`train.shard`):
  none  every rank holds a replica; gradients are summed by `memopd.dist.allreduce_grads` (SFT: DDP).
  fsdp  FSDP2 (`fully_shard`): each decoder layer and the rest of the model are sharded units over all
        ranks, parameters and AdamW state stay fp32 shards; with bf16 the layers compute in bf16
        (MixedPrecisionPolicy param_dtype=bf16, gradients reduced in fp32). FSDP's reduce-scatter sums
        the gradients (divide factor 1): the losses are already divided by the global minibatch size,
        exactly as with `none`. Memory: fp32 weights + grads + Adam = 16 bytes per parameter, ~96 GB for
        a 3B policy + 3B critic, divided by the number of ranks.

Under FSDP the root's parameters (embeddings, final norm, LM head) are gathered only while the root
module's forward runs, but the trainer reads the LM head's weight directly (chunked losses) and calls
the decoder past the Hugging Face forward (packed masks). So a sharded model is a `Root` whose forward
runs any function of the wrapped model: `call(model, fn)` is `fn(model)` for a replica and the root's
forward for a sharded model, and every computation on policy, critic and reference goes through it.

Activation checkpointing (`train.activation_checkpointing`, `sft.activation_checkpointing`;
`checkpoint_activations`): every decoder layer of a trained model keeps only its input for the backward
and recomputes its forward there (transformers' per-layer checkpointing, non-reentrant
torch.utils.checkpoint). It checkpoints the layer's `forward`, not `__call__`, so FSDP2's hooks stay
outside the recomputation: apply it before `shard`. It works under every packed backend that runs a
layer once per forward (sdpa, eager, flex, segmented); prefix_shared cannot be checkpointed (its calls
read the prefix's KV cache, which checkpointed layers drop): `check_backend` refuses that combination.
Numerically a recomputed layer gives the same loss and gradients (tests/test_checkpointing.py).
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from functools import partial

import torch

from memopd.attention import recomputes_activations

SHARDING = ("none", "fsdp")
PRECISIONS = {"fp32": "float32", "bf16": "bfloat16"}  # the SFT config's spelling -> the dtype name used here


def autocast(device: torch.device, dtype: str):
    """The compute precision of the trained models for `train.dtype`: bf16 autocast over fp32 weights.
    float16 is refused: without loss scaling its gradients underflow."""
    if dtype == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if dtype == "float32":
        return nullcontext()
    raise ValueError(f"train.dtype {dtype!r}: training supports float32 and bfloat16 (fp32 master weights)")


class Root(torch.nn.Module):
    """The FSDP root around a model; `forward(fn)` returns `fn(model)` with the root's parameters
    gathered. Its state dict is the model's with the prefix `module.`."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, fn):
        return fn(self.module)


def call(model, fn):
    """`fn(m)` on the plain model `m` inside `model` (a replica or a sharded `Root`)."""
    return model(fn) if isinstance(model, Root) else fn(model)


def unwrap(model) -> torch.nn.Module:
    return model.module if isinstance(model, Root) else model


def is_sharded(model) -> bool:
    return isinstance(model, Root)


def checkpoint_activations(model: torch.nn.Module) -> torch.nn.Module:
    """Per-decoder-layer activation checkpointing of every Hugging Face model in `model` (a causal LM, or
    the critic's backbone inside `ValueModel`), non-reentrant; returns `model`. Call it before `shard`.
    Memory: each layer saves its input (the residual stream, fp32 under autocast) instead of its
    activations, and one layer's activations exist at a time, recomputed in the backward (memopd.plan)."""
    from transformers import PreTrainedModel

    done = False
    for m in unwrap(model).modules():
        if isinstance(m, PreTrainedModel) and not is_checkpointed(m):
            if not m.supports_gradient_checkpointing:
                raise ValueError(f"{type(m).__name__} does not support activation checkpointing")
            kwargs = {"use_reentrant": False, "context_fn": partial(_recompute_attention_as_forward, m.config)}
            if hasattr(m, "activation_checkpointing_enable"):  # transformers >= 5.2x; the old name warns
                m.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            done = True
    if not done and not is_checkpointed(model):
        raise ValueError(f"no Hugging Face model with decoder layers to checkpoint in {type(model).__name__}")
    return model


@contextmanager
def _attention_implementation(config, name):
    old = config._attn_implementation
    if old != name:
        config._attn_implementation = name  # the setter sets the sub-configs too
    try:
        yield
    finally:
        if old != name:
            config._attn_implementation = old


def _recompute_attention_as_forward(config):
    """torch.utils.checkpoint's context_fn, called when a layer's forward runs: its recomputation in the
    backward runs under the attention implementation of that forward. The packed backends switch it only
    around their forward (attention.attn_impl), so without this a layer run under flex,
    eager or memopd_segmented would be recomputed with the model's default (sdpa): a metadata error at
    best, silently other gradients at worst (segmented: one causal attention over the whole pack)."""
    return nullcontext(), _attention_implementation(config, config._attn_implementation)


def is_checkpointed(model) -> bool:
    """Whether some layer of `model` (replica, DDP or FSDP root) recomputes its activations in the backward."""
    return recomputes_activations(unwrap(model))


def check_backend(backend: str, checkpointed: bool) -> None:
    """Refuse the packed backend prefix_shared on activation-checkpointed models: its calls read the prefix's
    KV cache, which checkpointed layers do not keep (`auto` never picks it there: memopd.cost.candidates)."""
    if backend == "prefix_shared" and checkpointed:
        raise ValueError("train.ppo.backend prefix_shared cannot run activation-checkpointed models: "
                         "use auto, flex, calls or sdpa, or train.activation_checkpointing: false")


def _fsdp_modules(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def shard(model: torch.nn.Module, dtype: str, mesh=None) -> Root:
    """FSDP2 over every rank of the default process group: one unit per decoder layer (the classes a
    Hugging Face model names in `_no_split_modules`), then the root (the rest). `model` must be fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dtype == "bfloat16" \
        else MixedPrecisionPolicy()
    layers = {c for m in model.modules() for c in (getattr(m, "_no_split_modules", None) or [])}
    for m in list(model.modules()):
        if type(m).__name__ in layers:
            fully_shard(m, mesh=mesh, mp_policy=mp)
    root = fully_shard(Root(model), mesh=mesh, mp_policy=mp)
    for m in _fsdp_modules(root):
        # a plain sum over ranks (the loss carries the 1 / global minibatch size); with factor 1 and
        # sum-only collectives FSDP neither divides nor uses PREMUL_SUM (which gloo lacks)
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)
    root(lambda m: None)  # FSDP's lazy init now, from the root (a layer run first would make itself a root)
    root.reshard()  # the root keeps its gathered parameters after a forward; `parameters()` must be the shards
    return root


@contextmanager
def gathered(*models):
    """Hold the full parameters of every sharded model in `models` (collective on entry): inside, a rank
    may run any number of forwards without communicating (no-grad scoring, RCE guard, HF generation),
    which is what lets ranks score different numbers of episodes. A no-op for replicas."""
    roots = [m for m in models if is_sharded(m)]
    for r in roots:
        r.set_reshard_after_forward(False)
        for m in _fsdp_modules(r):
            m.unshard()
    try:
        yield
    finally:
        for r in roots:
            for m in _fsdp_modules(r):
                m.reshard()
            r.set_reshard_after_forward(True)  # FSDP's defaults: layers reshard after forward, the root not
            r.set_reshard_after_forward(False, recurse=False)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (collective: every rank calls it), else `t`."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state_dict(model, keep: bool = True) -> dict[str, torch.Tensor]:
    """The wrapped model's state dict as whole CPU tensors, Hugging Face names (collective under FSDP: every rank
    calls it, in the same order; only ranks with `keep` hold the result, the others get {}). A tensor several
    names share (tied embeddings) is gathered once and stays shared, so checkpoint.save_tensors stores it once."""
    out, done = {}, {}
    for k, v in unwrap(model).state_dict(keep_vars=True).items():
        if id(v) not in done:
            whole = full_tensor(v.detach())  # one tensor at a time on the device
            done[id(v)] = whole.cpu() if keep else None
        if keep:
            out[k] = done[id(v)]
    return out


def load_full_state_dict(model, state: dict[str, torch.Tensor]) -> None:
    """Load whole tensors (Hugging Face names) into a replica or into this rank's shards (no
    communication: every rank reads the same file and keeps its own slice)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    target = unwrap(model)
    current = target.state_dict()
    out = {}
    for k, v in state.items():
        cur = current.get(k)
        if isinstance(cur, DTensor):
            v = distribute_tensor(v.to(cur.device, cur.dtype), cur.device_mesh, cur.placements, src_data_rank=None)
        out[k] = v
    target.load_state_dict(out, strict=False)


def clip_grad_norm(params, max_norm: float) -> float:
    """clip_grad_norm_ of the (summed) gradients; the total norm as a float (a DTensor under FSDP)."""
    return float(full_tensor(torch.nn.utils.clip_grad_norm_(list(params), max_norm)))


def optimizer_state(model, opt) -> dict:
    """The optimizer's state to checkpoint: its own state dict for a replica; for a sharded model the
    whole (unsharded) state keyed by parameter name, on CPU, complete on rank 0 only (collective)."""
    if not is_sharded(model):
        return opt.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model, opt, state: dict) -> None:
    """Inverse of `optimizer_state` (every rank passes the whole state; each keeps its shards)."""
    if not is_sharded(model):
        opt.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    # not strict: a parameter that never had a gradient has no AdamW state (the critic's untied LM head)
    set_optimizer_state_dict(model, opt, state, options=StateDictOptions(full_state_dict=True, strict=False))
