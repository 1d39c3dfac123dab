"""Single-process training without DeepSpeed (the CPU demos, benchmarks and convergence tests), on the same step
and evaluation as the DeepSpeed loop (``vlm.training.step``): ``LocalEngine`` is the slice of a DeepSpeed engine
they use, over one model and a plain AdamW with gradient clipping.

Linear warmup then cosine decay; non-finite losses are skipped as in the DeepSpeed loop. Every step's record is the
one the DeepSpeed loop writes to ``metrics.jsonl``, plus ``grad_norm``. Multi-process ZeRO training is
``scripts/train_vlm.py`` (DeepSpeed).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from functools import partial

import torch

from data_pipelines.run_config import default_of
from vlm.training.config import TrainConfig
from vlm.training.metrics import step_record
from vlm.training.step import NonFiniteGuard, evaluate, lr_at, optimizer_groups, set_lr, train_step

__all__ = ["LocalEngine", "TrainConfig", "evaluate", "train"]
_default = partial(default_of, TrainConfig)


class LocalEngine:
    """What ``train_step`` / ``evaluate`` use of a DeepSpeed engine, on one process: called like the model,
    ``backward`` (the loss scaled by ``1 / grad_accum``, as DeepSpeed does) and ``step`` (clip the gradient norm to
    ``grad_clip``, AdamW step, zero the gradients at the end of every ``grad_accum`` micro-batches), ``optimizer``,
    ``train`` / ``eval``."""

    def __init__(
        self,
        model: torch.nn.Module,
        lr: float,
        weight_decay: float = _default("weight_decay"),
        grad_clip: float = _default("grad_clip"),
        grad_accum: int = _default("grad_accum"),
        betas: tuple[float, float] = (0.9, 0.95),
        router_lr_scale: float = _default("router_lr_scale"),
    ):
        self.module, self.grad_clip, self.grad_accum = model, grad_clip, grad_accum
        groups = optimizer_groups(model, router_lr_scale)
        self.optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, betas=betas)
        set_lr(self.optimizer, lr)
        self.micro_steps = self.global_steps = 0
        self.grad_norm: float | None = None  # before clipping, at the last optimiser step

    def __call__(self, **batch):
        return self.module(**batch)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.grad_accum).backward()

    def step(self) -> None:
        self.micro_steps += 1
        if self.micro_steps % self.grad_accum:
            return
        self.grad_norm = float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.grad_clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_steps += 1

    @property
    def training(self) -> bool:
        return self.module.training

    def train(self, mode: bool = True) -> LocalEngine:
        self.module.train(mode)
        return self

    def eval(self) -> LocalEngine:
        return self.train(False)


def train(
    model, batches: Iterator[dict], settings: TrainConfig, on_step: Callable[[dict], None] | None = None
) -> list[dict]:
    """Train ``model`` on ``batches`` (dicts of model inputs incl. labels), one batch per optimiser step, for
    ``settings.max_steps`` steps (its checkpoint, eval and data fields are the DeepSpeed loop's: unused here);
    returns one record per step (see the module docstring). Raises ``NonFiniteLossError`` after
    ``settings.max_nonfinite`` non-finite steps in a row."""
    engine = LocalEngine(
        model, settings.lr, settings.weight_decay, settings.grad_clip, router_lr_scale=settings.router_lr_scale
    )
    guard = NonFiniteGuard(settings.max_nonfinite)
    target_r = getattr(model.config, "text_config", model.config).effective_r
    engine.train()
    history = []
    for step in range(settings.max_steps):
        lr = set_lr(engine.optimizer, lr_at(step, settings))
        batch = next(batches)
        start = time.perf_counter()
        stats = train_step(engine, [batch], guard, step + 1)
        record = step_record(step + 1, lr, target_r, stats, time.perf_counter() - start, guard.total)
        if stats is not None:
            record["grad_norm"] = engine.grad_norm
        history.append(record)
        if on_step is not None:
            on_step(record)
    return history
