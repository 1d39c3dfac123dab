"""Box answers in the seeing probe (``vlm.training.probe_boxes``): greedy decoding and the IoU hit."""

import pytest
import torch

from data_pipelines.chat import render
from data_pipelines.prompts import box_iou, read_box
from eval import metrics
from vlm.training.probe import ProbeConfig, SeeingProbe, _pil, question_type
from vlm.training.probe_boxes import box_hit, greedy_tails, mean_box_chance


@pytest.mark.parametrize(
    "a, b, iou",
    [
        ([0.1, 0.1, 0.5, 0.5], [0.3, 0.3, 0.7, 0.7], 0.04 / 0.28),  # overlap 0.2 x 0.2 of 0.16 + 0.16 - 0.04
        ([0.0, 0.0, 1.0, 1.0], [0.25, 0.25, 0.75, 0.75], 0.25),
        ([0.1, 0.1, 0.2, 0.2], [0.5, 0.5, 0.6, 0.6], 0.0),
        ([0.5, 0.5, 0.4, 0.6], [0.5, 0.5, 0.6, 0.6], 0.0),  # an inverted box has no area
    ],
)
def test_iou_the_probe_and_the_task_share(a, b, iou):
    assert metrics.box_iou is box_iou  # the task's metric and the probe's hit are one function
    assert box_iou(a, b) == pytest.approx(iou) and box_iou(b, a) == pytest.approx(iou)


def test_a_hit_needs_a_box_overlapping_at_half():
    truth = [0.2, 0.2, 0.6, 0.6]
    assert read_box("there: [0.2, 0.25, 0.6, 0.6] and [0, 0, 1, 1]") == [0.2, 0.25, 0.6, 0.6]
    assert box_hit("[0.2, 0.25, 0.6, 0.6]", truth) and not box_hit("[0.5, 0.5, 0.9, 0.9]", truth)
    assert not box_hit("top left", truth) and read_box("top left") is None
    # the mean of two far boxes, [0.3, 0.3, 0.7, 0.7], overlaps each at IoU 1/7: no hit
    assert mean_box_chance([[0.1, 0.1, 0.5, 0.5], [0.5, 0.5, 0.9, 0.9]]) == 0.0
    # nine equal boxes and a far one: the mean, [0.25, 0.25, 0.63, 0.63], hits the nine (IoU 0.67), not the tenth
    assert mean_box_chance([truth] * 9 + [[0.7, 0.7, 0.9, 0.9]]) == pytest.approx(0.9)


def test_greedy_tails_equal_one_row_decoded_alone_token_by_token():
    """A batch of conversations of different lengths (padded), each continued from its answer's first position,
    gives the tokens each row gives alone, unpadded, fed its own argmax one token at a time."""
    probe = SeeingProbe(ProbeConfig(types=("box", "colour"), eval_n=4, seed=1))
    model = probe.model.eval()
    with torch.no_grad():  # random weights argmax flat logits: sharpen them so ties are not what is compared
        model.language_model.lm_head.weight.mul_(50.0)
    items = probe.eval_items
    assert sorted({question_type(s) for s in items}) == ["box", "colour"]
    texts = [render(s.turns) for s in items]
    images = [[_pil(seg.image) for t in s.turns for seg in t.segments if seg.image is not None] for s in items]
    batch = probe.processor(text=texts, images=images)
    ends = batch["attention_mask"].sum(1)
    starts = [int(e) - 3 for e in ends]  # the last three positions (colour: its word and <|end|>) are replaced
    tails = greedy_tails(model, batch, starts, 6, probe.processor.pad_token_id)
    assert tails.shape == (4, 6)
    for r in range(4):
        one = {k: v[r : r + 1] for k, v in batch.items()}
        ids = one["input_ids"][:, : starts[r]]
        want = []
        for _ in range(6):
            text_after = max(0, ids.shape[1] - one["modality_ids"].shape[1])  # generated past the row: text
            modality = torch.nn.functional.pad(one["modality_ids"], (0, text_after))[:, : ids.shape[1]]
            step = {**one, "input_ids": ids, "attention_mask": torch.ones_like(ids), "modality_ids": modality}
            with torch.no_grad():
                token = model(**step).logits[0, -1].argmax()
            want.append(int(token))
            ids = torch.cat([ids, token.view(1, 1)], 1)
        assert tails[r].tolist() == want, r


def test_the_probe_scores_box_questions_by_iou_beside_exact_match_ones():
    """A probe over box and colour questions scores both: the box by the IoU of its greedy answer (a random model's
    boxes miss), with the mean box's hit rate as chance, next to colour's exact match."""
    probe = SeeingProbe(ProbeConfig(types=("box", "colour"), steps=1, eval_n=12, seed=2))
    (score,) = probe.run()
    assert set(score.accuracy) == set(score.chance) == {"box", "colour"}
    boxes = [s.qa[0]["box"] for s in probe.eval_items if question_type(s) == "box"]
    assert len(boxes) == 6 and score.chance["box"] == round(mean_box_chance(boxes), 3)
    assert score.accuracy["box"] == 0.0 and score.distinct["box"] >= 1
