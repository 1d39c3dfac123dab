"""Does a VLM read its image? A seeing probe: train on scene questions in one process, score held-out answers.

The probe is the measuring tool behind ``docs/seeing.md`` and the convergence test that keeps the toolkit from
silently blinding its models (``tests/vlm/training/test_probe.py``). It trains exactly as ``train_vlm.py`` does on
the data side (``scenes_chat`` conversations from the synthetic generator, encoded by
``data_pipelines.packing.encode_sample_tokens`` with the loss on the answer, packed into rows by ``Packer``,
collated by ``collate_rows``), but in one process with a plain AdamW loop, so that one lever costs a few minutes.

A curriculum is a list of :class:`Stage`: from step ``start`` on, training scenes are drawn with the stage's
``max_objects`` and ``object_size`` (the generator's options, the same ``make_shards.py --option`` writes into
shards). Scoring is on held-out scenes (the generator's ``eval`` split) of ``eval_objects`` / ``eval_size`` (with
``eval_min_objects`` > 1, only scenes of at least that many objects: the binding questions, "What colour is the
square?" among others, without the one-object scenes where no binding is needed):
an answer is right when greedy decoding reproduces it exactly (teacher-forced argmax of every answer token and the
closing ``<|end|>``, which is what greedy generation emits). Next to each accuracy the probe reports the chance
level (the best constant answer on the same items: what a blind model that learned the answer prior scores) and
eval-mode R per modality. ``copy_steps`` (:meth:`SeeingProbe.pretrain_copying`) first gives the language model
alone that many steps of copy rows (``vlm.training.copy_probe``): with tied embeddings and needle answers that
restate the needle sentence (``needle_answer="sentence"``), it is what makes needles copyable (docs/seeing.md).
"""

from __future__ import annotations

import io
import json
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace

import torch
from PIL import Image

from data_pipelines import synthetic
from data_pipelines.chat import render
from data_pipelines.packing import Packer, TokenEncoder, collate_rows, encode_sample_tokens
from data_pipelines.schema import Sample, Segment, SkipSample, Turn
from data_pipelines.tokenizer import load_tokenizer
from vision_tower import ImageProcessor
from vlm import ConceptMoEVLM, ConceptMoEVLMConfig, VLMProcessor
from vlm.training.copy_probe import CopyProbeConfig, CopyScore, train_copying
from vlm.training.probe_boxes import box_hit, greedy_tails, mean_box_chance
from vlm.training.vision_pretraining import region_targets


@dataclass
class Stage:
    """From step ``start`` on (0-based), training scenes hold 1..``max_objects`` shapes of side ``object_size``
    (fractions of the short side; None: the generator's small / medium / large bands)."""

    start: int = 0
    max_objects: int = 1
    object_size: tuple[float, float] | None = None
    types: tuple[str, ...] | None = None  # the question types trained in this stage (None: all of the probe's)


@dataclass
class ProbeConfig:
    preset: str = "tiny-moe"
    overrides: dict = field(default_factory=dict)  # model fields (``ConceptMoEVLM.from_preset`` overrides)
    types: tuple[str, ...] = ("colour",)  # sceneqa question types trained and scored
    stages: list[Stage] = field(default_factory=lambda: [Stage()])
    steps: int = 400
    rows: int = 4  # rows per step
    seq_len: int = 256  # several conversations per row, as training packs them
    lr: float = 3e-3
    warmup: int = 20
    max_patches: int = 64
    eval_every: int = 100
    eval_n: int = 200
    eval_objects: int = 1
    eval_min_objects: int = 1  # held-out scenes with fewer objects are left out
    eval_size: tuple[float, float] | None = None
    seed: int = 0
    caption_share: float = 0.0  # share of training samples that are captioned scenes (loss on the whole caption)
    turns: str = "one"  # training scenes: one question per conversation, or "all" of a scene's in one conversation
    needle_units: tuple[int, int] = (1, 3)  # haystack units of the ``needle`` type (train and held out)
    needle_modalities: tuple[str, ...] = ("text",)  # where its needles are: text (copying), image (reading)
    needle_answer: str = "value"  # its answers: the value, or the needle sentence restated ("sentence")
    copy_steps: int = 0  # steps of copy rows (``vlm.training.copy_probe``) for the language model alone, first
    scene_input: str = "image"  # SCENE_INPUTS: the image, the image with its true words (needs vision_words), text


@dataclass
class ProbeScore:
    step: int
    loss: float  # the last training step's
    accuracy: dict[str, float]  # per question type
    chance: dict[str, float]  # the best constant answer's accuracy on the same items
    distinct: dict[str, int]  # distinct predicted answers (1: a constant answer)
    r: dict[str, float | None]  # eval-mode R: total, text, image
    seconds: float
    skipped: dict[str, int] = field(default_factory=dict)  # training samples skipped so far, by kind


def scene_questions(
    cfg: ProbeConfig, split: str, max_objects: int, object_size, seed: int, types: tuple[str, ...] | None = None
) -> Iterator[Sample]:
    """An endless stream, deterministic from the arguments, of ``scenes_chat`` questions of ``types`` (default
    ``cfg.types``; in training with ``cfg.turns == "all"``, all of a scene's in one conversation) and, for the
    ``needle`` type, ``needles_chat`` haystacks of ``cfg.needle_units`` units, one of each in turn."""
    types = cfg.types if types is None else types
    streams = []
    scene_types = tuple(t for t in types if t != "needle")
    if scene_types and split == "train" and cfg.turns == "all":  # every question of a scene in one conversation
        options = dict(max_objects=max_objects, object_size=object_size, types=scene_types, turns="all")
        streams.append(_endless("scenes_chat", split, seed, **options))
    elif scene_types:
        streams.append(
            sample
            for sample in _endless("scenes_chat", split, seed, max_objects=max_objects, object_size=object_size)
            if sample.meta["task"] in ("sceneqa", "refloc") and question_type(sample) in types
        )
    if scene_types and cfg.scene_input == "text":
        streams = [map(scene_as_text, stream) for stream in streams]
    if "needle" in types:
        low, high = cfg.needle_units
        options = dict(min_units=low, max_units=high, modalities=cfg.needle_modalities, answer=cfg.needle_answer)
        streams.append(_endless("needles_chat", split, seed, **options))
    while True:
        for stream in streams:
            yield next(stream)


def training_samples(cfg: ProbeConfig, stage: Stage, seed: int) -> Iterator[Sample]:
    """A stage's training stream: its questions, and with ``cfg.caption_share`` its captioned scenes (every object
    named with its size, colour, shape and place: a dense signal beside one answer token)."""
    questions = scene_questions(cfg, "train", stage.max_objects, stage.object_size, seed, stage.types)
    captions = _endless("scenes", "train", seed + 1, max_objects=stage.max_objects, object_size=stage.object_size)
    draw = torch.Generator().manual_seed(seed)
    while True:
        yield next(captions) if torch.rand((), generator=draw) < cfg.caption_share else next(questions)


def _endless(kind: str, split: str, seed: int, **options) -> Iterator[Sample]:
    """``kind``'s samples in blocks of 1000, each block from its own seed, so the stream never ends."""
    block = 0
    while True:
        yield from synthetic.generate(kind, 1000, seed * 7919 + block, split, **options)
        block += 1


QUESTION_TYPES = ("colour", "shape", "position", "count", "box", "needle")


def question_type(sample: Sample) -> str:
    """A probe item's question type: its ``qa`` type; ``box`` for a refloc conversation (scored by IoU,
    ``vlm.training.probe_boxes``)."""
    return "box" if sample.meta["task"] == "refloc" else sample.meta["type"]


# what a scene question shows of its scene: the image (its tokens' words, with ``vision_words``, from the tower's
# word head); the image, its tokens' words the ground truth (``true_words``: each patch inside an object's box says
# that object's words, a perfect word head); or no image, its objects written out as text (``text``)
SCENE_INPUTS = ("image", "true_words", "text")


def scene_as_text(sample: Sample) -> Sample:
    """``sample`` with each image replaced by its objects written out (``meta["regions"]``' phrases, in drawing
    order: "small red square top left, large blue circle center."): the same facts, one word per position."""
    listing = ", ".join(region["text"] for region in sample.meta["regions"]) + "."
    turns = [
        Turn(t.role, [Segment(text=listing) if seg.image is not None else seg for seg in t.segments])
        for t in sample.turns
    ]
    return replace(sample, turns=turns)


@contextmanager
def true_words(tower, target_BLK: torch.Tensor):
    """Within the block, ``tower.word_probs`` returns ``target_BLK`` (each patch's true words, 0/1) in place of
    its word head's probabilities: the image tokens carry exactly their objects' words (padding none)."""
    tower.word_probs = lambda feats: target_BLK.to(feats.features_BLD.device) * feats.valid_BL[..., None]
    try:
        yield
    finally:
        del tower.word_probs


def parse_overrides(items: list[str]) -> dict:
    """The probes' ``--set FIELD=JSON`` items as ``{field: value}``; a one-line ``ValueError`` for an item without
    ``=`` or whose value is not JSON (``true``, ``2``, ``0.5``, ``"text"``)."""
    overrides = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected FIELD=JSON")
        try:
            overrides[name] = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f'--set {item!r}: the value must be JSON (true, 2, 0.5, "text")') from None
    return overrides


def check_config(cfg: ProbeConfig) -> None:
    """One-line ``ValueError`` for a probe that could not run: unknown question types, stages out of order or not
    starting at step 0, or generator options the scenes generator refuses."""
    if not cfg.types or set(cfg.types) - set(QUESTION_TYPES):
        raise ValueError(f"types must be among {QUESTION_TYPES}, got {cfg.types}")
    if stray := sorted({t for s in cfg.stages for t in s.types or ()} - set(cfg.types)):
        raise ValueError(f"a stage trains {stray}, which are not among the probe's types {cfg.types}")
    starts = [s.start for s in cfg.stages]
    if not starts or starts[0] != 0 or starts != sorted(set(starts)):
        raise ValueError(f"stages must start at step 0, in increasing order, got starts {starts}")
    for s in [*cfg.stages, Stage(0, cfg.eval_objects, cfg.eval_size)]:
        next(synthetic.generate("scenes", 1, 0, max_objects=s.max_objects, object_size=s.object_size))
    if "needle" in cfg.types:  # only a probe that draws needles pays for drawing one here
        low, high = cfg.needle_units
        options = dict(min_units=low, max_units=high, modalities=cfg.needle_modalities, answer=cfg.needle_answer)
        next(synthetic.generate("needles", 1, 0, **options))
    if not 1 <= cfg.eval_min_objects <= cfg.eval_objects:
        raise ValueError(f"need 1 <= eval_min_objects <= eval_objects, got {cfg.eval_min_objects}, {cfg.eval_objects}")
    if cfg.scene_input not in SCENE_INPUTS:
        raise ValueError(f"scene_input must be one of {SCENE_INPUTS}, got {cfg.scene_input!r}")
    if cfg.scene_input == "true_words" and not cfg.overrides.get("vision_words"):
        raise ValueError("scene_input 'true_words' replaces the word head's output: it needs vision_words=true")
    if cfg.turns not in ("one", "all"):
        raise ValueError(f"turns must be 'one' or 'all', got {cfg.turns!r}")
    if not 0.0 <= cfg.caption_share < 1.0:
        raise ValueError(f"caption_share must be in [0, 1), got {cfg.caption_share}")
    if min(cfg.steps, cfg.rows, cfg.eval_every, cfg.eval_n) < 1 or cfg.copy_steps < 0:
        raise ValueError("steps, rows, eval_every and eval_n must be >= 1, copy_steps >= 0")


class SeeingProbe:
    def __init__(self, cfg: ProbeConfig):
        check_config(cfg)
        self.cfg = cfg
        tokenizer = load_tokenizer()
        base = ConceptMoEVLMConfig.from_preset(cfg.preset)
        cuts = {k: cfg.overrides.get(k, getattr(base, k)) for k in ("patch_size", "pixel_shuffle")}
        self.processor = VLMProcessor(tokenizer, ImageProcessor(max_patches=cfg.max_patches, **cuts))
        self.encoder = TokenEncoder(tokenizer)
        torch.manual_seed(cfg.seed)
        self.model = ConceptMoEVLM.from_preset(
            cfg.preset,
            image_token_id=self.processor.image_token_id,
            vocab_size=len(tokenizer),
            max_patches=cfg.max_patches,
            **{**self.processor.special_token_ids, **cfg.overrides},
        )
        self.skipped: Counter = Counter()  # training samples skipped, by kind (too_long: longer than seq_len)
        eval_stream = (
            sample
            for sample in scene_questions(cfg, "eval", cfg.eval_objects, cfg.eval_size, cfg.seed)
            if sample.meta.get("objects", cfg.eval_min_objects) >= cfg.eval_min_objects  # needles have no objects
        )
        self.eval_items = [next(eval_stream) for _ in range(cfg.eval_n)]
        self.regions: dict[int, list] = {}  # id of a training image waiting in the packer -> its sample's regions
        self.word_index: dict[int, int] = {}  # with true_words: token id -> its place in the word head
        if cfg.scene_input == "true_words":
            ids = self.model.vision_tower.require_word_head().ids_K.tolist()
            self.word_index = {int(t): k for k, t in enumerate(ids)}

    def words_for(self, batch: dict, regions: list[list[dict]]):
        """The context the model runs a batch in: with ``scene_input == "true_words"``, its image tokens carry the
        true words of the images' ``regions`` (:func:`true_words`); else nothing changes."""
        if self.cfg.scene_input != "true_words":
            return nullcontext()
        tokenize = self.processor.tokenizer
        boxed = [[(r["box"], tokenize(r["text"])["input_ids"]) for r in image] for image in regions]
        return true_words(self.model.vision_tower, region_targets(batch, boxed, self.word_index))

    def batches(self) -> Iterator[tuple[int, dict, list[list[dict]]]]:
        """(stage index, collated batch, each of its images' regions) per step: rows packed from the current
        stage's stream."""
        cfg, image_processor = self.cfg, self.processor.image_processor
        streams: dict[int, Iterator[Sample]] = {}
        packer = Packer(cfg.seq_len)
        for step in range(cfg.steps):
            stage = max(i for i, s in enumerate(cfg.stages) if s.start <= step)
            if stage not in streams:
                streams[stage] = training_samples(cfg, cfg.stages[stage], cfg.seed + stage)
            rows, skipped_in_a_row = [], 0
            while len(rows) < cfg.rows:  # without split_documents a document closes at most one row
                try:
                    sample = next(streams[stage])
                    doc = encode_sample_tokens(sample, self.encoder, image_processor, self.processor.image_token_id)
                    self.regions.update({id(image): sample.meta.get("regions", []) for image in doc.images})
                    rows += packer.add(doc)
                    skipped_in_a_row = 0
                except SkipSample as skip:  # counted, as the training loader counts its skips
                    self.skipped[skip.kind] += 1
                    skipped_in_a_row += 1
                    if skipped_in_a_row == 100:
                        raise ValueError(f"100 samples in a row skipped ({skip}): raise seq_len") from None
            regions = [self.regions.pop(id(image)) for row in rows for image in row.images]
            yield stage, collate_rows(rows, cfg.seq_len, self.processor.pad_token_id, image_processor), regions

    @torch.no_grad()
    def score(self, step: int, loss: float, started: float) -> ProbeScore:
        """Greedy exact match on the held-out items, per question type (box answers: greedy decoding, a hit at IoU
        >= 0.5), with chance and eval-mode R."""
        self.model.eval()
        right, answers, truths, boxes = Counter(), {}, {}, []
        tokens, concepts = Counter(), Counter()
        for i in range(0, len(self.eval_items), 32):
            items = self.eval_items[i : i + 32]
            texts = [render(s.turns) for s in items]  # the conversation with its answer, as the chat template has it
            images = [[_pil(seg.image) for t in s.turns for seg in t.segments if seg.image is not None] for s in items]
            batch = self.processor(text=texts, images=images)
            answer_len = [len(self.encoder.text_ids(s.qa[0]["a"])) + 1 for s in items]  # + <|end|>
            kinds = [question_type(s) for s in items]
            starts = [int(batch["attention_mask"][r].sum()) - answer_len[r] for r in range(len(items))]
            with self.words_for(batch, [s.meta.get("regions", []) for s in items]):
                out = self.model(**batch)
                if "box" in kinds:  # box answers: the model's own greedy tokens, scored by IoU
                    tails = greedy_tails(self.model, batch, starts, max(answer_len), self.processor.pad_token_id)
            stats = out.chunk_stats
            tokens.update(stats["tokens_by_modality"])
            concepts.update(stats["concepts_by_modality"])
            predicted = out.logits[:, :-1].argmax(-1)
            for r, sample in enumerate(items):
                end = int(batch["attention_mask"][r].sum())
                want = batch["input_ids"][r, end - answer_len[r] : end]
                got = predicted[r, end - answer_len[r] - 1 : end - 1]
                kind = kinds[r]
                if kind == "box":
                    said = self.processor.tokenizer.decode(tails[r].tolist()).split("<|end|>")[0]
                    right[kind] += box_hit(said, sample.qa[0]["box"])
                    answers.setdefault(kind, Counter())[said] += 1
                    boxes.append(sample.qa[0]["box"])
                else:
                    right[kind] += bool((got == want).all())
                    answers.setdefault(kind, Counter())[tuple(got.tolist())] += 1
                truths.setdefault(kind, Counter())[sample.qa[0]["a"]] += 1
        self.model.train()
        total = {k: sum(c.values()) for k, c in truths.items()}
        chance = {k: round(max(truths[k].values()) / total[k], 3) for k in sorted(total)}
        if boxes:
            chance["box"] = round(mean_box_chance(boxes), 3)
        return ProbeScore(
            step=step,
            loss=round(loss, 4),
            accuracy={k: round(right[k] / total[k], 3) for k in sorted(total)},
            chance=chance,
            distinct={k: len(answers[k]) for k in sorted(total)},
            r={
                "total": _ratio(sum(tokens.values()), sum(concepts.values())),
                "text": _ratio(tokens[0], concepts[0]),
                "image": _ratio(tokens[1], concepts[1]),
            },
            seconds=round(time.time() - started, 1),
            skipped=dict(self.skipped),
        )

    def pretrain_copying(self, report: Callable[[CopyScore], None] = lambda score: None) -> list[CopyScore]:
        """``cfg.copy_steps`` steps of copy rows (a random sequence, a random gap, the sequence again: the
        content-addressed copy a needle answer needs) for the language model alone, before any image or question;
        nothing when ``copy_steps`` is 0. Returns the copying scores (held-out accuracy on the copy)."""
        if not self.cfg.copy_steps:
            return []
        lm, steps = self.model.language_model, self.cfg.copy_steps
        copy_cfg = CopyProbeConfig(
            vocab_size=lm.config.vocab_size, steps=steps, eval_every=max(1, steps // 4), seed=self.cfg.seed
        )
        return train_copying(lm, copy_cfg, report)

    def run(self, report: Callable[[ProbeScore], None] = lambda score: None) -> list[ProbeScore]:
        """Trains ``cfg.steps`` steps (AdamW, linear warmup, cosine to 10%, grad clip 1), scoring every
        ``eval_every`` steps and at the end; returns the scores (each also passed to ``report``)."""
        cfg, model = self.cfg, self.model
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        model.train()
        scores, started = [], time.time()
        for step, (_, batch, regions) in enumerate(self.batches(), start=1):
            with self.words_for(batch, regions):
                loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            for group in optimizer.param_groups:
                group["lr"] = cfg.lr * _schedule(step - 1, cfg.steps, cfg.warmup)
            optimizer.step()
            if step % cfg.eval_every == 0 or step == cfg.steps:
                scores.append(self.score(step, loss.item(), started))
                report(scores[-1])
        return scores


def _schedule(step: int, steps: int, warmup: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine from 1 to 0.1 at ``steps``."""
    return min(1.0, (step + 1) / max(1, warmup)) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, step / steps))))


def _ratio(tokens: int, concepts: int) -> float | None:
    return round(tokens / concepts, 3) if concepts else None


def _pil(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")
