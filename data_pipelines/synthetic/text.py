"""Text: plain documents of the local text corpus (standard-library docstrings, ``local_text.py``), one per sample.

Train and eval come from the corpus's own hash split, so they never share a document. The order is a seeded
shuffle of the split; there are only as many samples as documents in the split (about 2,350 train and 50 eval
with CPython 3.11): asking for more yields them all and logs a warning, never a duplicate.
``meta = {"kind": "text", "source": "stdlib-docstrings", "doc_index": k}`` (k: index in the corpus split).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator

from data_pipelines.schema import Sample, Segment
from data_pipelines.synthetic._common import check_split, sample_key

logger = logging.getLogger(__name__)


def generate(n: int, seed: int, split: str = "train", min_chars: int = 200) -> Iterator[Sample]:
    """Up to ``n`` corpus documents of ``split`` in a seeded order."""
    check_split(split)
    from data_pipelines.local_text import load_local_text_corpus  # imports torch: only when used

    docs = load_local_text_corpus(min_chars=min_chars)[split]
    order = list(range(len(docs)))
    random.Random(f"text/{seed}/{split}").shuffle(order)
    if n > len(order):
        logger.warning("text: %d %s samples asked, the corpus split has %d documents", n, split, len(order))
    for i, k in enumerate(order[:n]):
        meta = {"kind": "text", "source": "stdlib-docstrings", "doc_index": k}
        yield Sample(key=sample_key("text", seed, split, i), segments=[Segment(text=docs[k])], meta=meta)
