"""The DeepSpeed training loop: ZeRO 1/2/3 from a JSON, gradient accumulation, warmup + cosine LR, non-finite
loss skipping, exact resume, metrics.jsonl / TensorBoard / progress line on rank 0, periodic held-out eval."""

from __future__ import annotations

import json
import logging
import os
import random
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from data_pipelines.loader import loader_from_config
from vlm.training import checkpoint
from vlm.training.build import build_model
from vlm.training.checkpoint import CheckpointError
from vlm.training.config import DataConfig, TrainConfig
from vlm.training.distributed import init_distributed
from vlm.training.ds_config import DS_CONFIG_FILE, deepspeed_config, schedule_owner
from vlm.training.expert_parallel import check_expert_parallel, enable_expert_parallel
from vlm.training.export import export_checkpoint
from vlm.training.jit_ops import announce_build, optimizer_builder
from vlm.training.manifest import write_text_atomic
from vlm.training.metrics import MetricsWriter
from vlm.training.resume import Found, find_checkpoint, set_aside_newer, truncate_metrics
from vlm.training.step import (
    NonFiniteGuard,
    NonFiniteLossError,
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
    """The run's loader over ``shards`` (its data settings, seeded by ``train.seed``) for this rank."""
    return loader_from_config(
        DataConfig(**config["data"]),
        processor.tokenizer,
        processor.image_processor,
        shards,
        rank=rank,
        world_size=world_size,
        seed=config["train"]["seed"],
        image_token_id=processor.image_token_id,
        shuffle=shuffle,
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
    init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    os.makedirs(run_dir, exist_ok=True)
    train = config["train"]
    ds = deepspeed_config(config, ds_config, world_size)
    found = _agreed_checkpoint(run_dir, resume, rank, world_size)  # before the model is built: fails fast
    if rank == 0:
        write_text_atomic(os.path.join(run_dir, DS_CONFIG_FILE), json.dumps(ds, indent=2))
    model, processor, engine = _build_engine(config, ds)
    _seed_everything(train["seed"] + rank)
    loader = make_loader(config, processor, config["data"]["shards"], rank, world_size)
    session = _Session(config, run_dir, engine, processor, loader, NonFiniteGuard(train["max_nonfinite"]), rank)
    if found is not None:
        session.resume(found)
    record = session.train(own_schedule="scheduler" not in ds, target_r=model.config.text_config.effective_r)
    if train["export"] and rank == 0:
        export_checkpoint(run_dir, out_dir=os.path.join(run_dir, "hf"))
    if dist.is_initialized():
        dist.barrier()
    return record


def _build_engine(config: dict, ds: dict):
    """(model, processor, DeepSpeed engine); the router's parameters train at ``train.router_lr_scale`` of the lr."""
    import deepspeed

    model, processor = build_model(config)
    announce_build(optimizer_builder(ds))  # DeepSpeed's own Adam ("torch_adam": false) compiles on first use
    ep = config["train"]["expert_parallel"]
    check_expert_parallel(model, ep, dist.get_world_size(), ds.get("zero_optimization", {}).get("stage", 0))
    if ep > 1:  # split the experts (new parameters), then the optimizer groups
        held, total = enable_expert_parallel(model, ep)
        log.info("expert parallel %d: this rank holds %d of the %d expert parameters", ep, held, total)
    groups = optimizer_groups(model, config["train"]["router_lr_scale"])
    if ep > 1:  # DeepSpeed's MoE optimizer groups (vlm.training.expert_parallel)
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        named = [{**group, "name": f"group_{i}"} for i, group in enumerate(groups)]
        groups = split_params_into_different_moe_groups_for_optimizer(named)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=ds)
    log.info("learning rate: %s; precision: %s", schedule_owner(ds), precision_of(engine))
    return model, processor, engine


@dataclass
class _Session:
    """One rank's training run: the engine, its data and the step reached (what a checkpoint saves)."""

    config: dict
    run_dir: str
    engine: object
    processor: object
    loader: object
    guard: NonFiniteGuard
    rank: int
    step: int = 0

    def resume(self, found: Found) -> None:
        client, rank_state = checkpoint.load(self.engine, found.root, found.tag)
        self.step, self.guard.total = client["step"], client["nonfinite_total"]
        self.loader.load_state_dict(rank_state["loader"])
        checkpoint.set_rng_state(rank_state["rng"])
        if self.rank == 0:
            truncate_metrics(self.run_dir, self.step)
        log.info("resumed from %s/%s at step %d", found.root, found.tag, self.step)

    def save(self) -> None:
        client = {"step": self.step, "nonfinite_total": self.guard.total}
        rank_state = {"loader": self.loader.state_dict(), "rng": checkpoint.rng_state()}
        checkpoint.save(self.engine, self.run_dir, self.step, client, rank_state, self.config["train"]["keep_last"])

    def held_out(self) -> dict | None:
        """The held-out eval on the steps it is due (every ``train.eval_every`` with eval shards), else None."""
        train, data = self.config["train"], self.config["data"]
        if not (data["eval_shards"] and train["eval_every"]) or self.step % train["eval_every"] != 0:
            return None
        world_size = dist.get_world_size()
        eval_loader = make_loader(self.config, self.processor, data["eval_shards"], self.rank, world_size, False)
        return evaluate(self.engine, eval_loader, train["eval_batches"])

    def train(self, own_schedule: bool, target_r: float) -> dict:
        """Steps to ``train.max_steps``, saving every ``save_every``, at the end and on a non-finite loss stop;
        ``own_schedule``: our warmup + cosine sets the lr (else the DeepSpeed JSON's scheduler). The last record."""
        train, engine = self.config["train"], self.engine
        settings = TrainConfig(**train)
        monitor = engine.monitor if engine.monitor.enabled else None
        writer = MetricsWriter(
            self.run_dir,
            enabled=self.rank == 0,
            total_steps=train["max_steps"],
            start_step=self.step,
            log_every=train["log_every"],
            monitor=monitor,
        )
        batches, record = iter(self.loader), {}
        engine.train()
        try:
            while self.step < train["max_steps"]:
                # the base lr this step uses (ours, or what the JSON's scheduler set), with each group's lr_scale
                lr = set_lr(engine.optimizer, lr_at(self.step, settings) if own_schedule else None)
                micro = next_batches(batches, train["grad_accum"])
                start = time.perf_counter()
                stats = train_step(engine, micro, self.guard, self.step + 1)
                self.step += 1
                elapsed = time.perf_counter() - start
                held_out = self.held_out()  # before the step's line is printed, so that the line carries it
                record = writer.step_record(self.step, lr, target_r, stats, elapsed, self.guard, held_out)
                if self.step % train["save_every"] == 0 or self.step == train["max_steps"]:
                    self.save()
        except NonFiniteLossError:
            self.save()
            raise
        finally:
            writer.close()
        return record
