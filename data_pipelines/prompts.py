"""The evaluation tasks' prompts and answers, one builder per task, shared by the eval tasks and the training data.

The lmms-eval tasks' ``doc_to_text`` (``eval/tasks/common.py``) and the synthetic instruction data
(``data_pipelines/synthetic/chat.py``) both call these functions, so a model trained on the conversations sees
exactly the user turns the tasks send. Each builder returns the *user-turn text*: one ``<image>`` marker
(``IMAGE_TOKEN``) per image, in the order of the images, and the task's answer instruction at the end (what used
to be the YAMLs' ``post_prompt``; the YAMLs' ``pre_prompt`` / ``post_prompt`` are now empty extra affixes).

    task         user turn                                                           answer
    sceneqa      <image>\\nQUESTION\\nAnswer the question using a single word or phrase.   "3", "red", "top left"
    refloc       <image>\\nWhere is the EXPRESSION?\\nAnswer with the bounding box ...     "[0.12, 0.34, 0.56, 0.78]"
    longdoc      <image>\\n per page, QUESTION\\nAnswer with the code word only.           "kalomi"
    niah         segments one per line (<image> for images)\\nQUESTION\\nAnswer with the sentence that gives the value.
                                                                      "The secret number of Mila is 4821."

Answers are the generators' own (``scenes.questions``: lowercase words, digits for counts; boxes through
:func:`format_box`, 2 decimals, which ``eval.metrics.parse_box`` reads).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from data_pipelines.schema import Segment
from data_pipelines.tokenizer import IMAGE_TOKEN

SCENEQA_TYPES = ("count", "colour", "shape", "position")  # the scenes question types of cmoe_sceneqa
SCENEQA_INSTRUCTION = "Answer the question using a single word or phrase."
REFLOC_INSTRUCTION = "Answer with the bounding box [x1, y1, x2, y2], coordinates normalised to 0-1."
LONGDOC_INSTRUCTION = "Answer with the code word only."
# The niah task asks for the needle sentence restated (the value last; scored on the value: eval.metrics.needle_found):
# the answer reaches the value by copying, as RULER's prompts end in an answer prefix that repeats the key. Asked for
# the value alone, no model trained here found a needle (docs/seeing.md, "Copying a needle").
NIAH_INSTRUCTION = "Answer with the sentence that gives the value."
NIAH_VALUE_INSTRUCTION = "Answer with the value only."  # needles made with answer="value"
COPY_REQUEST = "Repeat the line that starts with {word}."  # copying_chat: text only, no eval task
BOX_DECIMALS = 2


# ----------------------------------------------------------------------------------------------------------------
# User turns


def sceneqa(question: str) -> str:
    """One scene, a count / colour / shape / position question about it."""
    return f"{IMAGE_TOKEN}\n{question}\n{SCENEQA_INSTRUCTION}"


def refloc_question(expression: str) -> str:
    """The box question about a referring expression (also the ``q`` of the scenes ``box`` items)."""
    return f"Where is the {expression}?"


def refloc(expression: str) -> str:
    """One scene, the box question about the object the expression names."""
    return f"{IMAGE_TOKEN}\n{refloc_question(expression)}\n{REFLOC_INSTRUCTION}"


def longdoc(num_pages: int, question: str) -> str:
    """One ``<image>`` per page (one per line), then the question."""
    return f"{IMAGE_TOKEN}\n" * num_pages + f"{question}\n{LONGDOC_INSTRUCTION}"


def niah(context: Sequence[str | None], question: str, instruction: str = NIAH_INSTRUCTION) -> str:
    """The haystack, one segment per line (``None`` stands for an image: ``<image>``), then the question and the
    instruction (``NIAH_VALUE_INSTRUCTION`` for needles answered by their value alone)."""
    lines = [IMAGE_TOKEN if text is None else text for text in context]
    return "\n".join([*lines, question, instruction])


def copy_request(word: str) -> str:
    """The request of a copying sample (``data_pipelines.synthetic.copying``): repeat the line that starts with
    ``word``."""
    return COPY_REQUEST.format(word=word)


def copy(lines: str, request: str) -> str:
    """Lines of words (one string, newline-separated), then the request for one of them."""
    return f"{lines}\n{request}"


# ----------------------------------------------------------------------------------------------------------------
# Answers


def format_box(box: Sequence[float]) -> str:
    """``[x1, y1, x2, y2]`` with ``BOX_DECIMALS`` decimals: the answer text of every box question."""
    if len(box) != 4:
        raise ValueError(f"a box has 4 coordinates, got {list(box)}")
    return "[" + ", ".join(f"{v:.{BOX_DECIMALS}f}" for v in box) + "]"


_NUMBER = r"\s*(-?\d+(?:\.\d+)?|-?\.\d+)\s*"
_BOX = re.compile(r"\[" + ",".join([_NUMBER] * 4) + r"\]")


def read_box(text: str) -> list[float] | None:
    """The first ``[a, b, c, d]`` of numbers in ``text`` (what :func:`format_box` writes); None when there is none."""
    match = _BOX.search(str(text))
    return [float(g) for g in match.groups()] if match else None


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two ``[x1, y1, x2, y2]`` boxes; 0 when the union is empty."""
    inter_w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    inter_h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = inter_w * inter_h
    area = lambda box: max(0.0, box[2] - box[0]) * max(0.0, box[3] - box[1])  # noqa: E731
    union = area(a) + area(b) - inter
    return inter / union if union > 0 else 0.0


# ----------------------------------------------------------------------------------------------------------------
# Turn segments


def segments(text: str, images: Sequence[Segment]) -> list[Segment]:
    """A builder's text as turn segments: the text split at ``<image>``, the i-th marker replaced by ``images[i]``
    (image segments, in order); empty text pieces are dropped, so ``data_pipelines.chat.turn_text`` of the result
    is ``text`` again."""
    pieces = text.split(IMAGE_TOKEN)
    if len(pieces) - 1 != len(images):
        raise ValueError(f"the text has {len(pieces) - 1} {IMAGE_TOKEN} markers but {len(images)} images are given")
    out: list[Segment] = []
    for i, piece in enumerate(pieces):
        if piece:
            out.append(Segment(text=piece))
        if i < len(images):
            if images[i].image is None:
                raise ValueError(f"images[{i}] is not an image segment")
            out.append(images[i])
    return out
