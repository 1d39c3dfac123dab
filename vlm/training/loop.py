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
from vlm.training.ds_config import DS_CONFIG_FILE, deepspeed_config, schedule_owner
from vlm.training.export import export_checkpoint
from vlm.training.jit_ops import announce_build, optimizer_builder
from vlm.training.manifest import write_text_atomic
from vlm.training.metrics import MetricsWriter
from vlm.training.resume import Found, find_checkpoint, set_aside_newer, truncate_metrics
from vlm.training.step import (
    NonFiniteGuard,
    NonFiniteLossError,
    TrainSettings,
    evaluate,
    lr_at,
    next_batches,
    optimizer_groups,
    precision_of,
    set_lr,
    train_step,
)

log = logging.getLogger(__name__)


def make_loader(config: dict, processor, shards: list[str], rank: int, world_size: int, shuffle: bool = True):
    data = config["data"]
    return make_dataloader(
        shards,
        processor.tokenizer,
        processor.image_processor,
        seq_len=data["seq_len"],
        batch_size=data["batch_size"],
        rank=rank,
        world_size=world_size,
        num_workers=data["num_workers"],
        seed=config["train"]["seed"],
        image_token_id=processor.image_token_id,
        shuffle=shuffle,
        split_documents=data["split_documents"],
        loss_on=data["loss_on"],
    )


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


def run(config: dict, run_dir: str, ds_config: dict | str | None = None, resume: str | None = None) -> dict:
    """Train per ``config`` into ``run_dir`` with the DeepSpeed config ``ds_config`` (reconciled with ``config`` by
    ``vlm.training.ds_config.deepspeed_config``; a JSON path or None is reconciled here); returns the last step's
    metrics record."""
    import deepspeed

    init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    os.makedirs(run_dir, exist_ok=True)
    train = config["train"]
    ds = deepspeed_config(config, ds_config, world_size)
    found = _agreed_checkpoint(run_dir, resume, rank, world_size)  # before the model is built: fails fast
    if rank == 0:
        write_text_atomic(os.path.join(run_dir, DS_CONFIG_FILE), json.dumps(ds, indent=2))
    model, processor = build_model(config)
    announce_build(optimizer_builder(ds))  # DeepSpeed's own Adam ("torch_adam": false) compiles on first use
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=optimizer_groups(model, train["router_lr_scale"]), config=ds
    )
    log.info("learning rate: %s; precision: %s", schedule_owner(ds), precision_of(engine))
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
    settings = TrainSettings(
        steps=train["max_steps"], lr=train["lr"], warmup=train["warmup"], min_lr_ratio=train["min_lr_ratio"]
    )
    target_r = model.config.text_config.effective_r
    writer = MetricsWriter(
        run_dir,
        enabled=rank == 0,
        total_steps=train["max_steps"],
        start_step=step,
        log_every=train["log_every"],
        monitor=engine.monitor if engine.monitor.enabled else None,
    )
    own_schedule = "scheduler" not in ds
    eval_on = bool(config["data"]["eval_shards"] and train["eval_every"])

    def save() -> None:
        checkpoint.save(
            engine,
            run_dir,
            step,
            {"step": step, "nonfinite_total": guard.total},
            {"loader": loader.state_dict(), "rng": checkpoint.rng_state()},
            train["keep_last"],
        )

    batches, record = iter(loader), {}
    engine.train()
    try:
        while step < train["max_steps"]:
            # the base lr this step uses (ours, or what the JSON's scheduler set), with each group's lr_scale on top
            lr = set_lr(engine.optimizer, lr_at(step, settings) if own_schedule else None)
            micro = next_batches(batches, train["grad_accum"])
            start = time.perf_counter()
            stats = train_step(engine, micro, guard, step + 1)
            step += 1
            elapsed = time.perf_counter() - start
            held_out = None  # the eval runs before the step's line is printed, so that the line carries it
            if eval_on and step % train["eval_every"] == 0:
                eval_loader = make_loader(config, processor, config["data"]["eval_shards"], rank, world_size, False)
                held_out = evaluate(engine, eval_loader, train["eval_batches"])
            record = writer.step_record(step, lr, target_r, stats, elapsed, guard, held_out)
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
