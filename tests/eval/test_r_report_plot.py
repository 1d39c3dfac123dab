"""The training panel of the R report (eval/r_report_plot.py): a log R axis set by the post-warmup values, not by the
untrained router's first-step spike, and the held-out eval R the trainer logs drawn as markers per modality."""

import math

import pytest
import torch
from PIL import Image

from eval.r_report import load_records, summarize
from eval.r_report_plot import EVAL_MARKER, agg_figure, plot_training, r_axis
from vlm import ConceptMoEVLM, VLMProcessor
from vlm.training.metrics import LOSS_KEYS, MetricsWriter, StepStats, step_record
from vlm.training.step import evaluate

# 20 steps of (text tokens, text concepts, image tokens, image concepts): step 1 has image R 75 (one image concept),
# afterwards total R ~2, text R ~1.6, image R ~5
COUNTS = [(160, 100, 75, 1)] + [(160 + s % 3, 100, 60, 12 + s % 2) for s in range(2, 21)]


def _points(counts):
    pts = {"r": [], "r_text": [], "r_image": []}
    for step, (tt, ct, ti, ci) in enumerate(counts, start=1):
        pts["r"].append((step, (tt + ti) / (ct + ci)))
        pts["r_text"].append((step, tt / ct))
        pts["r_image"].append((step, ti / ci))
    return pts


def test_r_axis_is_set_after_warmup_and_notes_the_spike():
    axis = r_axis(_points(COUNTS), always=[2.0])
    assert axis.warmup_steps == 2  # 10% of 20 steps
    assert axis.low < 160 / 100 and 61 / 12 < axis.high < 8  # every post-warmup value, not the spike of 75
    assert axis.off_axis[0] == ("r_image", 1, 75.0)
    assert all(step <= axis.warmup_steps for _, step, _ in axis.off_axis)
    # total R (~2) and text R (~1.6) stay apart: > 8% of the axis height (2% when 75 set a linear axis from 0)
    assert math.log(2.0 / 1.6) / math.log(axis.high / axis.low) > 0.08
    assert r_axis(_points(COUNTS), always=[2.0, 40.0]).high >= 40.0  # a held-out R is never off the axis
    assert r_axis({"r": [(1, 3.0)]}).low < 3.0 < r_axis({"r": [(1, 3.0)]}).high  # one step: no warmup to skip


@pytest.fixture(scope="module")
def eval_record(tiny_checkpoint):
    """What the training loop logs at an eval step: ``evaluate`` of a tiny VLM on two held-out image+text batches."""
    torch.manual_seed(0)
    model = ConceptMoEVLM.from_pretrained(tiny_checkpoint)
    processor = VLMProcessor.from_pretrained(tiny_checkpoint)
    batches = []
    for colour in ("red", "blue"):
        batch = processor(text=[f"<image>\nA {colour} square."], images=[[Image.new("RGB", (64, 64), colour)]])
        batch["labels"] = batch["input_ids"].masked_fill(batch["modality_ids"] == 1, -100)
        batches.append(batch)
    return {"step": 20, "split": "eval", **evaluate(model, iter(batches), n_batches=2)}


def test_held_out_eval_r_is_drawn_per_modality_on_the_log_axis(tmp_path, eval_record):
    writer = MetricsWriter(str(tmp_path), enabled=True, total_steps=20)
    for step, (tt, ct, ti, ci) in enumerate(COUNTS, start=1):
        stats = StepStats({k: 1.0 for k in LOSS_KEYS}, tt + ti, ct + ci, {0: tt, 1: ti}, {0: ct, 1: ci})
        writer.write(step_record(step, 1e-3, 2.0, stats, elapsed=1.0, nonfinite_total=0))
        if step in (10, 20):
            writer.write(eval_record | {"step": step})
    writer.close()
    records = load_records(tmp_path / "metrics.jsonl")
    ax = agg_figure().add_subplot()
    plot_training(ax, records, summarize(records)["train"])

    markers = [line for line in ax.lines if line.get_marker() == EVAL_MARKER and line.get_linestyle() == "None"]
    assert len(markers) == 3
    drawn = {tuple(line.get_ydata()) for line in markers}
    expected = {(eval_record[key],) * 2 for key in ("eval_r", "eval_r_text", "eval_r_image")}
    assert drawn == expected and all(list(line.get_xdata()) == [10, 20] for line in markers)
    assert ax.get_yscale() == "log"
    low, high = ax.get_ylim()
    assert high < 75.0 and all(low <= y <= high for ys in drawn for y in ys)
    assert "1 point off the axis" in ax.get_title() and "image R 75 at step 1" in ax.get_title()
