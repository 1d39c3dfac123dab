"""The process group: what a plain ``python`` launch needs before ``deepspeed.init_distributed`` (the launchers —
``deepspeed``, ``torchrun`` — set the same environment themselves)."""

from __future__ import annotations

import os
import socket


def setup_distributed() -> None:
    """Plain ``python`` runs as a single process: set what the launchers would."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                           ("MASTER_PORT", str(port))):  # fmt: skip
            os.environ.setdefault(key, value)


def init_distributed() -> None:
    """Join (or, alone, create) the process group: gloo on CPU, NCCL on GPUs."""
    import deepspeed
    import torch

    setup_distributed()
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
