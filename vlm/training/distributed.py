"""The process group, set up so that it fails fast and in one line instead of hanging.

- A plain ``python`` launch runs as one process: it gets the environment the launchers (``deepspeed``, ``torchrun``)
  would set, on a free port unless ``MASTER_PORT`` is given.
- Before the group is created, rank 0 (when ``MASTER_ADDR`` is this host) checks that ``MASTER_PORT`` is not already
  listened on by another process: two runs on one host otherwise collide on the launchers' default port (29500).
  Under ``torchrun`` the agent holds the port itself (and fails at once when it is taken), so this is skipped.
- The rendezvous is bounded: ``VLM_RENDEZVOUS_TIMEOUT_S`` seconds (default 300) for every rank to join, then
  collectives get DeepSpeed's usual timeout back (``DEEPSPEED_TIMEOUT`` minutes, default 10).
- On CPU the first ``deepspeed.init_distributed`` of a machine compiles DeepSpeed's shared-memory op (a minute or
  two): one line says so first (``vlm.training.jit_ops``).

Failures raise ``DistributedError`` (a ``ConfigError``: ``scripts/train_vlm.py`` prints ``error: ...``, exit 2).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

from vlm.training.config import ConfigError, first_line
from vlm.training.jit_ops import announce_build

RENDEZVOUS_TIMEOUT_ENV = "VLM_RENDEZVOUS_TIMEOUT_S"
DEFAULT_RENDEZVOUS_TIMEOUT_S = 300


class DistributedError(ConfigError):
    """The process group cannot be set up (port taken, rendezvous failed or timed out); the message is one line."""


def free_port() -> int:
    """A TCP port nobody on this host listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def setup_distributed() -> None:
    """Plain ``python`` runs as a single process: set what the launchers would (a free port unless one is given)."""
    if "RANK" not in os.environ:
        defaults = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
        if "MASTER_PORT" not in os.environ:
            defaults["MASTER_PORT"] = str(free_port())
        for key, value in defaults.items():
            os.environ.setdefault(key, value)


def is_this_host(addr: str) -> bool:
    """Whether ``addr`` (a name or an IP) is an address of this machine: one of its IPs can be bound here."""
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((sockaddr[0], 0))
            return True
        except OSError:
            continue
    return False


def port_in_use(port: int) -> bool:
    """Whether a process on this host already listens on ``port`` (what the store's bind trips on). ``SO_REUSEADDR``
    as the store sets it: connections of a finished run still in TIME_WAIT do not count."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return True
    return False


def _master() -> tuple[str, int]:
    """``(MASTER_ADDR, MASTER_PORT)`` from the environment; a port that is not a number is a one-line error."""
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT", "")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(f"MASTER_PORT={port!r} is not a TCP port: pass --master_port N to the launcher")
    return addr, int(port)


def check_master_port() -> None:
    """On rank 0, when the store will be served from this host: fail in one line if ``MASTER_PORT`` is taken."""
    if os.environ.get("RANK", "0") != "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return
    addr, port = _master()
    if is_this_host(addr) and port_in_use(port):
        raise DistributedError(
            f"master port {port} is already in use on this host (another run?): pass --master_port N to the launcher "
            f"(MASTER_PORT=N for plain python), e.g. --master_port {free_port()}"
        )


def rendezvous_timeout() -> timedelta:
    """How long every rank may take to join the process group (``VLM_RENDEZVOUS_TIMEOUT_S``, default 300 s)."""
    raw = os.environ.get(RENDEZVOUS_TIMEOUT_ENV, str(DEFAULT_RENDEZVOUS_TIMEOUT_S))
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise DistributedError(f"{RENDEZVOUS_TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
    return timedelta(seconds=seconds)


def _restore_timeouts(timeout: timedelta) -> None:
    """After the rendezvous: collectives, and the store (NCCL's lazy setup waits on it), get ``timeout`` back."""
    import torch.distributed as dist

    dist.set_timeout(timeout)
    store = getattr(dist.distributed_c10d, "_get_default_store", lambda: None)()
    if store is not None:
        store.set_timeout(timeout)


def init_distributed() -> None:
    """Join (or, alone, create) the process group: gloo on CPU, NCCL on GPUs; bounded, one-line failures."""
    import deepspeed
    import torch
    from deepspeed.constants import default_pg_timeout

    setup_distributed()
    check_master_port()
    timeout = rendezvous_timeout()
    addr, port = _master()
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    announce_build("ShareMemCommBuilder")  # the CPU accelerator's collectives; no such op on GPUs
    try:
        deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl", timeout=timeout)
    except RuntimeError as err:  # torch.distributed.DistError (network, store, timeout) and backend errors
        cause = first_line(err)[:300]
        raise DistributedError(
            f"rank {rank} of {world} could not join the process group at {addr}:{port} within "
            f"{timeout.total_seconds():g} s ({cause}): check that every node was launched with the same "
            f"--master_addr/--master_port and --nnodes, and that the port is reachable"
        ) from None
    _restore_timeouts(default_pg_timeout)
