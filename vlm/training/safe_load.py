"""Loading checkpoint files without executing them.

A ``.pt`` file is a pickle: ``torch.load(weights_only=False)`` runs whatever callable the file names, so a tampered
run folder (downloaded, shared, or written by someone else) runs code on resume or export. Everything this project
loads from a run folder goes through ``weights_only_loading()``: inside it every ``torch.load`` — ours and
DeepSpeed's own (``load_checkpoint``, ``zero_to_fp32``), which ask for ``weights_only=False`` — is made with
``weights_only=True``, PyTorch's restricted unpickler that builds tensors and plain containers only, plus the few
DeepSpeed classes its checkpoints hold (``ALLOWED_GLOBALS``, rebuilt from their fields, never called with file data
beyond that). Anything else in a file is refused with a one-line ``UnsafeCheckpointError``.
"""

from __future__ import annotations

import contextlib
import importlib
import pickle
import re
from collections.abc import Iterator

import torch

# Classes DeepSpeed pickles into its checkpoints (measured with torch.serialization.get_unsafe_globals_in_checkpoint
# on ZeRO 0 / 2 / 3 checkpoints, fp32 and fp16 / bf16 optimisers).
ALLOWED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file holds something other than tensors, containers and the allowed classes."""


def _resolve(name: str):
    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None  # an older / newer DeepSpeed without this class: nothing of it can be in its checkpoints


def _one_line(path, err: Exception) -> str:
    found = re.search(r"(?:Unsupported global|Unsupported operand|Trying to call|GLOBAL)[^\n]*", str(err))
    detail = found.group(0).strip() if found else str(err).strip().splitlines()[0]
    return f"{path}: refusing to load (not plain tensors: {detail[:160]}); was the file replaced or tampered with?"


@contextlib.contextmanager
def weights_only_loading() -> Iterator[None]:
    """Within the block, every ``torch.load`` uses the restricted unpickler with ``ALLOWED_GLOBALS``."""
    original = torch.load

    def load(f, *args, **kwargs):
        kwargs["weights_only"] = True
        try:
            return original(f, *args, **kwargs)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(_one_line(f, err)) from None

    allowed = [cls for cls in map(_resolve, ALLOWED_GLOBALS) if cls is not None]
    with torch.serialization.safe_globals(allowed):
        torch.load = load
        try:
            yield
        finally:
            torch.load = original


def load_weights(path: str, map_location="cpu"):
    """``torch.load`` of one file through the restricted unpickler."""
    with weights_only_loading():
        return torch.load(path, map_location=map_location)
