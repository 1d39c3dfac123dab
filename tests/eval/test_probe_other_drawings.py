"""``scripts/probe_other_drawings.py`` through the HF Auto classes on a tiny export: one report line, chance from the
pictures themselves, every picture asked both questions, and pictures that are really the named colour and shape."""

import importlib.util
import random
from pathlib import Path

import numpy as np

from data_pipelines.synthetic.scenes import COLOURS

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "probe_other_drawings.py"


def load():
    spec = importlib.util.spec_from_file_location("probe_other_drawings", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pictures_hold_one_shape_of_the_named_colour():
    script = load()
    rng = random.Random(0)
    for _ in range(20):
        image, colour, shape = script.draw(rng)
        pixels = np.asarray(image).reshape(-1, 3).astype(int)
        distance = np.abs(pixels - np.array(COLOURS[colour])).max(1)
        assert (distance <= 20).sum() > 0.02 * len(pixels), (colour, shape)  # the shape, within the +/-20 shift
        background = pixels[0] if distance[0] > 20 else pixels[-1]
        assert ((distance <= 20) | (np.abs(pixels - background).max(1) == 0)).mean() > 0.9  # and nothing else


def test_the_probe_runs_an_export_through_the_auto_classes(tiny_checkpoint, capsys):
    report = load().main([str(tiny_checkpoint), "--n", "3", "--seed", "1"])
    assert report["n"] == 3 and set(report["accuracy"]) == set(report["chance"]) == {"colour", "shape"}
    assert all(0.0 <= v <= 1.0 for v in report["accuracy"].values())
    assert all(v >= 1 / 3 for v in report["chance"].values())  # the best constant answer gets at least one of three
    assert capsys.readouterr().out.count("\n") == 1
