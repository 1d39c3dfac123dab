import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from eval.r_report import ReportInputError, load_records, plot_report, summarize, write_report

REPO_ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# 11 steps, so the "last 10%" is the last ceil(1.1) = 2 steps (10 and 11).
R = [4, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2]
R_TEXT = [2, 2, 2, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5]
R_IMAGE = [8, 6, 6, 4, 4, 4, 4, 4, 4, 3, None]  # the last step saw no image token


def _write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def _training_run(run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, (r, rt, ri) in enumerate(zip(R, R_TEXT, R_IMAGE), start=1):
        lines.append(
            {"step": i, "loss": 5.0 - 0.1 * i, "r": r, "r_text": rt, "r_image": ri, "target_r": 2.0, "foo": "x"}
        )
        if i == 3:
            lines.append('{"step": 4, "loss": 1.0, "r": 10')  # corrupt (a truncated write): line 4 of the file
        if i == 5:
            lines.append({"step": 5, "split": "eval", "loss": 2.5, "r": 99.0, "r_image": 99.0})
        if i == 10:
            lines.append({"step": 10, "eval_loss": 2.0, "eval_r": 50.0})
    return _write_lines(run_dir / "metrics.jsonl", lines)


def test_training_summary_matches_hand_computed_values(tmp_path, caplog):
    _training_run(tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="eval.r_report"):
        records = load_records(tmp_path / "run")
    s = summarize(records)
    assert s["skipped_lines"] == 1
    assert s["skipped_at"] == [f"{tmp_path / 'run' / 'metrics.jsonl'}:4"]
    assert "metrics.jsonl:4" in caplog.text

    t = s["train"]
    assert t["steps"] == 11 and t["first_step"] == 1 and t["last_step"] == 11
    assert t["target_r"] == 2.0
    assert t["eval"]["records"] == 2 and t["eval"]["last"]["eval_loss"] == 2.0

    # no counts in these records: no token-weighted tail
    assert all(t[k].pop("token_weighted_last_10pct") is None for k in ("r", "r_text", "r_image"))
    # total R: one 4, two 3, eight 2 -> mean 26/11, var = 66/11 - (26/11)^2 = 50/121
    assert t["r"] == pytest.approx(
        {
            "n": 11,
            "mean": 26 / 11,
            "std": math.sqrt(50) / 11,
            "min": 2,
            "max": 4,
            "first": 4,
            "last": 2,
            "mean_last_10pct": 2,
        }
    )
    assert t["r_text"]["mean"] == pytest.approx(18 / 11)
    assert t["r_text"]["mean_last_10pct"] == pytest.approx(1.5)
    # image R: 10 non-null values summing to 47; sum of squares 241 -> var 24.1 - 4.7^2 = 2.01
    assert t["r_image"] == pytest.approx(
        {"n": 10, "mean": 4.7, "std": math.sqrt(2.01), "min": 3, "max": 8, "first": 8, "last": 3, "mean_last_10pct": 3}
    )
    assert t["image_to_text_r"]["mean_last_10pct"] == pytest.approx(3 / 1.5)
    assert t["image_to_text_r"]["mean"] == pytest.approx(4.7 / (18 / 11))
    assert t["scalars"]["loss"]["last"] == pytest.approx(5.0 - 1.1)
    assert "foo" not in t["scalars"]


def test_target_r_argument_overrides_the_log(tmp_path):
    _training_run(tmp_path / "run")
    assert summarize(load_records(tmp_path / "run"), target_r=3.0)["train"]["target_r"] == 3.0


def test_resumed_run_keeps_the_later_record_of_a_step(tmp_path):
    lines = [{"step": s, "loss": 1.0, "r": 2.0} for s in (1, 2, 3)] + [
        {"step": s, "loss": 1.0, "r": 4.0} for s in (2, 3, 4)
    ]
    records = load_records(_write_lines(tmp_path / "metrics.jsonl", lines))
    assert [st["step"] for st in records.steps] == [1, 2, 3, 4]
    assert [st["r"] for st in records.steps] == [2.0, 4.0, 4.0, 4.0]
    assert summarize(records)["train"]["duplicate_steps"] == 2


def test_counts_and_r_by_modality_give_per_modality_r(tmp_path):
    lines = [
        {"step": 1, "loss": 1.0, "tokens_by_modality": {"0": 30, "1": 40}, "concepts_by_modality": {"0": 20, "1": 10}},
        {"step": 2, "loss": 1.0, "tokens_by_modality": {"0": 12}, "concepts_by_modality": {"0": 4}},  # text only
        {"step": 3, "loss": 1.0, "tokens_by_modality": {"0": 6, "1": 0}, "concepts_by_modality": {"0": 3, "1": 0}},
        # image tokens merged into a text concept: R_m = tokens_m / max(concepts_m, 1), as chunk_statistics
        {"step": 4, "loss": 1.0, "tokens_by_modality": {"0": 4, "1": 5}, "concepts_by_modality": {"0": 1, "1": 0}},
        {
            "step": 5,
            "loss": 1.0,
            "r": 2.0,
            "r_by_modality": {"0": 1.5, "1": 3.0},
        },  # ratios only, in chunk_stats' r_by_modality form
    ]
    records = load_records(_write_lines(tmp_path / "metrics.jsonl", lines))
    got = [(st["r"], st["r_text"], st["r_image"]) for st in records.steps]
    assert got == [
        pytest.approx((70 / 30, 1.5, 4.0)),
        (3.0, 3.0, None),
        (2.0, 2.0, None),
        (9.0, 4.0, 5.0),
        (2.0, 1.5, 3.0),
    ]
    assert summarize(records)["train"]["r_image"]["n"] == 3


def _eval_folder(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    _write_lines(
        root / "cmoe_niah_r_stats.jsonl",
        [
            {"task": "cmoe_niah", "doc_id": 0, "tokens": 100, "concepts": 20, "r": 5, "r_text": 4, "r_image": 6},
            {"task": "cmoe_niah", "doc_id": 1, "tokens": 300, "concepts": 100, "r": 3, "r_text": 2, "r_image": 4},
        ],
    )
    _write_lines(
        root / "cmoe_refloc_r_stats.jsonl",
        [
            {
                "task": "cmoe_refloc",
                "dataset": "scenes_a",
                "doc_id": 0,
                "score": 1.0,
                "tokens_by_modality": {"0": 10, "1": 90},
                "concepts_by_modality": {"0": 5, "1": 30},
            },
            {
                "task": "cmoe_refloc",
                "dataset": "scenes_b",
                "doc_id": 1,
                "score": 0.0,
                "miou": 0.9,
                "tokens_by_modality": {"0": 20, "1": 60},
                "concepts_by_modality": {"0": 5, "1": 30},
            },
        ],
    )
    model_dir = root / "conceptmoe"
    model_dir.mkdir()
    results = {
        "results": {
            "cmoe_niah": {"alias": "cmoe_niah", "acc,none": 0.75, "acc_stderr,none": 0.1},
            "cmoe_refloc": {
                "alias": "cmoe_refloc",
                "miou,none": 0.4,
                "ACC@0.5,none": 0.5,
                "ACC@0.5_stderr,none": "N/A",
            },
        }
    }
    (model_dir / "20260101_120000_results.json").write_text(json.dumps(results))
    # lmms-eval's own sample log: valid JSON, no task field -> ignored, not an error
    _write_lines(model_dir / "20260101_120000_samples_cmoe_niah.jsonl", [{"doc_id": 0, "doc": {}, "acc": 1.0}])
    return root


def test_eval_summary_per_task_with_token_weighted_r_and_scores(tmp_path):
    records = load_records(_eval_folder(tmp_path / "lmms_out"))
    s = summarize(records)
    assert s["train"] is None and s["ignored_records"] == 1
    tasks = s["eval"]["tasks"]
    assert sorted(tasks) == ["cmoe_niah", "cmoe_refloc"]

    niah = tasks["cmoe_niah"]
    assert niah["n"] == 2
    assert niah["r"]["mean"] == pytest.approx(4.0) and niah["r"]["std"] == pytest.approx(1.0)
    assert niah["r"]["token_weighted"] == pytest.approx(400 / 120)
    assert niah["r_text"]["mean"] == pytest.approx(3.0) and niah["r_image"]["mean"] == pytest.approx(5.0)
    assert niah["r_text"]["token_weighted"] is None  # no per-modality counts in these records
    assert niah["scores"] == {"acc": 0.75} and niah["score"] == {"metric": "acc", "value": 0.75}

    refloc = tasks["cmoe_refloc"]
    # per sample: text 2 and 4, image 3 and 2; total 100/35 and 80/35
    assert refloc["r_text"]["mean"] == pytest.approx(3.0) and refloc["r_image"]["mean"] == pytest.approx(2.5)
    assert refloc["r"]["token_weighted"] == pytest.approx(180 / 70)
    assert refloc["r_text"]["token_weighted"] == pytest.approx(30 / 10)
    assert refloc["r_image"]["token_weighted"] == pytest.approx(150 / 60)
    # the results file wins over the per-sample mean (0.9) and its first metric is the headline
    assert refloc["scores"] == pytest.approx({"score": 0.5, "miou": 0.4, "ACC@0.5": 0.5})
    assert refloc["score"] == {"metric": "miou", "value": 0.4}
    assert set(refloc["datasets"]) == {"scenes_a", "scenes_b"}
    assert refloc["datasets"]["scenes_a"]["r"]["mean"] == pytest.approx(100 / 35)
    assert refloc["datasets"]["scenes_b"]["score"] == {"metric": "miou", "value": 0.9}


def test_plot_has_one_panel_per_kind_of_data(tmp_path):
    train_only = load_records(_training_run(tmp_path / "both" / "run"))
    both = load_records(_eval_folder(tmp_path / "both"))  # the run folder sits inside the eval folder
    sizes = []
    for name, records in (("train", train_only), ("both", both)):
        png = plot_report(records, summarize(records), tmp_path / f"{name}.png")
        with Image.open(png) as im:
            sizes.append(im.size)
    assert sizes[1][1] > 1.8 * sizes[0][1]


def _cli(*args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "r_report.py"), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)


def test_cli_writes_json_and_png(tmp_path):
    run = tmp_path / "run"
    _training_run(run)
    proc = _cli(run, "--target-r", "2.5")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run / "r_report.json").read_text())
    assert summary["train"]["steps"] == 11 and summary["train"]["target_r"] == 2.5
    png = run / "r_report.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(png) as im:
        im.verify()
    with Image.open(png) as im:
        assert 600 <= im.size[0] <= 4000 and 300 <= im.size[1] <= 4000

    out = tmp_path / "elsewhere"
    proc = _cli(run / "metrics.jsonl", "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert (out / "r_report.json").is_file() and (out / "r_report.png").is_file()


@pytest.mark.parametrize("case", ["empty_file", "missing_path", "only_corrupt_lines", "folder_without_jsonl"])
def test_cli_bad_input_exits_2_with_one_line(tmp_path, case):
    target = {
        "empty_file": tmp_path / "metrics.jsonl",
        "missing_path": tmp_path / "nope",
        "only_corrupt_lines": tmp_path / "metrics.jsonl",
        "folder_without_jsonl": tmp_path,
    }[case]
    if case == "empty_file":
        target.write_text("")
    if case == "only_corrupt_lines":
        target.write_text("{not json\n[1, 2]\n")
    proc = _cli(target)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    # the error is one line, the last; only the malformed lines themselves are logged before it
    assert lines[-1].startswith("r_report: error:") and str(target) in lines[-1]
    assert len(lines) == 1 + (case == "only_corrupt_lines") * 2
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "r_report.json").exists()


def test_library_raises_report_input_error_on_empty_file(tmp_path):
    with pytest.raises(ReportInputError, match="no training step or evaluation record"):
        write_report(_write_lines(tmp_path / "metrics.jsonl", []))


def test_reads_what_the_trainer_logs_even_without_images(tmp_path):
    """Text-only training: image R is None on every step; the report still renders, with the target line."""
    import torch

    from vlm import ConceptMoEConfig, ConceptMoEForCausalLM
    from vlm.training.single_process import TrainConfig, train

    torch.manual_seed(0)
    model = ConceptMoEForCausalLM(ConceptMoEConfig.from_preset("tiny"))
    batches = iter([{"input_ids": (ids := torch.randint(0, 512, (2, 32))), "labels": ids} for _ in range(4)])
    history = train(model, batches, TrainConfig(max_steps=4, save_every=4, seed=0, warmup=1))
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(rec) + "\n" for rec in history))
    summary = write_report(run)
    train_summary = summary["train"]
    assert train_summary["target_r"] == 2.0
    assert train_summary["r_text"]["mean"] == pytest.approx(sum(h["r"] for h in history) / 4)
    assert train_summary["r_image"]["n"] == 0
    assert (run / "r_report.png").read_bytes().startswith(PNG_SIGNATURE)


def test_tail_r_pools_counts_rather_than_averaging_step_ratios(tmp_path):
    """A step with a few image tokens in one concept (R 10) must not weigh like a full one (R 2)."""

    def step(s, image_tokens, image_concepts):
        return {
            "step": s,
            "loss": 1.0,
            "tokens_by_modality": {"0": 20, "1": image_tokens},
            "concepts_by_modality": {"0": 10, "1": image_concepts},
        }

    lines = [step(s, 8, 4) for s in range(1, 19)] + [step(19, 10, 1), step(20, 1000, 500)]
    train = summarize(load_records(_write_lines(tmp_path / "metrics.jsonl", lines)))["train"]
    assert train["r_image"]["mean_last_10pct"] == pytest.approx((10 + 2) / 2)
    assert train["r_image"]["token_weighted_last_10pct"] == pytest.approx(1010 / 501)
    assert train["r_text"]["token_weighted_last_10pct"] == pytest.approx(2.0)
    assert train["r"]["token_weighted_last_10pct"] == pytest.approx(1050 / 521)


def _run_with_nonfinite_steps(run_dir: Path) -> Path:
    """Ten steps at R = 2; NaN, inf, the string "nan" and a trainer-skipped step among them, plus a NaN eval."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [{"step": s, "loss": 1.0, "lm_loss": 1.0, "r": 2.0, "r_text": 2.0} for s in range(1, 11)]
    lines[2]["loss"] = lines[2]["lm_loss"] = float("nan")  # json.dumps writes NaN, as the trainer's writer would
    lines[4]["r"] = float("inf")
    lines[6]["ratio_loss"] = "nan"
    lines[7] = {"step": 8, "lr": 1e-3, "skipped": True, "nonfinite_total": 1}  # the DeepSpeed loop's skipped step
    lines.append({"step": 10, "split": "eval", "loss": float("nan"), "r": 2.0})
    return _write_lines(run_dir / "metrics.jsonl", lines)


def test_nonfinite_losses_and_r_are_counted_and_flagged_never_dropped(tmp_path, caplog):
    path = _run_with_nonfinite_steps(tmp_path / "run")
    assert "NaN" in path.read_text() and "Infinity" in path.read_text()
    with caplog.at_level(logging.WARNING):
        records = load_records(tmp_path / "run")
    s = summarize(records)
    assert s["nonfinite_steps"] == 4
    t = s["train"]
    assert t["steps"] == 10 and t["nonfinite_steps"] == 4 and t["nonfinite_at"] == [3, 5, 7, 8]
    assert t["nonfinite_by_key"] == {"lm_loss": 1, "loss": 1, "r": 1, "ratio_loss": 1, "skipped": 1}
    assert t["eval"]["nonfinite_records"] == 1
    assert t["r"]["n"] == 8 and t["scalars"]["loss"]["n"] == 8  # left out of the statistics, not poisoning them
    assert len(s["warnings"]) == 1 and "4 training steps with a non-finite loss or R" in s["warnings"][0]
    assert "at steps 3, 5, 7, 8" in s["warnings"][0] and "1 eval records" in s["warnings"][0]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "non-finite" in r.getMessage()]
    assert len(warned) == 1 and "warning: 4 training steps" in warned[0]

    clean = summarize(load_records(_training_run(tmp_path / "clean")))
    assert clean["nonfinite_steps"] == 0 and clean["warnings"] == [] and clean["train"]["nonfinite_at"] == []


def test_nonfinite_sample_r_is_counted(tmp_path):
    lines = [{"task": "t", "doc_id": i, "tokens": 10, "concepts": 5, "r": r} for i, r in enumerate([2.0, "NaN", 2.0])]
    s = summarize(load_records(_write_lines(tmp_path / "r_stats_t.jsonl", lines)))
    assert s["eval"]["nonfinite_samples"] == 1 and s["eval"]["tasks"]["t"]["r"]["n"] == 3  # R from the counts
    assert "1 evaluation samples with a non-finite R" in s["warnings"][0]


def test_cli_warns_about_nonfinite_steps_on_stderr_and_in_the_json(tmp_path):
    _run_with_nonfinite_steps(tmp_path / "run")
    proc = _cli(tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if "warning: 4 training steps with a non-finite" in line]
    assert len(warned) == 1, proc.stderr
    assert "4 steps with a non-finite loss or R" in proc.stderr  # the closing overview line says it too
    summary = json.loads((tmp_path / "run" / "r_report.json").read_text())  # strict JSON: no NaN written back
    assert summary["nonfinite_steps"] == 4 and summary["train"]["nonfinite_at"] == [3, 5, 7, 8]
    assert (tmp_path / "run" / "r_report.png").read_bytes().startswith(PNG_SIGNATURE)
