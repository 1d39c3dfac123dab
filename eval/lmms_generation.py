"""The model-side work of the lmms-eval plugin: chat prompts, chunking overrides, batched generation,
log-likelihoods, and the per-row compression statistics (R total / text / image) of a prompt forward.

Kept apart from ``eval/lmms_plugin.py`` so that it can be tested without lmms-eval's request objects: every
function takes the model, the processor and plain items (``{"prompt": str, "images": [PIL...]}``).
"""

# Shape suffixes (docs/paper.md §0): B batch rows, N tokens per row.

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from data_pipelines.chat import END_OF_TURN
from data_pipelines.schema import Modality

logger = logging.getLogger(__name__)

DEFAULT_TEMPLATE = "default"  # ``chat_template`` value: the processor's own template
_RAW = ("none", "raw", "false", "off", "0")


# ----------------------------------------------------------------------------------------------------------------
# Prompts


def resolve_chat_template(value) -> str | None:
    """The ``chat_template`` model arg: ``None`` (raw prompts, ``none``), ``DEFAULT_TEMPLATE`` (unset, ``default``:
    the processor's template) or the Jinja text of a template file (any other value is its path)."""
    text = "" if value is None else str(value).strip()
    if text.lower() in ("", DEFAULT_TEMPLATE, "processor"):
        return DEFAULT_TEMPLATE
    if text.lower() in _RAW:
        return None
    path = Path(text).expanduser()
    if not path.is_file():
        raise ValueError(f"conceptmoe: chat_template={text!r} is neither default / none nor a Jinja template file")
    return path.read_text(encoding="utf-8")


def chat_prompt(processor, context: str, template: str | None) -> str:
    """The task context as the prompt the model sees: as it is (``template`` None), or as one user message
    ``{"role": "user", "content": context}`` through ``processor.apply_chat_template`` with the generation prompt
    (the assistant header) appended: the processor's own ``chat_template`` for ``DEFAULT_TEMPLATE``, else
    ``template`` (a Jinja string)."""
    if template is None:
        return context
    messages = [{"role": "user", "content": context}]
    chosen = {} if template == DEFAULT_TEMPLATE else {"chat_template": template}
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **chosen)


def chat_stops(template: str | None) -> list[str]:
    """Stop strings of chat prompts: the end-of-turn token (none for raw prompts)."""
    return [] if template is None else [END_OF_TURN]


@dataclass
class GenSettings:
    """A task's ``generation_kwargs`` as the plugin reads them."""

    until: list[str]
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float | None = None
    image_max_patches: int | None = None  # a task's hint (long documents); ``max_patches`` in model_args wins
    stop_token_ids: list[int] = field(default_factory=list)  # generation ends at any of them (EOS, <|end|>)

    @classmethod
    def from_kwargs(cls, kwargs: dict | None, processor, extra_stops: tuple[str, ...] | list[str] = ()) -> GenSettings:
        """Read until (str or list), max_new_tokens, temperature, top_p, image_max_patches; ignore the rest.
        EOS and ``extra_stops`` (e.g. the chat template's end of turn) join ``until``; those of them that are one
        token of the tokenizer also end generation as token ids."""
        kwargs = dict(kwargs or {})
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        tok = processor.tokenizer
        stop_ids = []
        for stop in (tok.eos_token, *extra_stops):
            if not stop:
                continue
            if stop not in until:
                until.append(stop)
            ids = tok(stop, add_special_tokens=False)["input_ids"]
            if len(ids) == 1 and ids[0] not in stop_ids:
                stop_ids.append(ids[0])
        budget = kwargs.get("image_max_patches")
        return cls(
            until=until,
            max_new_tokens=int(kwargs.get("max_new_tokens") or 64),
            temperature=float(kwargs.get("temperature") or 0.0),
            top_p=None if kwargs.get("top_p") is None else float(kwargs["top_p"]),
            image_max_patches=None if budget is None else int(budget),
            stop_token_ids=stop_ids,
        )


def apply_chunking_overrides(
    model, chunking=None, target_r=None, noise_tau=None, modality_boundaries=None, image_chunking=None
) -> None:
    """Eval-time chunking for studies: ``fixed`` + ``target_r`` forces R; ``noise_tau``; ``modality_boundaries``;
    ``image_chunking`` (through ``ConceptMoEVLM.set_chunking``; errors name the setting)."""
    settings = dict(chunking=chunking, target_r=target_r, noise_tau=noise_tau)
    try:
        model.set_chunking(modality_boundaries, image_chunking, **{k: v for k, v in settings.items() if v is not None})
    except ValueError as err:
        raise ValueError(f"conceptmoe: {err}") from None
    cfg = model.config.text_config
    logger.info(
        "conceptmoe: chunking=%s target_r=%s noise_tau=%s image_chunking=%s",
        cfg.chunking,
        cfg.target_r,
        cfg.noise_tau,
        model.config.image_chunking,
    )


@contextlib.contextmanager
def image_budget(processor, max_patches: int | None):
    """Temporarily set the image processor's patch budget."""
    ip = processor.image_processor
    saved = ip.max_patches
    if max_patches is not None:
        ip.max_patches = max(int(max_patches), ip.pixel_shuffle**2)
    try:
        yield
    finally:
        ip.max_patches = saved


@contextlib.contextmanager
def capture_boundaries(model):
    """Collect the boundary mask ``b_BN`` of every backbone forward (None entries: no chunking)."""
    seen: list = []

    def hook(_module, _args, output):
        chunk = getattr(output, "chunk", None)
        seen.append(None if chunk is None else chunk.b_BN.detach())

    handle = model.language_model.model.register_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def row_stats(b_BN: torch.Tensor | None, attention_mask: torch.Tensor, modality_ids: torch.Tensor) -> list[dict]:
    """Per row: tokens / concepts in total and per modality, R = tokens / max(concepts, 1) (as
    ``vlm.backbone.outputs.chunk_statistics``: a concept belongs to the modality of its boundary token)."""
    valid = attention_mask.bool()
    b = valid if b_BN is None else b_BN.bool() & valid
    out = []
    for i in range(valid.shape[0]):
        tokens, concepts = int(valid[i].sum()), int(b[i].sum())
        row = {"tokens": tokens, "concepts": concepts, "r": tokens / max(concepts, 1)}
        row["tokens_by_modality"], row["concepts_by_modality"] = {}, {}
        for m, name in ((Modality.TEXT, "text"), (Modality.IMAGE, "image")):
            in_m = valid[i] & (modality_ids[i] == m)
            t_m, c_m = int(in_m.sum()), int((b[i] & in_m).sum())
            row["tokens_by_modality"][str(m)], row["concepts_by_modality"][str(m)] = t_m, c_m
            row[f"r_{name}"] = t_m / max(c_m, 1) if t_m else None
        out.append(row)
    return out


def _to_device(batch, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _model_inputs(batch) -> dict:
    """What ``ConceptMoEVLM.forward`` / ``generate`` take from a processor batch (``num_tokens`` is bookkeeping)."""
    return {k: v for k, v in batch.items() if k != "num_tokens"}


def cut_at_stop(text: str, until: list[str]) -> str:
    """The text before the first occurrence of any stop string."""
    for stop in until:
        if stop and stop in text:
            text = text[: text.index(stop)]
    return text


def generate_batch(model, processor, batch: list[dict], settings: GenSettings, max_patches, device):
    """(answers, per-row stats) of one batch of prompts; prompts left-padded as generation requires."""
    with image_budget(processor, max_patches):
        inputs = processor(
            text=[it["prompt"] for it in batch], images=[it["images"] for it in batch], padding_side="left"
        )
    inputs = _to_device(inputs, device)
    tok = processor.tokenizer
    eos_id, pad_id = settings.stop_token_ids or tok.eos_token_id, processor.pad_token_id
    kwargs = {"max_new_tokens": settings.max_new_tokens, "do_sample": settings.temperature > 0}
    if settings.temperature > 0:
        kwargs |= {"temperature": settings.temperature, "top_p": settings.top_p}
    with torch.no_grad(), capture_boundaries(model) as seen:  # seen[0]: the prefill, i.e. the prompt's boundaries
        out = model.generate(**_model_inputs(inputs), **kwargs, eos_token_id=eos_id, pad_token_id=pad_id)
    stats = row_stats(seen[0] if seen else None, inputs["attention_mask"], inputs["modality_ids"])
    new = out[:, inputs["input_ids"].shape[1] :]
    texts = tok.batch_decode(new.tolist(), skip_special_tokens=True)
    return [cut_at_stop(t, settings.until).strip() for t in texts], stats


@torch.no_grad()
def loglikelihood_batch(model, processor, batch: list[dict], max_patches, device):
    """Per item (sum log p(continuation tokens | context), greedy?) and per-row stats of the full forward.

    Context and continuation are tokenised apart (no merge across the seam); an empty context starts from EOS.
    """
    tok = processor.tokenizer
    with image_budget(processor, max_patches):
        enc = processor(
            text=[it["prompt"] for it in batch], images=[it["images"] for it in batch], padding_side="right"
        )
    n_suffix = len(processor.suffix_ids)
    rows, spans = [], []
    for i, it in enumerate(batch):
        n = int(enc["attention_mask"][i].sum())
        ctx = enc["input_ids"][i, : n - n_suffix].tolist()
        mods = enc["modality_ids"][i, : n - n_suffix].tolist()
        if not ctx:
            ctx, mods = [tok.eos_token_id if tok.eos_token_id is not None else processor.pad_token_id], [Modality.TEXT]
        cont = tok(it["continuation"], add_special_tokens=False)["input_ids"]
        rows.append((ctx + cont, mods + [Modality.TEXT] * len(cont)))
        spans.append((len(ctx), len(cont)))
    width = max(len(r[0]) for r in rows)
    ids = torch.full((len(rows), width), processor.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    modality = torch.zeros_like(ids)
    for i, (row_ids, row_mods) in enumerate(rows):
        ids[i, : len(row_ids)] = torch.tensor(row_ids)
        mask[i, : len(row_ids)] = 1
        modality[i, : len(row_ids)] = torch.tensor(row_mods)
    inputs = _model_inputs(enc) | {"input_ids": ids, "attention_mask": mask, "modality_ids": modality}
    inputs = _to_device(inputs, device)
    with capture_boundaries(model) as seen:
        logits = model(**inputs).logits.float()
    logprobs = torch.log_softmax(logits, -1)
    scores = []
    for i, (start, length) in enumerate(spans):
        if length == 0:
            scores.append((0.0, True))
            continue
        target = inputs["input_ids"][i, start : start + length]
        lp = logprobs[i, start - 1 : start - 1 + length]
        total = float(lp.gather(-1, target[:, None]).sum())
        scores.append((total, bool((lp.argmax(-1) == target).all())))
    stats = row_stats(seen[0] if seen else None, inputs["attention_mask"], inputs["modality_ids"])
    return scores, stats
