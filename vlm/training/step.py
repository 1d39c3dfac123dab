"""What every training run does, whatever runs it: the learning-rate schedule, one optimiser step (``train_step``)
and the held-out evaluation (``evaluate``).

Both take an *engine*: a DeepSpeed engine (``vlm.training.loop``), a ``LocalEngine``
(``vlm.training.single_process``) or, for ``evaluate``, any model. An engine is called with a batch's tensors
(``engine(**batch)``), has ``backward(loss)`` and ``step()`` (the optimiser step at the end of a gradient-accumulation
window), ``optimizer`` and ``train()`` / ``eval()``.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from vlm.training.config import TrainConfig
from vlm.training.metrics import StepStats

log = logging.getLogger(__name__)


def lr_at(step: int, s: TrainConfig) -> float:
    """Linear warmup to ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr_ratio * lr`` at ``max_steps``."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.max_steps - s.warmup)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


# The boundary router's parameters (``ChunkModule``'s W_q / W_k, or the linear router's scorer).
ROUTER_PARAM_MARK = ".chunker."


def optimizer_groups(model: torch.nn.Module, router_lr_scale: float) -> list[dict]:
    """The trainable parameters as optimiser groups: everything (group 0, the schedule's lr), then the boundary
    router with ``lr_scale = router_lr_scale`` (``set_lr`` applies it). No router group without chunking.

    Why the router gets its own, lower lr: the ratio loss (Eq. 3-4) reaches the router only through G = mean p, so
    every p of a step gets the same push; identical neighbours (flat image background, most patches of a synthetic
    scene) share one p, and at the full lr Adam's normalised steps carried that shared p across 0.5 and back in
    blocks of steps: all of them boundaries (image R ~1), then none (R ~10+). At 0.1x the per-step R of the tiny
    recipe stays within +-15% of the target over the second half of training (docs/study.md, "R under control").
    H-Net also gives parts of its network their own lr multipliers (per hierarchy stage, through optimiser groups);
    the router's 0.1 here is this project's choice, measured there.
    """
    router, rest = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (router if ROUTER_PARAM_MARK in f".{name}" else rest).append(param)
    groups = [{"params": rest, "lr_scale": 1.0}]
    if router:
        groups.append({"params": router, "lr_scale": float(router_lr_scale)})
    return groups


def set_lr(optimizer, lr: float | None = None) -> float:
    """Give every group ``lr`` times its ``lr_scale`` and return the base lr. With ``lr=None`` the base is group 0's
    current lr (a DeepSpeed JSON scheduler set it for every group alike; the scales are applied on top)."""
    groups = optimizer.param_groups
    base = groups[0]["lr"] if lr is None else lr
    for group in groups:
        group["lr"] = base * group.get("lr_scale", 1.0)
    return base


class NonFiniteLossError(RuntimeError):
    """Raised after ``train.max_nonfinite`` optimiser steps in a row had a non-finite loss."""


class NonFiniteGuard:
    """Counts skipped steps; raises after ``limit`` in a row."""

    def __init__(self, limit: int):
        self.limit, self.in_a_row, self.total = limit, 0, 0

    def update(self, finite: bool, step: int) -> bool:
        """Returns True when the step must be skipped."""
        if finite:
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        self.total += 1
        log.warning("step %d: non-finite loss, step skipped (%d in a row, %d total)", step, self.in_a_row, self.total)
        if self.in_a_row >= self.limit:
            raise NonFiniteLossError(
                f"stopping: {self.in_a_row} optimiser steps in a row had a non-finite loss (last at step {step}); "
                "the last good state was checkpointed"
            )
        return True


def next_batches(batches: Iterator[dict], n: int) -> list[dict]:
    """``n`` batches, leaving the global torch RNG untouched: torch's DataLoader draws a seed from it when an
    iterator starts, which happens at a different step in a resumed run and would shift the boundary noise."""
    with torch.random.fork_rng(devices=[]):
        return [next(batches) for _ in range(n)]


def all_reduce(values: list[float], op=None) -> list[float]:
    """``values`` summed (or ``op``) over ranks; as they are in a single process."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t.tolist()


def placement(engine) -> tuple[torch.device, torch.dtype]:
    """Where an engine's (or model's) inputs go: its device (``engine.device``: DeepSpeed's, ``LocalEngine``'s;
    else its parameters') and the dtype of its floating-point weights (bf16 / fp16 when the DeepSpeed JSON says)."""
    module = getattr(engine, "module", engine)
    param = next((p for p in module.parameters() if p.is_floating_point()), None)
    device = getattr(engine, "device", None) or (param.device if param is not None else torch.device("cpu"))
    return torch.device(device), (param.dtype if param is not None else torch.float32)


def precision_of(engine) -> str:
    return str(placement(engine)[1]).removeprefix("torch.")


def to_engine(batch: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """A loader batch moved to the engine: every tensor to ``device``; floating-point ones (pixels) to ``dtype``
    too. Integer tensors (ids, labels, positions, modality, doc ids) keep their dtype."""
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            value = value.to(device, dtype if value.is_floating_point() else None, non_blocking=True)
        out[key] = value
    return out


def train_step(engine, batches: list[dict], guard: NonFiniteGuard, step: int) -> StepStats | None:
    """One optimiser step over ``grad_accum`` micro-batches, each moved to the engine's device and precision.
    Forwards run first so that a non-finite loss on any rank skips the whole step (no backward, no optimiser step)
    on every rank. None when skipped."""
    device, dtype = placement(engine)
    outs = [engine(**to_engine(batch, device, dtype)) for batch in batches]
    local_bad = float(any(not torch.isfinite(out.loss).item() for out in outs))
    skip = guard.update(all_reduce([local_bad], dist.ReduceOp.MAX if dist.is_initialized() else None)[0] == 0, step)
    if skip:
        return None
    for out in outs:
        engine.backward(out.loss)
        engine.step()
    return StepStats.from_outputs(outs, batches)


@torch.no_grad()
def evaluate(engine, batches: Iterable[dict], n_batches: int = 8) -> dict:
    """Held-out LM loss (nats per predicted token) and bits per token over the first ``n_batches`` of ``batches``
    (each rank's part of the eval split: the same batches every time), summed over ranks; the global RNG is left
    untouched and the engine (or model) goes back to the mode it was in.

    Also the eval-mode compression (p >= 0.5, no boundary noise): ``eval_r``, ``eval_r_text``, ``eval_r_image``
    from token and concept counts summed over batches and ranks (None for a modality without tokens), the R a
    deployed model runs at, which may drift from the training R (the paper's §4.6)."""
    was_training = engine.training
    engine.eval()
    loss_sum, n_tokens = 0.0, 0.0
    counts = [0.0] * 6  # tokens, concepts: total, text, image
    with torch.random.fork_rng(devices=[]):  # starting a DataLoader's iterator draws from the global RNG
        held_out = list(itertools.islice(batches, n_batches))
    device, dtype = placement(engine)
    for batch in held_out:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            out = engine(**to_engine(batch, device, dtype))
        n = float((batch["labels"][:, 1:] != -100).sum())
        loss_sum += out.aux["lm_loss"].item() * n
        n_tokens += n
        cs = out.chunk_stats
        counts[0] += cs["tokens"]
        counts[1] += cs["concepts"]
        for m in (0, 1):  # text, image
            counts[2 + 2 * m] += cs["tokens_by_modality"].get(m, 0)
            counts[3 + 2 * m] += cs["concepts_by_modality"].get(m, 0)
    engine.train(was_training)
    loss_sum, n_tokens, *counts = all_reduce([loss_sum, n_tokens, *counts])
    loss = loss_sum / max(n_tokens, 1.0)
    r = [counts[2 * i] / max(counts[2 * i + 1], 1.0) if counts[2 * i] else None for i in range(3)]
    return {
        "eval_loss": loss,
        "eval_bits_per_token": loss / math.log(2),
        "eval_tokens": int(n_tokens),
        "eval_r": r[0],
        "eval_r_text": r[1],
        "eval_r_image": r[2],
    }
