"""One line before DeepSpeed JIT-compiles a C++ op, which it does silently for a minute or two the first time a
machine uses the op (``torch.utils.cpp_extension.load``, cached afterwards in the torch-extensions folder:
``TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions/py<version>_<accelerator>``).

- On the CPU accelerator, ``deepspeed.init_distributed`` builds ``deepspeed_shm_comm`` (its shared-memory
  collectives): :func:`vlm.training.distributed.init_distributed` logs :func:`build_notice` of
  ``ShareMemCommBuilder`` before it.
- ``deepspeed.initialize`` builds the optimiser's op when the DeepSpeed JSON asks for DeepSpeed's Adam
  (``"torch_adam": false``): ``fused_adam``, or ``cpu_adam`` with ZeRO's optimizer offload (:func:`optimizer_builder`).

An op counts as cached when its ``<name>.so`` is in its build folder, newer than its sources, and that folder's
``build.ninja`` names those sources (a build made from another DeepSpeed install is rebuilt). When the answer
cannot be worked out the line says the op *may* compile.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)
APPROX = "about 1-2 min, once per machine"


def extensions_root() -> Path:
    """The folder torch builds JIT extensions under (``torch.utils.cpp_extension._get_build_directory``'s rule,
    without creating anything)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def is_cached(name: str, sources: list[str], root: Path | None = None) -> bool:
    """Whether the JIT build of op ``name`` from ``sources`` (absolute paths) under ``root`` (default:
    :func:`extensions_root`) is there and current, so that loading it compiles nothing."""
    folder = (root if root is not None else extensions_root()) / name
    library = folder / f"{name}.so"
    try:
        built = library.stat().st_mtime
        ninja = (folder / "build.ninja").read_text(errors="replace")
        return all(src in ninja and os.stat(src).st_mtime <= built for src in sources)
    except OSError:
        return False


def optimizer_builder(ds_config: dict) -> str | None:
    """The DeepSpeed op builder ``deepspeed.initialize`` loads for the JSON's optimiser, or None (torch's Adam, or
    another optimiser type this does not know)."""
    optimizer = ds_config.get("optimizer") or {}
    if str(optimizer.get("type", "")).lower() not in ("adam", "adamw"):
        return None
    if (optimizer.get("params") or {}).get("torch_adam", False):
        return None
    offload = (ds_config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    return "CPUAdamBuilder" if offload.get("device") == "cpu" else "FusedAdamBuilder"


def build_notice(builder_class: str) -> str | None:
    """The line to log before DeepSpeed's first use of the op ``builder_class`` (e.g. ``"ShareMemCommBuilder"``) on
    this accelerator when that will compile it; None when it is prebuilt, cached, or not used here."""
    try:
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import accelerator_name, installed_ops

        accelerator = get_accelerator()
        builder = accelerator.create_op_builder(builder_class)
        if builder is None or builder.NAME == "deepspeed_not_implemented":  # no such op here (shm on CUDA)
            return None
        if installed_ops.get(builder.NAME, False) and accelerator_name == accelerator._name:
            return None
        sources = [os.path.abspath(builder.deepspeed_src_path(path)) for path in builder.sources()]
        root = extensions_root()
        if is_cached(builder.NAME, sources, root):
            return None
        return f"compiling DeepSpeed's {builder.NAME} op ({APPROX}; cached in {root})"
    except Exception as err:  # DeepSpeed's internals moved: say what may happen rather than nothing
        return f"DeepSpeed may compile its {builder_class} op now ({APPROX}; {type(err).__name__})"


def announce_build(builder_class: str | None) -> None:
    """Log :func:`build_notice` of ``builder_class`` once per machine (local rank 0), when there is one."""
    if builder_class is None or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    notice = build_notice(builder_class)
    if notice is not None:
        log.info(notice)
