"""The DeepSpeed training loop: ZeRO 1/2/3 from a JSON, gradient accumulation, warmup + cosine LR, non-finite
loss skipping, exact resume, metrics.jsonl / TensorBoard / progress line on rank 0, periodic held-out eval."""

from __future__ import annotations

import json
import logging
import math
import os
import random
import socket
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from vlm.training import checkpoint
from vlm.training.config import ConfigError
from vlm.training.metrics import MetricsWriter, StepStats
from vlm.training.single_process import TrainSettings, lr_at

log = logging.getLogger(__name__)


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


def setup_distributed() -> None:
    """Plain ``python`` runs as a single process: set what the launchers would."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                           ("MASTER_PORT", str(port))):  # fmt: skip
            os.environ.setdefault(key, value)


# What ``model.overrides`` may change on a loaded checkpoint (training-time fields; never a weight shape).
INIT_OVERRIDABLE = (
    "target_r", "ratio_loss_weight", "noise_tau", "balance_loss_weight", "router_z_loss_weight",
    "target_r_by_modality", "ratio_loss_modality_weights",
)  # fmt: skip


def init_from_checkpoint(config: dict, processor):
    """``model.init_from``: a ``ConceptMoEVLM`` folder (training continues from it), or a text-only
    ``ConceptMoEForCausalLM`` folder — e.g. a converted MoE (``scripts/convert_to_conceptmoe.py``) — which gets a
    fresh vision tower and projector (``ConceptMoEVLM.from_text_model``, the paper's recipe)."""
    from vlm import ConceptMoEVLM

    path = Path(config["model"]["init_from"])
    try:
        model_type = json.loads((path / "config.json").read_text())["model_type"]
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"model.init_from={str(path)!r} is not a saved model folder ({type(err).__name__})") from None
    if model_type == ConceptMoEVLM.config_class.model_type:
        model = ConceptMoEVLM.from_pretrained(str(path))
        if model.config.image_token_id != processor.image_token_id:
            raise ConfigError(
                f"model.init_from has image_token_id {model.config.image_token_id} but the tokenizer's <image> is "
                f"{processor.image_token_id}: set data.tokenizer to the checkpoint's tokenizer"
            )
    elif model_type == "conceptmoe":
        model = ConceptMoEVLM.from_text_model(
            str(path), image_token_id=processor.image_token_id, max_patches=config["data"]["max_patches"]
        )
    else:
        raise ConfigError(f"model.init_from={str(path)!r} holds a {model_type!r} model, not a ConceptMoE one")
    for name, value in config["model"]["overrides"].items():
        if name not in INIT_OVERRIDABLE:
            raise ConfigError(
                f"model.overrides.{name} cannot change a loaded checkpoint (model.init_from); allowed: "
                + ", ".join(INIT_OVERRIDABLE)
            )
        for cfg in (model.config.text_config, model.language_model.config):
            setattr(cfg, name, value)
    return model


def build_model(config: dict):
    """The model and its processor from ``model.preset`` / ``model.overrides`` (or ``model.init_from``) and the
    tokenizer."""
    from data_pipelines import load_tokenizer
    from vision_tower import ImageProcessor
    from vlm import ConceptMoEVLM, VLMProcessor

    data = config["data"]
    processor = VLMProcessor(load_tokenizer(data["tokenizer"]), ImageProcessor(max_patches=data["max_patches"]))
    torch.manual_seed(config["train"]["seed"])  # identical initial weights on every rank
    if config["model"]["init_from"]:
        return init_from_checkpoint(config, processor), processor
    model = ConceptMoEVLM.from_preset(
        config["model"]["preset"],
        image_token_id=processor.image_token_id,
        vocab_size=len(processor.tokenizer),
        max_patches=data["max_patches"],
        **config["model"]["overrides"],
    )
    return model, processor


def deepspeed_config(config: dict, path: str | None, world_size: int) -> dict:
    """The DeepSpeed JSON (ZeRO stage etc.) with batch, accumulation, clipping and optimiser filled from the YAML."""
    ds = {"zero_optimization": {"stage": 0}}
    if path is not None:
        with open(path) as f:
            ds = json.load(f)
    train, data = config["train"], config["data"]
    ds["train_micro_batch_size_per_gpu"] = data["batch_size"]
    ds["gradient_accumulation_steps"] = train["grad_accum"]
    ds["train_batch_size"] = data["batch_size"] * train["grad_accum"] * world_size
    ds["gradient_clipping"] = float(train["grad_clip"])
    ds.setdefault("optimizer", {"type": "AdamW", "params": {}})
    params = ds["optimizer"].setdefault("params", {})
    params.update(lr=float(train["lr"]), weight_decay=float(train["weight_decay"]), torch_adam=True)
    params.setdefault("betas", [0.9, 0.95])
    ds.setdefault("steps_per_print", 10**9)
    return ds


def make_loader(config: dict, processor, shards: list[str], rank: int, world_size: int, shuffle: bool = True):
    from data_pipelines import make_dataloader

    data = config["data"]
    return make_dataloader(
        shards, processor.tokenizer, processor.image_processor, seq_len=data["seq_len"],
        batch_size=data["batch_size"], rank=rank, world_size=world_size, num_workers=data["num_workers"],
        seed=config["train"]["seed"], image_token_id=processor.image_token_id, shuffle=shuffle,
        split_documents=data["split_documents"],
    )  # fmt: skip


def next_batches(batches, n: int) -> list[dict]:
    """``n`` batches, leaving the global torch RNG untouched: torch's DataLoader draws a seed from it when an
    iterator starts, which happens at a different step in a resumed run and would shift the boundary noise."""
    with torch.random.fork_rng(devices=[]):
        return [next(batches) for _ in range(n)]


def _all_reduce(values: list[float], op=None) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t.tolist()


def train_step(engine, batches: list[dict], guard: NonFiniteGuard, step: int) -> StepStats | None:
    """One optimiser step over ``grad_accum`` micro-batches. Forwards run first so that a non-finite loss on
    any rank skips the whole step (no backward, no optimiser step) on every rank. None when skipped."""
    outs = [engine(**batch) for batch in batches]
    local_bad = float(any(not torch.isfinite(out.loss).item() for out in outs))
    skip = guard.update(_all_reduce([local_bad], dist.ReduceOp.MAX if dist.is_initialized() else None)[0] == 0, step)
    if skip:
        return None
    for out in outs:
        engine.backward(out.loss)
        engine.step()
    return StepStats.from_outputs(outs, batches)


@torch.no_grad()
def evaluate(engine, loader, n_batches: int) -> dict:
    """Held-out LM loss (nats per predicted token) and bits per token over the first ``n_batches`` of each rank's
    part of the eval split (the same batches every time), summed over ranks; the global RNG is left untouched.

    Also the eval-mode compression (p >= 0.5, no boundary noise): ``eval_r``, ``eval_r_text``, ``eval_r_image``
    from token and concept counts summed over batches and ranks (None for a modality without tokens), the R a
    deployed model runs at, which may drift from the training R (the paper's §4.6)."""
    engine.eval()
    loss_sum, n_tokens = 0.0, 0.0
    counts = [0.0] * 6  # tokens, concepts: total, text, image
    for batch in next_batches(iter(loader), n_batches):
        with torch.random.fork_rng(devices=[]):
            out = engine(**batch)
        n = float((batch["labels"][:, 1:] != -100).sum())
        loss_sum += out.aux["lm_loss"].item() * n
        n_tokens += n
        cs = out.chunk_stats
        counts[0] += cs["tokens"]
        counts[1] += cs["concepts"]
        for m in (0, 1):  # text, image
            counts[2 + 2 * m] += cs["tokens_by_modality"].get(m, 0)
            counts[3 + 2 * m] += cs["concepts_by_modality"].get(m, 0)
    engine.train()
    loss_sum, n_tokens, *counts = _all_reduce([loss_sum, n_tokens, *counts])
    loss = loss_sum / max(n_tokens, 1.0)
    r = [counts[2 * i] / max(counts[2 * i + 1], 1.0) if counts[2 * i] else None for i in range(3)]
    return {"eval_loss": loss, "eval_bits_per_token": loss / math.log(2), "eval_tokens": int(n_tokens),
            "eval_r": r[0], "eval_r_text": r[1], "eval_r_image": r[2]}  # fmt: skip


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run(config: dict, run_dir: str, deepspeed_json: str | None = None, resume: str | None = None) -> dict:
    """Train per ``config`` into ``run_dir``; returns the last step's metrics record."""
    import deepspeed

    setup_distributed()
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    os.makedirs(run_dir, exist_ok=True)
    train = config["train"]
    model, processor = build_model(config)
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=deepspeed_config(config, deepspeed_json, world_size),
    )
    _seed_everything(train["seed"] + rank)
    loader = make_loader(config, processor, config["data"]["shards"], rank, world_size)
    step, guard = 0, NonFiniteGuard(train["max_nonfinite"])
    found = checkpoint.resolve_resume(run_dir, resume)
    if found is not None:
        client, rank_state = checkpoint.load(engine, *found)
        step, guard.total = client["step"], client["nonfinite_total"]
        loader.load_state_dict(rank_state["loader"])
        checkpoint.set_rng_state(rank_state["rng"])
        log.info("resumed from %s/%s at step %d", *found, step)
    settings = TrainSettings(steps=train["max_steps"], lr=train["lr"], warmup=train["warmup"],
                             min_lr_ratio=train["min_lr_ratio"])  # fmt: skip
    target_r = model.config.text_config.effective_r
    writer = MetricsWriter(
        run_dir, enabled=rank == 0, total_steps=train["max_steps"], start_step=step, log_every=train["log_every"]
    )
    eval_on = bool(config["data"]["eval_shards"] and train["eval_every"])

    def save() -> None:
        checkpoint.save(
            engine, run_dir, step, {"step": step, "nonfinite_total": guard.total},
            {"loader": loader.state_dict(), "rng": checkpoint.rng_state()}, train["keep_last"],
        )  # fmt: skip

    batches, record = iter(loader), {}
    engine.train()
    try:
        while step < train["max_steps"]:
            lr = lr_at(step, settings)
            for group in engine.optimizer.param_groups:
                group["lr"] = lr
            micro = next_batches(batches, train["grad_accum"])
            start = time.perf_counter()
            stats = train_step(engine, micro, guard, step + 1)
            step += 1
            elapsed = time.perf_counter() - start
            record = writer.step_record(step, lr, target_r, stats, elapsed, guard)
            if eval_on and step % train["eval_every"] == 0:
                eval_loader = make_loader(config, processor, config["data"]["eval_shards"], rank, world_size, False)
                writer.write({"step": step, "split": "eval", **evaluate(engine, eval_loader, train["eval_batches"])})
            if step % train["save_every"] == 0 or step == train["max_steps"]:
                save()
    except NonFiniteLossError:
        save()
        raise
    finally:
        writer.close()
    if train["export"] and rank == 0:
        from vlm.training.export import export_checkpoint

        export_checkpoint(run_dir, out_dir=os.path.join(run_dir, "hf"))
    if dist.is_initialized():
        dist.barrier()
    return record
