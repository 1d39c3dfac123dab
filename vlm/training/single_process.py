"""A minimal single-process training loop for the backbone (the CPU demo and the convergence test).

AdamW, linear warmup then cosine decay, gradient clipping; every step's loss terms and chunk
statistics are recorded. Multi-process ZeRO training is ``scripts/train_vlm.py`` (DeepSpeed).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


@dataclass
class TrainSettings:
    steps: int = 300
    lr: float = 3e-3
    warmup: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0


def lr_at(step: int, s: TrainSettings) -> float:
    """Linear warmup to ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr_ratio * lr``."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def train(
    model, batches: Iterator[dict], settings: TrainSettings, on_step: Callable[[dict], None] | None = None
) -> list[dict]:
    """Train ``model`` on ``batches`` (dicts of model inputs incl. labels); returns one record per step."""
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay, betas=(0.9, 0.95)
    )
    model.train()
    history = []
    for step in range(settings.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, settings)
        batch = next(batches)
        start = time.perf_counter()
        out = model(**batch)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        record = {
            "step": step + 1,
            "loss": out.loss.item(),
            **{k: v.item() for k, v in out.aux.items()},
            "r": out.chunk_stats["r"],
            "r_by_modality": out.chunk_stats["r_by_modality"],
            "tokens_by_modality": out.chunk_stats["tokens_by_modality"],
            "concepts_by_modality": out.chunk_stats["concepts_by_modality"],
            "target_r": getattr(model.config, "text_config", model.config).effective_r,
            "flip_rate": out.chunk_stats["flip_rate"],
            "grad_norm": float(grad_norm),
            "lr": optimizer.param_groups[0]["lr"],
            "tokens_per_s": out.chunk_stats["tokens"] / elapsed,
        }
        history.append(record)
        if on_step is not None:
            on_step(record)
    return history


@torch.no_grad()
def evaluate(model, batches: Iterator[dict], max_batches: int = 8) -> dict:
    """Held-out LM loss (nats and bits per token) and the eval-mode compression ratio."""
    model.eval()
    loss_sum, token_count, tokens, concepts = 0.0, 0, 0, 0
    for _, batch in zip(range(max_batches), batches):
        out = model(**batch)
        n = int((batch["labels"][:, 1:] != -100).sum())
        loss_sum += out.aux["lm_loss"].item() * n
        token_count += n
        tokens += out.chunk_stats["tokens"]
        concepts += out.chunk_stats["concepts"]
    model.train()
    loss = loss_sum / max(token_count, 1)
    return {"lm_loss": loss, "bits_per_token": loss / math.log(2), "r": tokens / max(concepts, 1)}
