"""The DeepSpeed training loop: ZeRO 1/2/3 from a JSON, gradient accumulation, warmup + cosine LR, non-finite
loss skipping, exact resume, metrics.jsonl / TensorBoard / progress line on rank 0, periodic held-out eval."""

from __future__ import annotations

import json
import logging
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist

from data_pipelines.loader import make_dataloader
from vlm.training import checkpoint
from vlm.training.build import build_model
from vlm.training.checkpoint import CheckpointError
from vlm.training.distributed import init_distributed
from vlm.training.export import export_checkpoint
from vlm.training.metrics import MetricsWriter
from vlm.training.resume import Found, find_checkpoint, set_aside_newer, truncate_metrics
from vlm.training.step import (
    NonFiniteGuard,
    NonFiniteLossError,
    TrainSettings,
    evaluate,
    lr_at,
    next_batches,
    train_step,
)

log = logging.getLogger(__name__)


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
    data = config["data"]
    return make_dataloader(
        shards, processor.tokenizer, processor.image_processor, seq_len=data["seq_len"],
        batch_size=data["batch_size"], rank=rank, world_size=world_size, num_workers=data["num_workers"],
        seed=config["train"]["seed"], image_token_id=processor.image_token_id, shuffle=shuffle,
        split_documents=data["split_documents"], loss_on=data["loss_on"],
    )  # fmt: skip


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _agreed_checkpoint(run_dir: str, resume: str | None, rank: int, world_size: int) -> Found | None:
    """Rank 0 finds (and verifies) the checkpoint to resume from and sets aside newer broken ones; every rank gets
    its answer, or the same one-line ``CheckpointError``."""
    answer = [None]
    if rank == 0:
        try:
            found = find_checkpoint(run_dir, resume, world_size)
            if found is not None:
                set_aside_newer(found, run_dir)
            answer = [found]
        except CheckpointError as err:
            answer = [str(err)]
    if world_size > 1:
        dist.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], str):
        raise CheckpointError(answer[0])
    return answer[0]


def run(config: dict, run_dir: str, deepspeed_json: str | None = None, resume: str | None = None) -> dict:
    """Train per ``config`` into ``run_dir``; returns the last step's metrics record."""
    import deepspeed

    init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    os.makedirs(run_dir, exist_ok=True)
    train = config["train"]
    found = _agreed_checkpoint(run_dir, resume, rank, world_size)  # before the model is built: fails fast
    model, processor = build_model(config)
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=deepspeed_config(config, deepspeed_json, world_size),
    )
    _seed_everything(train["seed"] + rank)
    loader = make_loader(config, processor, config["data"]["shards"], rank, world_size)
    step, guard = 0, NonFiniteGuard(train["max_nonfinite"])
    if found is not None:
        client, rank_state = checkpoint.load(engine, found.root, found.tag)
        step, guard.total = client["step"], client["nonfinite_total"]
        loader.load_state_dict(rank_state["loader"])
        checkpoint.set_rng_state(rank_state["rng"])
        if rank == 0:
            truncate_metrics(run_dir, step)
        log.info("resumed from %s/%s at step %d", found.root, found.tag, step)
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
        export_checkpoint(run_dir, out_dir=os.path.join(run_dir, "hf"))
    if dist.is_initialized():
        dist.barrier()
    return record
