import math

import pytest

from eval import metrics


def test_anls_known_strings():
    assert metrics.anls("kalomi", "kalomi") == 1.0
    assert metrics.anls("  KaLoMi ", ["kalomi"]) == 1.0  # case and whitespace are normalised
    assert metrics.anls("kalomx", "kalomi") == pytest.approx(1 - 1 / 6)  # one substitution in 6 chars
    assert metrics.anls("kal", "kalomi") == pytest.approx(0.5)  # 3 deletions / 6: exactly at the threshold
    assert metrics.anls("ka", "kalomi") == 0.0  # similarity 1/3 < 0.5 -> 0
    assert metrics.anls("venri", ["zzz", "venrix"]) == pytest.approx(1 - 1 / 6)  # best reference counts
    assert metrics.anls("", "") == 1.0
    assert metrics.levenshtein("kitten", "sitting") == 3


def test_exact_match_strips_edge_punctuation_only():
    assert metrics.exact_match("Kalomi.", "kalomi") == 1.0
    assert metrics.exact_match('"kalomi"', ["x", "kalomi"]) == 1.0
    assert metrics.exact_match("kalo mi", "kalomi") == 0.0


def test_box_metrics_on_known_boxes():
    gt = [0.0, 0.0, 0.5, 0.5]
    assert metrics.box_iou(gt, gt) == 1.0
    assert metrics.box_iou(gt, [0.25, 0.0, 0.75, 0.5]) == pytest.approx(0.125 / 0.375)  # half overlap: 1/3
    assert metrics.box_iou(gt, [0.6, 0.6, 0.9, 0.9]) == 0.0
    assert metrics.box_iou([0, 0, 0, 0], [0, 0, 0, 0]) == 0.0  # empty union: 0, not a division by zero
    scores = metrics.box_scores(gt, [0.25, 0.0, 0.75, 0.5])
    assert scores["IoU"] == pytest.approx(1 / 3)
    assert [scores[f"ACC@{t}"] for t in metrics.ACC_THRESHOLDS] == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert scores["Center_ACC"] == 1.0  # centre (0.5, 0.25) on the border of gt counts
    assert metrics.box_scores(gt, [0.6, 0.6, 0.9, 0.9])["Center_ACC"] == 0.0
    assert set(scores) == set(metrics.BOX_METRICS)


def test_parse_box():
    assert metrics.parse_box("It is at [0.1, 0.2, 0.30, 0.4] I think [1, 1, 1, 1]") == [0.1, 0.2, 0.3, 0.4]
    assert metrics.parse_box("[1,0, .5, 0.25]") == [1.0, 0.0, 0.5, 0.25]
    assert metrics.parse_box("no box here") == [0.0, 0.0, 0.0, 0.0]
    assert metrics.parse_box("[0.1, 0.2, 0.3]") == [0.0, 0.0, 0.0, 0.0]


def test_needle_scoring_whole_word():
    assert metrics.needle_found("The secret number of Mila is 4821.", "4821") == 1.0
    assert metrics.needle_found("48210", "4821") == 0.0  # not a whole word
    assert metrics.needle_found("KALOMI", "kalomi") == 1.0
    assert metrics.needle_found("", "4821") == 0.0
    with pytest.raises(ValueError):
        metrics.needle_found("x", " ")


def test_buckets_and_grid():
    items = [
        {"score": 1.0, "depth": 0.0, "length": "short"},
        {"score": 0.0, "depth": 0.0, "length": "long"},
        {"score": 1.0, "depth": 0.5, "length": "short"},
    ]
    assert metrics.bucket_mean(items) == pytest.approx(2 / 3)
    assert metrics.bucket_mean(items, "depth", 0.0) == 0.5
    assert math.isnan(metrics.bucket_mean(items, "depth", 1.0))
    cells = metrics.grid(items, ("length", "depth"))
    assert cells == [
        {"length": "long", "depth": 0.0, "n": 1, "score": 0.0},
        {"length": "short", "depth": 0.0, "n": 1, "score": 1.0},
        {"length": "short", "depth": 0.5, "n": 1, "score": 1.0},
    ]


def test_short_answer_match():
    assert metrics.short_answer_match("  Top Left. ", "top left") == 1.0
    assert metrics.short_answer_match("3", "3") == 1.0 and metrics.short_answer_match("3.", "3") == 1.0
    assert metrics.short_answer_match("red square", "red") == 0.0  # exact, not contained
    assert metrics.short_answer_match("", "red") == 0.0


def test_chance_best_constants():
    from eval import chance

    subsets = {"all": [True] * 4, "first": [1, 0, 0, 0], "none": [0] * 4}
    found = chance.best_constant_answer(["a", "b", "b", "c"], metrics.exact_match, subsets)
    assert found == {"all": (0.5, "b"), "first": (1.0, "a"), "none": (None, None)}  # the majority's share
    answers, groups = ["1", "1", "red", "blue"], ["n", "n", "c", "c"]
    value, constants = chance.best_constant_per_group(answers, groups, metrics.short_answer_match)
    assert value == 0.75 and constants == {"c": "blue", "n": "1"}  # tie in group c: the first in sorted order
    boxes = chance.best_constant_boxes([[0.1, 0.1, 0.3, 0.3]] * 3 + [[0.6, 0.6, 0.9, 0.9]])
    assert boxes["IoU"] == (pytest.approx(0.75), "[0.10, 0.10, 0.30, 0.30]")  # the grid holds the majority box
    assert boxes["Center_ACC"][0] == 0.75 and boxes["ACC@0.9"][0] == 0.75  # disjoint boxes: 3 of 4 at best
