"""Vision pretraining on image-caption shards: the loop behind ``scripts/pretrain_vision.py``.

The models are ``vision_tower.pretrain``'s: ``objective="siglip"`` (tower, its summary pool, caption encoder, SigLIP's
sigmoid loss; scored by held-out retrieval), ``objective="superclass"`` (tower, summary pool, one logit per token
id; the caption's words are the image's labels, softmax cross-entropy) or ``"multilabel"`` (the same labels, sigmoid
binary cross-entropy per word); the last two are scored by R-precision of the caption's words, and can train
word detectors on every patch as well (``patch_labels``: noisy-OR over the patches; ``region_labels``: each patch
learns the words of the boxed regions it lies in, regions from ``data_pipelines.schema.sample_regions``).
This module reads the shards, cuts images exactly as the VLM's ``ImageProcessor`` will (same patch size, budget and
pixel shuffle), trains with AdamW (warmup then cosine), scores the held-out pairs and writes the tower's timm state
dict and its summary pool (the attention pool every objective reads) as ``.safetensors``
(``ConceptMoEVLMConfig.vision_weights`` loads it; ``vision_summary`` keeps the pool) with a ``.json`` record beside
it.

Launched as several processes (``torchrun --standalone --nproc_per_node N``, or any launcher that sets ``RANK`` /
``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``), the ranks join a gloo process group and split every global
batch of ``batch_size`` pairs between them (data parallel: one all-reduce averages the gradients each step): the
same batches, in the same order, as one process, so the same tower up to floating-point summation order. Rank 0
logs, evaluates and writes. On a CPU this is the fast way to use several cores: one thread per process scales where
one process's threads do not (the convolution stem's backward pass barely speeds up with a second thread).

Any webdataset shards whose samples hold an image and text work (this toolkit's caption samples, img2dataset's
image + caption pairs): a sample's first image is paired with all its text. Conversations, samples without an image
or without text (``missing_field``), unreadable images and broken shards are skipped and counted by kind when the
shards are read, never fatal.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from data_pipelines.schema import SkipSample, decode_sample, open_image, sample_regions
from data_pipelines.tar_reader import TruncatedTar, expand_shards, read_tar_groups, skip_marked
from data_pipelines.tokenizer import load_tokenizer, pad_id
from vision_tower import ImageProcessor, VisionTower
from vision_tower.boxes import patches_in_boxes
from vision_tower.pretrain import (
    CaptionClassPretrainer,
    ContrastivePretrainer,
    caption_idf,
    caption_words,
    pair_vocabulary,
)
from vision_tower.tower import SUMMARY_PREFIX
from vision_tower.words import WORD_PREFIX
from vlm.config import VISION_PRESETS, ConceptMoEVLMConfig

TOWER_FIELDS = (
    "vision_model",
    "vision_embed_dim",
    "vision_depth",
    "vision_heads",
    "patch_size",
    "vision_pos_embed",
    "vision_stem",
)
Region = tuple[list[float], list[int]]  # (normalised box [x0, y0, x1, y1], the region text's token ids)
Pair = tuple[bytes, list[int], list[Region]]  # (image file bytes, caption token ids, the sample's boxed regions)
OBJECTIVES = ("siglip", "superclass", "multilabel")
CAPTION_LOSS = {"superclass": "softmax", "multilabel": "sigmoid"}  # the CaptionClassPretrainer objectives
MAX_CAPTION_TOKENS = 64


@dataclass
class VisionPretrainConfig:
    shards: list[str]
    out: str  # the tower's weights: a .safetensors path
    eval_shards: list[str] = field(default_factory=list)
    preset: str = "tiny"  # the VLM preset whose tower is trained
    tower: dict = field(default_factory=dict)  # TOWER_FIELDS overrides (the VLM config's names)
    objective: str = "siglip"  # one of OBJECTIVES
    label_pairs: int = 0  # multilabel: word pairs up to this many informative tokens apart are labels too (0: off)
    patch_labels: float = 0.0  # superclass / multilabel: weight of the per-patch word detectors' loss (0: off)
    region_labels: float = 0.0  # superclass / multilabel: weight of the box-supervised patch words' loss (0: off)
    max_patches: int = 64
    pixel_shuffle: int = 2
    steps: int = 600
    batch_size: int = 128
    lr: float = 3e-3
    warmup: int = 50
    eval_every: int = 200
    log_every: int = 20
    seed: int = 0
    overwrite: bool = False  # replace an existing ``out``; otherwise an existing file is refused before training

    def tower_config(self) -> ConceptMoEVLMConfig:
        """The VLM config of the tower trained here: the preset's, with ``tower`` overrides (its defaults and
        checks are the VLM's own)."""
        if self.preset not in VISION_PRESETS:
            raise ValueError(f"preset must be one of {sorted(VISION_PRESETS)}, got {self.preset!r}")
        if unknown := sorted(set(self.tower) - set(TOWER_FIELDS)):
            raise ValueError(f"unknown tower field(s) {unknown}; allowed: {list(TOWER_FIELDS)}")
        return ConceptMoEVLMConfig.from_preset(self.preset, **self.tower)

    def check(self) -> None:
        if not str(self.out).endswith(".safetensors"):
            raise ValueError(f"out must be a .safetensors path, got {self.out!r}")
        if Path(self.out).exists() and not self.overwrite:
            raise ValueError(f"out {str(self.out)!r} exists; choose another path or pass overwrite (--overwrite)")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {list(OBJECTIVES)}, got {self.objective!r}")
        if self.label_pairs < 0 or (self.label_pairs and self.objective != "multilabel"):
            raise ValueError(
                f"label_pairs must be >= 0, and > 0 only with objective multilabel, got {self.label_pairs}"
            )
        for name in ("patch_labels", "region_labels"):
            weight = getattr(self, name)
            if weight < 0 or (weight and self.objective not in CAPTION_LOSS):
                raise ValueError(
                    f"{name} must be >= 0, and > 0 only with objective superclass or multilabel, got {weight}"
                )
        if self.batch_size < 2 or self.steps < 1 or self.warmup < 1:
            raise ValueError("batch_size must be >= 2, steps >= 1 and warmup >= 1")
        world = world_size()
        if self.batch_size % world or self.batch_size // world < 2:
            raise ValueError(f"batch_size {self.batch_size} must split into {world} processes' batches of >= 2 pairs")
        self.tower_config()


def world_size() -> int:
    """The launcher's ``WORLD_SIZE`` (1 without a launcher)."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        world = 0
    if world < 1:
        raise ValueError(f"WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} must be a positive integer")
    return world


def join_processes() -> tuple[int, int]:
    """(rank, world): with ``WORLD_SIZE`` > 1, this process joins the launcher's gloo process group."""
    world = world_size()
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    return (dist.get_rank() if world > 1 else 0), world


def all_agree(ok: bool, world: int) -> bool:
    """True when ``ok`` holds on every rank (one tiny all-reduce; ``ok`` itself alone)."""
    if world == 1:
        return ok
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def average_gradients(model: torch.nn.Module, world: int) -> None:
    """Every gradient replaced by its mean over the ranks (one all-reduce of all of them, flattened). Parameters
    the loss never reaches (timm's unused head norm) have no gradient on any rank and stay out."""
    if world == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    for g, mean in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(mean.view_as(g))


def summed_counts(counts: Counter, world: int) -> Counter:
    """``counts`` added up over the ranks."""
    if world == 1:
        return counts
    gathered: list = [None] * world
    dist.all_gather_object(gathered, dict(counts))
    return sum((Counter(c) for c in gathered), Counter())


def read_pairs(
    shards, tokenizer, max_tokens: int, skipped: Counter, warn: Callable[[str], None] = print, with_regions: bool = True
) -> list[Pair]:
    """(image bytes, caption ids, boxed regions with their text's ids: ``sample_regions``) for every usable sample of
    ``shards``; the rest counted in ``skipped`` by kind. ``with_regions=False`` leaves the regions empty (their
    phrases are not tokenized: only region labels read them)."""
    pairs = []
    for path in expand_shards(shards):
        try:
            for group in read_tar_groups(path):
                try:
                    skip_marked(group)
                    sample = decode_sample(group)
                    images = [s.image for s in sample.segments if s.image is not None]
                    text = " ".join(s.text for s in sample.segments if s.text is not None).strip()
                    if sample.is_conversation or not images or not text:
                        raise SkipSample("missing_field", "no image-caption pair")
                    open_image(images[0])  # decodes: a broken image is skipped here, once
                except SkipSample as err:
                    skipped[err.kind] += 1
                    continue
                boxed = sample_regions(sample.meta) if with_regions else []
                regions = [(box, tokenizer(phrase)["input_ids"]) for box, phrase in boxed]
                pairs.append((images[0], tokenizer(text)["input_ids"][:max_tokens], regions))
        except TruncatedTar as err:
            skipped["truncated_tar"] += 1
            warn(f"pretrain_vision: skipped the rest of a shard: {err}")
    return pairs


def region_targets(batch: dict, regions: list[list[Region]], word_index: dict[int, int]) -> torch.Tensor:
    """[B, L, K] 0/1: patch ``l`` of image ``b`` has word ``k`` (``word_index``: token id -> k) when the patch's
    centre on the processor's grid lies inside the box of one of the image's regions whose text holds it."""
    coord_BL2, valid_BL, grid_B2 = batch["patch_coord"], batch["patch_valid"].bool(), batch["grid_hw"]
    target_BLK = torch.zeros(*valid_BL.shape, len(word_index))
    for b, image_regions in enumerate(regions):
        if not image_regions:
            continue
        box_R4 = torch.tensor([box for box, _ in image_regions])
        words_RK = torch.zeros(len(image_regions), len(word_index))
        for r, (_, ids) in enumerate(image_regions):
            words_RK[r, [word_index[t] for t in ids if t in word_index]] = 1.0
        inside_LR = patches_in_boxes(coord_BL2[b], grid_B2[b], box_R4)
        target_BLK[b] = ((inside_LR & valid_BL[b, :, None]).float() @ words_RK).clamp(max=1.0)
    return target_BLK


def make_batch(
    pairs: list[Pair], processor: ImageProcessor, pad: int, skipped: Counter, word_index: dict[int, int] | None = None
) -> dict | None:
    """Images cut by ``processor`` and captions padded with ``pad`` (with ``word_index``, each patch's region words
    too: :func:`region_targets`); None when fewer than two images decode."""
    images, captions, regions = [], [], []
    for data, ids, boxed in pairs:
        try:
            images.append(open_image(data))
            captions.append(ids)
            regions.append(boxed)
        except SkipSample as err:
            skipped[err.kind] += 1
    if len(images) < 2:
        return None
    batch = dict(processor(images))
    if word_index is not None:
        batch["region_BLK"] = region_targets(batch, regions, word_index)
    length = max(len(ids) for ids in captions)
    batch["ids_BT"] = torch.tensor([ids + [pad] * (length - len(ids)) for ids in captions])
    batch["mask_BT"] = torch.tensor([[True] * len(ids) + [False] * (length - len(ids)) for ids in captions])
    return batch


def forward(model: ContrastivePretrainer | CaptionClassPretrainer, batch: dict):
    inputs = (batch["patches"], batch["patch_coord"], batch["patch_valid"], batch["ids_BT"], batch["mask_BT"])
    if "region_BLK" in batch:
        return model(*inputs, region_BLK=batch["region_BLK"])
    return model(*inputs)


def build_pretrainer(
    objective: str,
    tower: VisionTower,
    train: list[Pair],
    vocab_size: int,
    label_pairs: int = 0,
    patch_labels: float = 0.0,
    region_labels: float = 0.0,
):
    """The objective's model around ``tower``; the caption-word objectives take their IDF (and with ``label_pairs``,
    their word-pair labels) from ``train``, and with ``patch_labels`` / ``region_labels`` train word detectors on
    every patch too."""
    if objective in CAPTION_LOSS:
        captions = [ids for _, ids, _ in train]
        idf_V = caption_idf(captions, vocab_size)
        pairs = (
            dict(pairs=pair_vocabulary(captions, idf_V, label_pairs), pair_window=label_pairs) if label_pairs else {}
        )
        words = {}
        if patch_labels or region_labels:
            words = dict(patch_labels=patch_labels, region_labels=region_labels)
            words["patch_words"] = caption_words(captions, idf_V)
        return CaptionClassPretrainer(tower, idf_V, loss=CAPTION_LOSS[objective], **pairs, **words)
    return ContrastivePretrainer(tower, vocab_size, max_caption_tokens=MAX_CAPTION_TOKENS)


def data_line(train: list[Pair], held_out: list[Pair], skipped: Counter, model) -> str:
    """The log line of what was read: pairs, word-pair labels (with ``label_pairs``) and skips by kind."""
    labels = f"; {len(model.pairs)} word-pair labels" if getattr(model, "pairs", None) else ""
    read = f"pretrain_vision: {len(train)} train / {len(held_out)} held-out pairs{labels}"
    return f"{read}; skipped {dict(skipped) or 'none'}"


def train_step(model, opt: torch.optim.Optimizer, batch: dict, lr: float, world: int):
    """One AdamW step at ``lr`` on this rank's share of the batch, gradients averaged over the ranks, clipped to
    norm 1; returns the model's output."""
    for group in opt.param_groups:
        group["lr"] = lr
    out = forward(model, batch)
    opt.zero_grad(set_to_none=True)
    out.loss.backward()
    average_gradients(model, world)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return out


def _quiet(line: str) -> None:
    pass


def step_line(step: int, steps: int, model, out, seconds: float) -> str:
    """The log line of a training step: loss, the patch / region word losses when trained, the batch score."""
    parts = [(name, getattr(out, name, None)) for name in ("patch_loss", "region_loss")]
    extra = "".join(f" {name} {value.item():.4f}" for name, value in parts if value is not None)
    score = f"{model.score_name} {model.batch_score(out):.3f} ({seconds:.0f} s)"
    return f"step {step}/{steps} loss {out.loss.item():.4f}{extra} {score}"


def read_train_and_held_out(cfg: VisionPretrainConfig, tokenizer, skipped: Counter, log) -> tuple[list, list]:
    """The training and held-out pairs of ``cfg``'s shards (regions read only for region labels)."""
    regions = bool(cfg.region_labels)
    train = read_pairs(cfg.shards, tokenizer, MAX_CAPTION_TOKENS, skipped, log, regions)
    held_out = (
        [] if not cfg.eval_shards else read_pairs(cfg.eval_shards, tokenizer, MAX_CAPTION_TOKENS, skipped, log, regions)
    )
    if len(train) < cfg.batch_size:
        raise ValueError(f"{len(train)} image-caption pairs in the shards, fewer than batch_size {cfg.batch_size}")
    return train, held_out


def pretrain_vision(cfg: VisionPretrainConfig, log: Callable[[str], None] = print) -> dict:
    """Train, write ``cfg.out`` and its ``.json`` record, and return the record (every rank returns it; rank 0
    alone logs and writes)."""
    cfg.check()
    rank, world = join_processes()
    if rank:
        log = _quiet  # rank 0 speaks for all
    t0 = time.time()
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    tower_config = cfg.tower_config()
    fields = {name: getattr(tower_config, name) for name in TOWER_FIELDS}
    tower = VisionTower(**{**tower_config.tower_kwargs(), "summary": True, "words": 0})  # the pool they read
    tokenizer = load_tokenizer()
    processor = ImageProcessor(tower.patch_size, cfg.max_patches, cfg.pixel_shuffle)
    pad, skipped = pad_id(tokenizer), Counter()
    train, held_out = read_train_and_held_out(cfg, tokenizer, skipped, log)
    model = build_pretrainer(
        cfg.objective, tower, train, len(tokenizer), cfg.label_pairs, cfg.patch_labels, cfg.region_labels
    )
    word_index = {int(t): k for k, t in enumerate(model.word_ids_K)} if cfg.region_labels else None
    log(data_line(train, held_out, skipped, model))
    read_skips = Counter(skipped)  # every rank read every shard: counted once; later skips are each rank's own
    if world > 1:
        log(f"pretrain_vision: {world} processes, {cfg.batch_size // world} pairs each per step")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=1e-4)
    history: list[dict] = []
    order: list[int] = []
    for step in range(cfg.steps):
        if len(order) < cfg.batch_size:
            order += rng.sample(range(len(train)), len(train))  # epochs: every pair once, in a new order
        picked, order = order[: cfg.batch_size], order[cfg.batch_size :]
        batch = make_batch([train[i] for i in picked[rank::world]], processor, pad, skipped, word_index)
        if not all_agree(batch is not None, world):
            continue
        lr = cfg.lr * min((step + 1) / cfg.warmup, 0.5 * (1 + math.cos(math.pi * step / cfg.steps)))
        out = train_step(model, opt, batch, lr, world)
        if (step + 1) % cfg.log_every == 0 or step == 0:
            log(step_line(step + 1, cfg.steps, model, out, time.time() - t0))
        if rank == 0 and held_out and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
            history.append(
                {"step": step + 1, **evaluate(model, held_out, processor, pad, cfg.batch_size, skipped, word_index)}
            )
            log(json.dumps(history[-1]))
    record = {
        "tower": fields,
        "config": asdict(cfg),
        "processes": world,
        "pairs": {"train": len(train), "held_out": len(held_out)},
        "skipped": dict(read_skips + summed_counts(skipped - read_skips, world)),
        "eval": history,
        "seconds": round(time.time() - t0, 1),
    }
    if rank == 0:
        write_tower(Path(cfg.out), tower, record)
        log(f"pretrain_vision: wrote {cfg.out} and {Path(cfg.out).with_suffix('.json').name}")
    if world > 1:
        dist.barrier()  # no rank leaves (and no caller reads cfg.out) before the file is there
    return record


def write_tower(out_path: Path, tower: VisionTower, record: dict) -> None:
    """The tower's weights (timm's keys, its summary pool's under ``summary_pool.``, its word head's, if stage 0
    trained one, under ``word_head.``) as ``out_path``
    (safetensors; written aside, then renamed: a crash never leaves a cut file there) and ``record`` beside it as
    ``.json``."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    partial = out_path.with_name(out_path.name + ".partial")
    state = dict(tower.model.state_dict())
    state.update({SUMMARY_PREFIX + k: v for k, v in tower.require_summary_pool().summary_pool.state_dict().items()})
    if tower.word_head is not None:
        state.update({WORD_PREFIX + k: v for k, v in tower.word_head.state_dict().items()})
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(partial))
    partial.replace(out_path)
    out_path.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")


@torch.no_grad()
def evaluate(
    model, held_out: list[Pair], processor, pad: int, batch_size: int, skipped: Counter, word_index: dict | None = None
) -> dict:
    """Held-out loss and the model's batch score (SigLIP: own caption ranked first among the batch's, chance
    1 / batch_size; the caption-word objectives: R-precision of the caption's words) over the held-out pairs'
    full batches; with ``word_index`` (region labels) the loss holds the region loss too, also reported alone."""
    was_training = model.training
    model.eval()
    outs = []
    for i in range(0, len(held_out) - batch_size + 1, batch_size):
        batch = make_batch(held_out[i : i + batch_size], processor, pad, skipped, word_index)
        if batch is not None:
            outs.append(forward(model, batch))
    model.train(was_training)
    if not outs:
        return {}
    scores = {
        "eval_loss": sum(o.loss.item() for o in outs) / len(outs),
        f"eval_{model.score_name}": sum(model.batch_score(o) for o in outs) / len(outs),
    }
    if all(getattr(o, "region_loss", None) is not None for o in outs):
        scores["eval_region_loss"] = sum(o.region_loss.item() for o in outs) / len(outs)
    if model.score_name == "retrieval":
        scores["retrieval_chance"] = 1 / batch_size  # the own caption among the batch's
    return scores
