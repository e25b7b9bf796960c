"""The expected absences a GPU check part may skip for (exit 75, "skip: why"): no CUDA device, an optional package
deliberately not installed, model weights not in the Hugging Face cache. Anything else (an installed package whose
import fails, a driver error) is a failure: its exception propagates and the part exits non-zero."""
from __future__ import annotations

import importlib.util

SKIP = 75  # EX_TEMPFAIL: tests/gpu/check.sh reads it as "skip"


def missing_package(name: str) -> str | None:
    """Why `name` is absent (not installed), or None when it is installed (whether or not it imports)."""
    return None if importlib.util.find_spec(name) is not None else f"{name} is not installed"


def no_cuda() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "no CUDA GPU (torch.cuda.is_available() is false)"


def cached_weights(model: str) -> tuple[str | None, str | None]:
    """(local path, None) of the model's weights in the Hugging Face cache, or (None, why) when they are not
    there; any other error of the lookup propagates."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(model, local_files_only=True), None
    except LocalEntryNotFoundError as e:
        return None, f"{model} is not in the Hugging Face cache ({e})"
