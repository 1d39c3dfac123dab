"""Synthetic corpora, deterministic from (seed, split), train and eval disjoint, the same generators used for
evaluation data:

- ``scenes``: shapes on canvases, caption, QA and boxes (localization);
- ``documents``: multi-page rendered text with a question answered by a span on one page (long-document QA);
- ``needles``: needle in an interleaved text / image haystack at a chosen depth (retrieval);
- ``text``: documents of the local text corpus (language modelling);
- ``copying``: lines of random words and a request to repeat one of them (the copy a needle answer needs);
- ``scenes_chat``, ``documents_chat``, ``needles_chat``: instruction conversations on those samples, asked and
  answered exactly as the eval tasks do (``conversations``; prompts from ``data_pipelines.prompts``);
  ``copying_chat`` the copy request as a conversation.

Each module exposes ``generate(n, seed, split, **options) -> Iterator[Sample]``; sample ``i`` depends only on
(kind, seed, split, i, options), and every sample's ``meta["kind"]`` names its generator. Options change what a
kind draws (``scenes``: ``max_objects``, ``object_size`` for a curriculum of large, single objects; ``needles``:
``min_units`` / ``max_units``; ...); a conversation kind takes its base kind's options.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence

from data_pipelines.schema import Sample
from data_pipelines.synthetic import conversations, copying, documents, needles, scenes, text
from data_pipelines.synthetic._common import SPLITS, check_split

GENERATORS: dict[str, Callable[..., Iterator[Sample]]] = {
    "scenes": scenes.generate,
    "documents": documents.generate,
    "needles": needles.generate,
    "text": text.generate,
    "copying": copying.generate,
    **{kind: conversations.generator(kind) for kind in conversations.KINDS},
}
__all__ = ["GENERATORS", "SPLITS", "generate", "interleave", "kind_options"]


def kind_options(kind: str) -> tuple[str, ...]:
    """The options ``kind``'s generator takes (a conversation kind: its base kind's, and ``turns``)."""
    base = conversations.KINDS[kind][0] if kind in conversations.KINDS else GENERATORS[kind]
    params = inspect.signature(base).parameters.values()
    own = ("turns",) if kind in conversations.KINDS else ()  # how a conversation kind groups its items
    return tuple(p.name for p in params if p.default is not inspect.Parameter.empty and p.name != "split") + own


def generate(kind: str, n: int, seed: int, split: str = "train", **options) -> Iterator[Sample]:
    if kind not in GENERATORS:
        raise ValueError(f"unknown synthetic kind {kind!r}; choose from {sorted(GENERATORS)}")
    check_split(split)  # here too: the generators are lazy and would only raise on the first next()
    return GENERATORS[kind](n, seed, split, **options)


def interleave(
    kinds: Sequence[str], n: int, seed: int, split: str = "train", options: Mapping[str, object] | None = None
) -> Iterator[Sample]:
    """``n`` samples of each kind, round-robin (scenes 0, documents 0, ..., scenes 1, ...), so every shard mixes
    the kinds; a kind that runs out (``text`` has a finite corpus) drops out of the rotation. Each of ``options``
    goes to the kinds that take it (:func:`kind_options`); one that no kind takes is a ``ValueError``."""
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"kinds must not repeat, got {list(kinds)}")
    options = dict(options or {})
    taken = {kind: {k: v for k, v in options.items() if k in kind_options(kind)} for kind in kinds}
    if unused := sorted(set(options) - {k for per_kind in taken.values() for k in per_kind}):
        accepted = sorted({o for kind in kinds for o in kind_options(kind)})
        raise ValueError(f"option(s) {', '.join(unused)} taken by none of {list(kinds)}; they take {accepted}")
    return _round_robin([generate(kind, n, seed, split, **taken[kind]) for kind in kinds])


def _round_robin(streams: list[Iterator[Sample]]) -> Iterator[Sample]:
    while streams:
        alive = []
        for stream in streams:
            sample = next(stream, None)
            if sample is not None:
                yield sample
                alive.append(stream)
        streams = alive
