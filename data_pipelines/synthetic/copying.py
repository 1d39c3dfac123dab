"""Copying: lines of random words, then a request to repeat the line that starts with a given word.

A needle's answer (``cmoe_niah``) and a long document's code word (``cmoe_longdoc``) are copied from the context:
the answer finds where its key stood and copies what follows. A language model learns that lookup (an induction
circuit) from text that repeats itself, long before it learns it from one needle answer per sample
(docs/seeing.md, "Copying a needle"). This kind is that text, in the chat form of the tasks: ``copying_chat``
(``conversations``) asks for one line back, with the loss on the answer only, so it mixes with the tasks'
conversations without outweighing them.

Each sample is ``[lines, request]``: ``min_lines..max_lines`` lines of ``min_words..max_words`` words, each word a
plain word of the split's side of the local corpus (half of them), a made-up code word or a 4-digit number (a quarter
each: the needles' values), every line starting with a different word; the request names the first word of one
line (``prompts.copy_request``). With one line it is a plain copy; with several, a lookup by key, then a copy.
``qa = [{"type": "copy", "q": "Repeat the line that starts with kalomi.", "a": "<that line>"}]``;
``meta = {"kind": "copying", "lines": L, "line_index": j, "words": W}`` (``W``: the words of line ``j``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

from data_pipelines import prompts
from data_pipelines.schema import Sample, Segment
from data_pipelines.synthetic._common import check_split, code_word, paragraphs, sample_key, sample_rng


@functools.lru_cache(maxsize=2)
def _corpus_words(split: str) -> tuple[str, ...]:
    """The distinct plain words (letters only) of the split's corpus paragraphs, sorted: a stable pool for the seeded
    draws."""
    return tuple(
        sorted({w for paragraph in paragraphs(split) for w in paragraph.split() if w.isalpha() and w.isascii()})
    )


def _word(rng, pool: tuple[str, ...]) -> str:
    draw = rng.random()
    if draw < 0.5:
        return rng.choice(pool)
    return code_word(rng) if draw < 0.75 else str(rng.randint(1000, 9999))


def generate(
    n: int,
    seed: int,
    split: str = "train",
    min_lines: int = 1,
    max_lines: int = 6,
    min_words: int = 4,
    max_words: int = 8,
) -> Iterator[Sample]:
    """``n`` copying samples, deterministic from (seed, split); train and eval draw their corpus words from the
    corpus's two sides."""
    check_split(split)
    if not 1 <= min_lines <= max_lines:
        raise ValueError(f"need 1 <= min_lines <= max_lines, got min_lines={min_lines}, max_lines={max_lines}")
    if not 1 <= min_words <= max_words:
        raise ValueError(f"need 1 <= min_words <= max_words, got min_words={min_words}, max_words={max_words}")
    pool = _corpus_words(split)
    for i in range(n):
        rng = sample_rng("copying", seed, split, i)
        count = rng.randint(min_lines, max_lines)
        lines: list[str] = []
        firsts: set[str] = set()
        while len(lines) < count:
            words = [_word(rng, pool) for _ in range(rng.randint(min_words, max_words))]
            if words[0] in firsts:
                continue
            firsts.add(words[0])
            lines.append(" ".join(words))
        j = rng.randrange(len(lines))
        request = prompts.copy_request(lines[j].split()[0])
        meta = {"kind": "copying", "lines": len(lines), "line_index": j, "words": len(lines[j].split())}
        qa = [{"type": "copy", "q": request, "a": lines[j]}]
        segments = [Segment(text="\n".join(lines)), Segment(text=request)]
        yield Sample(key=sample_key("copying", seed, split, i), segments=segments, meta=meta, qa=qa)
