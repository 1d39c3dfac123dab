"""Box answers in the seeing probe: the model's own greedy answer, and whether the box it names hits the object.

A box question ("Where is the red square? Answer with the bounding box [x1, y1, x2, y2] ...", the ``box`` item of
``scenes_chat``, what ``cmoe_refloc`` asks) is not scored by exact match: its answer is 17 tokens, and the task
counts a box right when its intersection over union with the true box is at least 0.5 (ACC@0.5). The probe scores
it the same way, on greedy decoding (each token chosen from the model's own earlier ones, not teacher-forced), and
reports as its chance the hit rate of the mean of the held-out boxes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from data_pipelines.prompts import box_iou, read_box

HIT_IOU = 0.5  # cmoe_refloc's ACC@0.5
TOKEN_KEYS = ("input_ids", "attention_mask", "modality_ids")  # the processor's per-token tensors


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
