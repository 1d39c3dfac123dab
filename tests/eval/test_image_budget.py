"""eval/image_budget.py and scripts/image_budget.py: tokens and scales from a task's data, checked against the
image processor itself on images of known sizes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from eval.image_budget import budget_rows, markdown
from eval.tasks.common import image_paths
from vision_tower.image_processor import ImageProcessor

ROOT = Path(__file__).resolve().parents[2]


def _task(tmp_path: Path, docs: list[dict], sizes: dict[str, tuple[int, int]]) -> Path:
    data = tmp_path / "cmoe_toy" / "data"
    (data / "images").mkdir(parents=True)
    for name, size in sizes.items():
        Image.new("RGB", size, (250, 250, 250)).save(data / "images" / name)
    (data / "test.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    return data.parent


DOCS = [
    {"id": "scene", "image": "images/scene.png"},
    {"id": "doc", "font_size": 12, "pages": ["images/p0.png", "images/p1.png"]},
    {"id": "hay", "segments": [{"text": "a paragraph"}, {"image": "images/card.png"}, {"text": "q"}]},
]
SIZES = {"scene.png": (300, 220), "p0.png": (512, 724), "p1.png": (512, 724), "card.png": (384, 60)}


def test_image_paths_reads_every_layout():
    assert image_paths(DOCS[0]) == ["images/scene.png"]
    assert image_paths(DOCS[1]) == ["images/p0.png", "images/p1.png"]
    assert image_paths(DOCS[2]) == ["images/card.png"]
    assert image_paths({"question": "no image"}) == []


def test_tokens_scales_and_print_height_match_the_processor(tmp_path):
    task = _task(tmp_path, DOCS, SIZES)
    rows = budget_rows(task, [64, 1024])
    assert [r.max_patches for r in rows] == [64, 1024]
    for row in rows:
        proc = ImageProcessor(patch_size=16, max_patches=row.max_patches, pixel_shuffle=2)
        tokens = {n: proc.num_tokens_for(Image.new("RGB", s)) for n, s in SIZES.items()}
        assert (row.docs, row.images) == (3, 4)
        assert row.tokens_image_max == max(tokens.values())
        assert row.tokens_doc_max == max(tokens["scene.png"], tokens["p0.png"] * 2, tokens["card.png"])
        grids = {n: proc.grid_for(h, w) for n, (w, h) in SIZES.items()}
        scales = [min(gh * 16 / SIZES[n][1], gw * 16 / SIZES[n][0]) for n, (gh, gw) in grids.items()]
        assert row.scale_min == pytest.approx(min(scales))
        page_h = grids["p0.png"][0] * 16
        assert row.text_px_median == pytest.approx(12 * page_h / 724)  # only the pages give a font size
    small, large = rows
    assert small.tokens_image_max <= 16 and small.scale_min < 0.3  # a 512 x 724 page in 16 tokens is shrunk ~5x
    assert large.text_px_median > 2 * small.text_px_median
    table = markdown(rows)
    assert "| `cmoe_toy` | 64 | 4 (3) |" in table and table.count("\n") == 4


def test_bad_input_is_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        budget_rows(tmp_path / "nothing", [64])
    task = _task(tmp_path, DOCS, SIZES)
    (task / "data" / "images" / "card.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match="card.png"):
        budget_rows(task, [64])


def test_script_prints_the_table_and_exits_2_on_bad_input(tmp_path):
    _task(tmp_path, DOCS, SIZES)
    run = [sys.executable, str(ROOT / "scripts" / "image_budget.py"), "--tasks-dir", str(tmp_path)]
    out = subprocess.run([*run, "--max-patches", "64,256"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("`cmoe_toy`") == 2
    bad = subprocess.run([*run, "--tasks", "cmoe_missing"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "not found" in bad.stderr and bad.stderr.count("\n") == 1
    bad = subprocess.run([*run, "--max-patches", "0"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2
