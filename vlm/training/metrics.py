"""Per-step statistics aggregated exactly over micro-batches and ranks, and the rank-0 writers: metrics.jsonl,
TensorBoard (when importable) and a progress line (step, loss, R total/text/image, tokens/s, ETA; on a step that
ran the held-out eval, its loss and eval-mode R too)."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from data_pipelines.run_config import default_of
from vlm.training.config import TrainConfig

log = logging.getLogger(__name__)

LOSS_KEYS = ("loss", "lm_loss", "ratio_loss", "balance_loss", "z_loss")
MODALITIES = {0: "text", 1: "image"}


@dataclass
class StepStats:
    """Loss terms averaged over micro-batches and ranks; token / concept counts summed, so R is exact."""

    losses: dict
    tokens: int
    concepts: int
    tokens_by_modality: dict
    concepts_by_modality: dict

    @classmethod
    def from_outputs(cls, outs: list, batches: list[dict]) -> StepStats:
        values = []
        for key in LOSS_KEYS:
            values.append(
                sum(float((o.loss if key == "loss" else o.aux.get(key, torch.zeros(()))).detach()) for o in outs)
            )
        counts = [sum(o.chunk_stats["tokens"] for o in outs), sum(o.chunk_stats["concepts"] for o in outs)]
        for m in MODALITIES:
            counts.append(sum(o.chunk_stats["tokens_by_modality"].get(m, 0) for o in outs))
            counts.append(sum(o.chunk_stats["concepts_by_modality"].get(m, 0) for o in outs))
        t = torch.tensor(values + counts + [len(outs)], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t)
        t = t.tolist()
        n_micro = t[-1]
        losses = {k: v / n_micro for k, v in zip(LOSS_KEYS, t[: len(LOSS_KEYS)])}
        c = [int(x) for x in t[len(LOSS_KEYS) : -1]]
        tokens_by = {m: c[2 + 2 * i] for i, m in enumerate(MODALITIES)}
        concepts_by = {m: c[3 + 2 * i] for i, m in enumerate(MODALITIES)}
        return cls(losses, c[0], c[1], tokens_by, concepts_by)

    def ratios(self) -> dict:
        out = {"r": self.tokens / max(self.concepts, 1)}
        for m, name in MODALITIES.items():
            t, c = self.tokens_by_modality[m], self.concepts_by_modality[m]
            out[f"r_{name}"] = t / max(c, 1) if t else None
        return out


def step_record(
    step: int, lr: float, target_r: float, stats: StepStats | None, elapsed: float, nonfinite_total: int
) -> dict:
    """One optimiser step's ``metrics.jsonl`` record: loss terms, R total / text / image, token and concept counts
    (in total and by modality, keys ``"0"`` / ``"1"``), tokens/s; only ``skipped`` and the counters when skipped."""
    record = {
        "step": step,
        "lr": lr,
        "target_r": target_r,
        "skipped": stats is None,
        "nonfinite_total": nonfinite_total,
    }
    if stats is not None:
        record |= stats.losses | stats.ratios()
        record["tokens"], record["concepts"] = stats.tokens, stats.concepts
        record["tokens_by_modality"] = {str(m): n for m, n in stats.tokens_by_modality.items()}
        record["concepts_by_modality"] = {str(m): n for m, n in stats.concepts_by_modality.items()}
        record["tokens_per_s"] = stats.tokens / max(elapsed, 1e-9)
    return record


class MetricsWriter:
    """Rank 0 only (``enabled``): appends to ``RUN_DIR/metrics.jsonl``, TensorBoard scalars, a progress line."""

    def __init__(
        self,
        run_dir: str,
        enabled: bool,
        total_steps: int,
        start_step: int = 0,
        log_every: int = default_of(TrainConfig, "log_every"),
        monitor=None,
    ):
        self.enabled, self.total_steps, self.start_step = enabled, total_steps, start_step
        self.monitor = monitor  # DeepSpeed's MonitorMaster: the JSON's tensorboard / csv_monitor / wandb blocks
        self.log_every = log_every
        self.t0 = time.perf_counter()
        self.file = self.tb = None
        if not enabled:
            return
        self.file = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        try:
            from torch.utils.tensorboard import SummaryWriter

            # a resumed run rewrites the steps after its checkpoint: TensorBoard drops its old events for them
            self.tb = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=start_step + 1 if start_step else None)
        except ImportError as err:
            log.info("TensorBoard logging off (%s)", err)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        prefix = "eval/" if record.get("split") == "eval" else "train/"
        scalars = {
            prefix + key: value
            for key, value in record.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step"
        }
        if self.tb is not None:
            for name, value in scalars.items():
                self.tb.add_scalar(name, value, record["step"])
        if self.monitor is not None:
            self.monitor.write_events([(name, value, record["step"]) for name, value in scalars.items()])

    def step_record(
        self,
        step: int,
        lr: float,
        target_r: float,
        stats: StepStats | None,
        elapsed: float,
        guard,
        eval_record: dict | None = None,
    ) -> dict:
        """Builds, writes and prints one optimiser step's record (collective-free; stats are already reduced), and
        ``eval_record`` (``step.evaluate``'s, when this step ran the held-out eval) after it, as ``split: eval``;
        a step with an eval always prints its line, the eval's loss and R on it."""
        record = step_record(step, lr, target_r, stats, elapsed, guard.total)
        self.write(record)
        if eval_record is not None:
            self.write({"step": step, "split": "eval", **eval_record})
        due = step % self.log_every == 0 or step == self.total_steps or stats is None or eval_record is not None
        if self.enabled and due:
            self.progress(record, eval_record)
        return record

    def progress(self, record: dict, eval_record: dict | None = None) -> None:
        done = record["step"] - self.start_step
        eta = (time.perf_counter() - self.t0) / max(done, 1) * (self.total_steps - record["step"])
        fmt = lambda x: "-" if x is None else f"{x:.2f}"
        if record["skipped"]:
            line = f"step {record['step']}/{self.total_steps} skipped (non-finite loss)"
        else:
            line = (
                f"step {record['step']}/{self.total_steps} loss {record['loss']:.4f} R {fmt(record['r'])} "
                f"text {fmt(record['r_text'])} image {fmt(record['r_image'])} "
                f"{record['tokens_per_s']:.0f} tok/s ETA {eta:.0f}s"
            )
        if eval_record is not None:
            line += f" | eval loss {eval_record['eval_loss']:.4f} R {fmt(eval_record['eval_r'])}"
        log.info(line)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
