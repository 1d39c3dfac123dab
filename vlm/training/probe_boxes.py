"""Box answers in the seeing probe: the model's own greedy answer, and whether the box it names hits the object.

A box question ("Where is the red square? Answer with the bounding box [x1, y1, x2, y2] ...", the ``box`` item of
``scenes_chat``, what ``cmoe_refloc`` asks) is not scored by exact match: its answer is 17 tokens, and the task
counts a box right when its intersection over union with the true box is at least 0.5 (ACC@0.5). The probe scores
it the same way, on greedy decoding (each token chosen from the model's own earlier ones, not teacher-forced), and
reports as its chance the hit rate of the mean of the held-out boxes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

_BOX = re.compile(r"\[\s*(-?\d*\.?\d+)\s*,\s*(-?\d*\.?\d+)\s*,\s*(-?\d*\.?\d+)\s*,\s*(-?\d*\.?\d+)\s*\]")
HIT_IOU = 0.5  # cmoe_refloc's ACC@0.5
TOKEN_KEYS = ("input_ids", "attention_mask", "modality_ids")  # the processor's per-token tensors


def read_box(text: str) -> list[float] | None:
    """The first ``[a, b, c, d]`` of numbers in ``text``; None when there is none."""
    match = _BOX.search(text)
    return [float(g) for g in match.groups()] if match else None


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two ``[x1, y1, x2, y2]`` boxes (0 when the union is empty)."""
    inter = max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    area = lambda box: max(0.0, box[2] - box[0]) * max(0.0, box[3] - box[1])  # noqa: E731
    union = area(a) + area(b) - inter
    return inter / union if union > 0 else 0.0


def box_hit(text: str, truth: Sequence[float]) -> bool:
    """Whether the first box in ``text`` overlaps ``truth`` at IoU >= ``HIT_IOU`` (no box: a miss)."""
    box = read_box(text)
    return box is not None and box_iou(box, truth) >= HIT_IOU


def mean_box_chance(truths: list[Sequence[float]]) -> float:
    """The hit rate of one constant answer, the mean box, on ``truths``: the blind model's box."""
    mean = [sum(t[i] for t in truths) / len(truths) for i in range(4)]
    return sum(box_iou(mean, t) >= HIT_IOU for t in truths) / len(truths)


@torch.no_grad()
def greedy_tails(model, batch: dict, starts: Sequence[int], length: int, pad_id: int) -> torch.Tensor:
    """Each row ``r`` of ``batch`` continued greedily for ``length`` tokens from position ``starts[r]`` (the first
    answer token: what lies there and after is replaced; the rows grow by text columns where they are too short);
    returns the tokens, (B, length). The positions after a row's current end are padding, masked out, and the model
    is causal, so they never change the logits read."""
    start_B = torch.as_tensor(starts)
    grow = max(0, int(start_B.max()) + length - batch["input_ids"].shape[1])  # text columns (modality 0) to add
    ids, mask, modality = (torch.nn.functional.pad(batch[k], (0, grow)) for k in TOKEN_KEYS)
    batch = {**batch, "modality_ids": modality}
    tail_BT = torch.arange(ids.shape[1])[None] >= start_B[:, None]
    ids[tail_BT], mask[tail_BT] = pad_id, 0
    rows, out = torch.arange(len(start_B)), []
    for t in range(length):
        logits = model(**{**batch, "input_ids": ids, "attention_mask": mask}).logits
        token_B = logits[rows, start_B + t - 1].argmax(-1)
        ids[rows, start_B + t], mask[rows, start_B + t] = token_B, 1
        out.append(token_B)
    return torch.stack(out, 1)
