"""Checkpoint storage: weights as safetensors, everything else in a tensors-only torch file, sharded state by
torch.distributed.checkpoint. What a checkpoint directory holds and when it is written: memopd.harness.

Sharded checkpoints (torch.distributed.checkpoint, "DCP"; training under a process group): every rank copies the
tensors it holds to host memory, then writes them in a background thread while training goes on: its FSDP shards,
and its share of the tensors every rank holds whole (each such tensor is written by one rank), into
`__<rank>_0.distcp`; rank 0 then writes `.metadata`, the index of which file holds which piece. A resume with any
number of ranks reads only the pieces of the tensors it holds.
"""
from __future__ import annotations

import json
import math
import random
import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

ALIASES = "memopd_aliases"  # safetensors metadata key: {name: the stored name whose tensor it shares}


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """save_file for a state dict whose tensors may share memory: tied weights (SmolLM2 and Qwen2.5-3B
    tie lm_head to embed_tokens), which safetensors refuses. Each storage is stored once, under its first
    name; the other names are recorded as aliases in the file's metadata (`load_tensors` restores them)."""
    kept, aliases, first = {}, {}, {}
    for name, t in tensors.items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() and key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
            kept[name] = t.contiguous()
    save_file(kept, str(path), metadata={ALIASES: json.dumps(aliases, sort_keys=True)})


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every name `save_tensors` was given, aliases pointing at their stored tensor."""
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        aliases = json.loads((f.metadata() or {}).get(ALIASES, "{}"))
    for name, stored in aliases.items():
        tensors[name] = tensors[stored]
    return tensors


def rng_state() -> dict:
    """Python, torch CPU and CUDA generator states, tensors only (weights_only-loadable, and storable by
    torch.distributed.checkpoint)."""
    version, internal, gauss = random.getstate()
    if version != 3:  # the only version of CPython's Mersenne Twister state
        raise ValueError(f"random.getstate() version {version}: expected 3")
    out = {"python": torch.tensor(internal, dtype=torch.int64),
           "python_gauss": torch.tensor(float("nan") if gauss is None else gauss, dtype=torch.float64),
           "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return out


def set_rng_state(state: dict) -> None:
    gauss = float(state["python_gauss"])
    random.setstate((3, tuple(state["python"].tolist()), None if math.isnan(gauss) else gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


def publish_dir(tmp: str | Path, path: str | Path) -> None:
    """Swap the written directory `tmp` in as `path`: a kill at any point leaves the previous one (possibly as
    `<path>.old`, which a resume reads) or the new one whole."""
    tmp, path = Path(tmp), Path(path)
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def read_state(path: str | Path) -> dict:
    """A checkpoint's state.pt, memory-mapped rather than read: the ranks of a node share the file's pages and
    copy only what they keep (each of 8 ranks reading a 7B teacher's ~61 GB AdamW state whole would need
    ~490 GB of host memory)."""
    return torch.load(Path(path) / "state.pt", weights_only=True, map_location="cpu", mmap=True)


SHARDED_INDEX = ".metadata"  # written last by torch.distributed.checkpoint: the directory is a whole sharded checkpoint


def is_sharded(path: str | Path) -> bool:
    return (Path(path) / SHARDED_INDEX).exists()


@dataclass
class PendingSave:
    """A sharded checkpoint being written in the background. `finish` (rank 0's: what makes the written files the
    checkpoint a resume reads) runs in `complete`, once every rank's files are written: the future of the
    coordinating rank resolves only after it has gathered every rank's write results."""
    future: Future
    finish: Callable[[], None] | None = None

    def ready(self) -> bool:
        return self.future.done()

    def complete(self) -> None:
        self.future.result()  # a failed write raises here, in the training loop
        finish, self.finish = self.finish, None
        if finish is not None:
            finish()


def save_sharded(state: dict, path: str | Path, group, finish: Callable[[], None] | None = None) -> PendingSave:
    """Every rank of `group` (a gloo group of its own: the writer thread's collectives must not interleave with the
    training's): copy `state` (nested dicts of tensors, DTensor shards) to host memory, then write it into `path` in
    a background thread. Returns once the copy is taken; the tensors may change from then on."""
    import torch.distributed.checkpoint as dcp

    future = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(str(path)), process_group=group)
    return PendingSave(future, finish)


def load_sharded(state: dict, path: str | Path, required: list[str]) -> None:
    """Fill `state` (as given to `save_sharded`, any number of ranks) in place from the sharded checkpoint at
    `path`. Keys the checkpoint lacks are left as they are, except the flattened `required` ones (e.g.
    "policy.lm_head.weight"), which raise: optimizer state of a parameter that never had a gradient is legitimately
    absent, a weight never."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    missing = sorted(k for k in required if k not in stored)
    if missing:
        raise KeyError(f"{path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), planner=DefaultLoadPlanner(allow_partial_load=True))
