"""Can the language model copy? A copying probe: the backbone alone, trained on rows that repeat a random sequence.

Needle and long-document answers are copied from the context: the answer has to find where the question's key
stood and copy what follows it. This probe measures the simplest form of that, in one process and a few minutes:
each row is a random token sequence ``A`` (``length`` tokens), a gap of ``0..max_gap`` random tokens, ``A`` again,
then random tokens up to a fixed row length; the loss and the score are on the second ``A`` from its second token
on (its first token is unpredictable). With ``max_gap`` 0 the copy stands a fixed distance back and attention by
relative position alone can learn it; with a random gap only a content-addressed lookup (an induction circuit: find
the earlier occurrence of the current token, copy the token after it) can. ``docs/seeing.md`` ("Copying a needle")
has the measurements: with the shipped tokenizer's 8,192 tokens, ``tiny-moe`` copies only with its input and output
embeddings tied.

Scores: greedy (argmax) accuracy on the copied tokens of held-out rows (a generator of its own seed), against
chance 1 / the drawn tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vlm.backbone.config import ConceptMoEConfig
from vlm.backbone.model import ConceptMoEForCausalLM

FIRST_TOKEN = 10  # tokens are drawn from [FIRST_TOKEN, vocab_size): the special tokens stay out of the rows


@dataclass
class CopyProbeConfig:
    preset: str = "tiny-moe"
    overrides: dict = field(default_factory=dict)  # backbone fields (``ConceptMoEConfig.from_preset`` overrides)
    vocab_size: int = 8192  # the shipped tokenizer's size
    length: int = 24  # tokens of the copied sequence
    max_gap: int = 32  # random tokens between the two copies: 0..max_gap (0: a fixed distance)
    rows: int = 16
    steps: int = 600
    lr: float = 3e-3
    warmup: int = 20
    eval_every: int = 100
    eval_rows: int = 64
    seed: int = 0


@dataclass
class CopyScore:
    step: int
    loss: float  # the last training step's
    copied: float  # held-out accuracy on the copied tokens
    chance: float  # 1 / the tokens a row draws from
    seconds: float


def check_config(cfg: CopyProbeConfig) -> None:
    """One-line ``ValueError`` for a probe that could not run."""
    if cfg.vocab_size <= FIRST_TOKEN + 1:
        raise ValueError(f"vocab_size must be > {FIRST_TOKEN + 1}, got {cfg.vocab_size}")
    if cfg.length < 2 or cfg.max_gap < 0:
        raise ValueError(f"need length >= 2 and max_gap >= 0, got length={cfg.length}, max_gap={cfg.max_gap}")
    if min(cfg.rows, cfg.steps, cfg.eval_every, cfg.eval_rows) < 1:
        raise ValueError("rows, steps, eval_every and eval_rows must be >= 1")
    known = ConceptMoEConfig.from_preset(cfg.preset).to_dict()
    if unknown := sorted(set(cfg.overrides) - set(known)):
        raise ValueError(f"unknown backbone fields {unknown} (e.g. tie_word_embeddings, d_model, n_heads)")


def copy_rows(cfg: CopyProbeConfig, rows: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [rows, 2 * length + max_gap], labels: the ids on the second copy from its second token, else -100)."""
    width = 2 * cfg.length + cfg.max_gap
    ids_BT = torch.randint(FIRST_TOKEN, cfg.vocab_size, (rows, width), generator=generator)
    labels_BT = torch.full_like(ids_BT, -100)
    gaps = torch.randint(0, cfg.max_gap + 1, (rows,), generator=generator)
    for r, gap in enumerate(gaps.tolist()):
        start = cfg.length + gap
        ids_BT[r, start : start + cfg.length] = ids_BT[r, : cfg.length]
        labels_BT[r, start + 1 : start + cfg.length] = ids_BT[r, start + 1 : start + cfg.length]
    return ids_BT, labels_BT


@torch.no_grad()
def copied_share(model: ConceptMoEForCausalLM, ids_BT: torch.Tensor, labels_BT: torch.Tensor) -> float:
    """Greedy accuracy of ``model`` on the labelled (copied) tokens."""
    was_training = model.training
    model.eval()
    predicted_BT = model(input_ids=ids_BT).logits[:, :-1].argmax(-1)
    model.train(was_training)
    target_BT = labels_BT[:, 1:]
    mask = target_BT != -100
    return (predicted_BT == target_BT)[mask].float().mean().item()


def train_copying(
    model: ConceptMoEForCausalLM, cfg: CopyProbeConfig, report: Callable[[CopyScore], None] = lambda score: None
) -> list[CopyScore]:
    """Trains ``model`` (any backbone of ``cfg.vocab_size`` tokens, e.g. a VLM's ``language_model`` before its
    first image stage) ``cfg.steps`` steps on copy rows (AdamW (0.9, 0.95), linear warmup, constant lr, grad clip
    1), scoring every ``eval_every`` steps and at the end; returns the scores (each also passed to ``report``)."""
    check_config(cfg)
    if model.config.vocab_size != cfg.vocab_size:
        raise ValueError(f"the model has {model.config.vocab_size} tokens, the copy rows {cfg.vocab_size}")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    train = torch.Generator().manual_seed(cfg.seed * 2 + 1)
    held_out = copy_rows(cfg, cfg.eval_rows, torch.Generator().manual_seed(cfg.seed * 2 + 2))
    scores, started = [], time.time()
    model.train()
    for step in range(1, cfg.steps + 1):
        ids_BT, labels_BT = copy_rows(cfg, cfg.rows, train)
        loss = model(input_ids=ids_BT, labels=labels_BT).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr * min(1.0, step / max(1, cfg.warmup))
        optimizer.step()
        if step % cfg.eval_every == 0 or step == cfg.steps:
            copied, seconds = copied_share(model, *held_out), time.time() - started
            chance = round(1 / (cfg.vocab_size - FIRST_TOKEN), 6)
            scores.append(CopyScore(step, round(loss.item(), 4), round(copied, 3), chance, round(seconds, 1)))
            report(scores[-1])
    return scores


def run(cfg: CopyProbeConfig, report: Callable[[CopyScore], None] = lambda score: None) -> list[CopyScore]:
    """A fresh backbone of ``cfg.preset`` (seeded by ``cfg.seed``), trained by :func:`train_copying`."""
    check_config(cfg)
    torch.manual_seed(cfg.seed)
    model = ConceptMoEForCausalLM(ConceptMoEConfig.from_preset(cfg.preset, vocab_size=cfg.vocab_size, **cfg.overrides))
    return train_copying(model, cfg, report)
