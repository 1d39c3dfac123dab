"""Instruction data in the evaluation tasks' language: conversations built on the base generators' samples.

- ``scenes_chat``: per scene, one conversation per ``qa`` item: the count / colour / shape / position questions as
  ``cmoe_sceneqa`` asks them (:func:`data_pipelines.prompts.sceneqa`), the box item as ``cmoe_refloc`` asks it
  (:func:`data_pipelines.prompts.refloc`) about the same object, named by a referring expression drawn like the
  task's (:func:`data_pipelines.synthetic.scenes.referring_expression`: "red square", "circle", "blue object",
  "small star", "triangle at the top left");
- ``documents_chat``: the code-word question of each document (``cmoe_longdoc``, ``prompts.longdoc``);
- ``needles_chat``: the needle question of each haystack (``cmoe_niah``, ``prompts.niah``);
- ``copying_chat``: the copy request of each ``copying`` sample (``prompts.copy``; no eval task: a stage that teaches
  the copy a needle answer needs).

Each sample is a conversation (``Sample.turns``, empty ``segments``): a user turn, the builder's text split at
``<image>`` into text segments and the base sample's images in order, then an assistant turn with the answer
exactly as the base ``qa`` item gives it. ``meta``: ``kind`` (the kind above), ``task`` (sceneqa / refloc /
longdoc / niah), ``type`` (the qa type), ``source`` (the base sample's key), ``index`` (the base sample's index),
``question``, ``objects`` (the scene's number of objects) and ``regions`` (the image's objects as grounded phrases,
``[{"box": [x0, y0, x1, y1], "text": "small red square top left"}]``, the schema's field that
``data_pipelines.schema.sample_regions`` reads) for sceneqa and refloc, and ``expression`` for refloc; ``qa``: the
one item asked.

Sample ``j`` of ``generate(n, seed, split)`` is the ``j``-th conversation of the base stream
``<base>.generate(..., seed, split)``, so it depends only on (kind, seed, split, j) and the first ``k`` of
``generate(n)`` are ``generate(k)``; train and eval are the base generators' splits, as disjoint as they are.
Keys: ``<kind>-<split>-s<seed>-<base index>-<k>`` (``k``: the conversation's place among its base sample's).
Options (``min_pages``, ``max_units``, ...) go to the base generator, except ``turns``: ``"one"`` (the default)
makes one conversation per item as above; ``"all"`` makes one multi-turn conversation per base sample, every item
asked in turn in a seeded order, the images in the first user turn only (as LLaVA's instruction data asks several
questions about one image): one image encoding for several answers. Its key ends in ``-all``, its ``meta`` holds
``type`` ``"multi"`` and ``types`` (each turn's), and its ``qa`` every item asked, in the order asked.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

from data_pipelines import prompts
from data_pipelines.schema import Sample, Segment, Turn, sample_regions
from data_pipelines.synthetic import copying, documents, needles, scenes
from data_pipelines.synthetic._common import check_split, sample_key, sample_rng

# (user text, answer, the qa item asked, extra meta) of one conversation
Item = tuple[str, str, dict, dict]


def scene_items(base: Sample, seed: int, split: str, index: int) -> list[Item]:
    """The conversations of one scene: sceneqa for the count / colour / shape / position items, refloc for the box
    item (its expression drawn from the stream of (``scenes_chat``, seed, split, index))."""
    objects = base.meta["objects"]
    regions = [{"box": box, "text": text} for box, text in sample_regions(base.meta)]
    out = []
    for qa in base.qa:
        if qa["type"] in prompts.SCENEQA_TYPES:
            meta = {"task": "sceneqa", "question": qa["q"], "objects": len(objects), "regions": regions}
            out.append((prompts.sceneqa(qa["q"]), qa["a"], dict(qa), meta))
        elif qa["type"] == "box":
            target = next(o for o in objects if o["box"] == qa["box"])
            rng = sample_rng("scenes_chat", seed, split, index)
            expression, how = scenes.referring_expression(rng, target, objects)
            question = prompts.refloc_question(expression)
            item = {"type": "box", "q": question, "a": qa["a"], "box": qa["box"]}
            meta = {
                "task": "refloc",
                "question": question,
                "expression": expression,
                "expression_kind": how,
                "objects": len(objects),
                "regions": regions,
            }
            out.append((prompts.refloc(expression), qa["a"], item, meta))
    return out


def document_items(base: Sample, seed: int, split: str, index: int) -> list[Item]:
    """The code-word question of one document."""
    (qa,) = base.qa
    return [
        (prompts.longdoc(base.meta["num_pages"], qa["q"]), qa["a"], dict(qa), {"task": "longdoc", "question": qa["q"]})
    ]


def needle_items(base: Sample, seed: int, split: str, index: int) -> list[Item]:
    """The needle question of one haystack (its context: every segment but the last, the question), asking for the
    needle sentence restated (as ``cmoe_niah`` asks) or, for a haystack made with ``answer="value"``, the value."""
    (qa,) = base.qa
    context = [seg.text if seg.image is None else None for seg in base.segments[:-1]]
    value = base.meta.get("answer") == "value"
    instruction = prompts.NIAH_VALUE_INSTRUCTION if value else prompts.NIAH_INSTRUCTION
    return [(prompts.niah(context, qa["q"], instruction), qa["a"], dict(qa), {"task": "niah", "question": qa["q"]})]


def copy_items(base: Sample, seed: int, split: str, index: int) -> list[Item]:
    """The copy request of one copying sample (its lines, then the request)."""
    (qa,) = base.qa
    return [(prompts.copy(base.segments[0].text, qa["q"]), qa["a"], dict(qa), {"task": "copy", "question": qa["q"]})]


# kind -> (base generator, the conversations of one base sample)
KINDS: dict[str, tuple[Callable[..., Iterator[Sample]], Callable[..., list[Item]]]] = {
    "scenes_chat": (scenes.generate, scene_items),
    "documents_chat": (documents.generate, document_items),
    "needles_chat": (needles.generate, needle_items),
    "copying_chat": (copying.generate, copy_items),
}


TURNS = ("one", "all")  # the ``turns`` option: one conversation per item, or all items in one conversation


def conversations(kind: str, base: Sample, seed: int, split: str, index: int) -> list[Sample]:
    """Every conversation ``kind`` makes of the base sample ``index`` of (seed, split), one per item."""
    _, items = KINDS[kind]
    images = [seg for seg in base.segments if seg.image is not None]
    out = []
    for k, (text, answer, qa, extra) in enumerate(items(base, seed, split, index)):
        turns = [Turn("user", prompts.segments(text, images)), Turn("assistant", [Segment(text=answer)])]
        meta = {"kind": kind, **extra, "type": qa["type"], "source": base.key, "index": index}
        key = f"{sample_key(kind, seed, split, index)}-{k}"
        out.append(Sample(key=key, segments=[], meta=meta, qa=[qa], turns=turns))
    return out


def multi_turn(kind: str, base: Sample, seed: int, split: str, index: int) -> list[Sample]:
    """The items of base sample ``index`` as one conversation (``turns="all"``), or none when it has no item."""
    singles = conversations(kind, base, seed, split, index)
    if not singles:
        return []
    sample_rng(f"{kind}-turns", seed, split, index).shuffle(singles)
    turns = list(singles[0].turns)
    for single in singles[1:]:  # later questions without the images: the text of their user turn, marker removed
        text = "".join(seg.text for seg in single.turns[0].segments if seg.image is None).lstrip("\n")
        turns += [Turn("user", [Segment(text=text)]), single.turns[1]]
    meta = {**singles[0].meta, "type": "multi", "types": [c.meta["type"] for c in singles]}
    key = f"{sample_key(kind, seed, split, index)}-all"
    return [Sample(key=key, segments=[], meta=meta, qa=[c.qa[0] for c in singles], turns=turns)]


def generate(kind: str, n: int, seed: int, split: str = "train", turns: str = "one", **options) -> Iterator[Sample]:
    """The first ``n`` conversations of ``kind`` (``turns``: see the module docstring)."""
    check_split(split)
    if turns not in TURNS:
        raise ValueError(f"turns must be one of {TURNS}, got {turns!r}")
    build = conversations if turns == "one" else multi_turn
    base_generate, _ = KINDS[kind]
    if n <= 0:
        return
    made = 0
    # Every base sample gives at least one conversation unless ``types`` filters its items, so n base samples
    # suffice; with a filter the (lazy) base stream runs until n are made.
    count = n if options.get("types") is None else sys.maxsize
    for index, base in enumerate(base_generate(count, seed, split, **options)):
        for sample in build(kind, base, seed, split, index):
            yield sample
            made += 1
            if made == n:
                return


def generator(kind: str) -> Callable[..., Iterator[Sample]]:
    """``generate`` bound to ``kind``, with the signature of the registry's generators."""

    def bound(n: int, seed: int, split: str = "train", **options) -> Iterator[Sample]:
        return generate(kind, n, seed, split, **options)

    bound.__name__ = bound.__qualname__ = f"generate_{kind}"
    bound.__doc__ = f"``n`` {kind} conversations, deterministic from (seed, split); see {__name__}."
    return bound
