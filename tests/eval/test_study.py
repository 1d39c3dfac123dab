"""``scripts/study.py --quick`` end to end (2 arms, 1 seed, 8 steps, 2 tasks, tiny data built under OUT; ~2 min):
every arm compute-matched (recomputed from the exported configs), every output there, the table built from the
runs' own files (an edited file changes it after ``--report-only``), and a second invocation redoes nothing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "scripts" / "configs" / "study.yaml"
ARMS = ("moe", "r2")


def study(out: Path, *flags: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, str(ROOT / "scripts" / "study.py"), "--config", str(CONFIG), "--quick", "--out", str(out)]
    proc = subprocess.run([*cmd, *flags], capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    doc = ROOT / "docs" / "study.md"
    before = doc.stat().st_mtime if doc.exists() else None
    out = tmp_path_factory.mktemp("study") / "out"
    proc = study(out)
    assert (doc.stat().st_mtime if doc.exists() else None) == before  # --quick never writes docs/study.md
    return out, proc


def run(out: Path, arm: str) -> Path:
    return out / "runs" / arm / "seed0"


def test_arms_are_compute_matched(quick):
    from vlm.accounting.flops import match_report
    from vlm.config import ConceptMoEVLMConfig

    out, proc = quick
    text = {arm: ConceptMoEVLMConfig.from_pretrained(run(out, arm) / "train" / "hf").text_config for arm in ARMS}
    assert text["moe"].chunking == "none" and text["r2"].chunking == "dynamic" and text["r2"].target_r == 2.0
    report = match_report(text["moe"], text["r2"])  # from the configs the runs saved, not the study's own numbers
    assert abs(report["params_mismatch"]) <= 0.02 and abs(report["flops_linear_mismatch"]) <= 0.02
    assert report["within_tolerance"] and "match: r2: params" in proc.stdout
    data = json.loads((out / "study.json").read_text())
    saved = {a["name"]: a["match_report"] for a in data["arms"]}
    assert saved["r2"]["params_mismatch"] == pytest.approx(report["params_mismatch"])


def test_outputs_exist(quick):
    from eval.study.collect import read_metrics, step_seconds

    out, _ = quick
    for arm in ARMS:
        path = run(out, arm)
        assert (path / "train" / "metrics.jsonl").stat().st_size > 0
        assert all((path / "train" / "hf" / name).is_file() for name in ("config.json", "model.safetensors"))
        assert list((path / "eval").rglob("*_results.json")) and list((path / "eval").rglob("r_stats_cmoe_*.jsonl"))
        assert (path / "eval" / "score_table.json").is_file() and (path / "eval" / "r_report.json").is_file()
        result = json.loads((path / "result.json").read_text())
        assert result["arm"] == arm and "train_vlm.py" in " ".join(result["train"]["command"])
        # the quick block's stage "warm" ran first and built the arm's model; the last stage started from its export
        warm, last = (yaml.safe_load((path / f"{s}.yaml").read_text()) for s in ("warm", "train"))
        assert warm["model"]["preset"] == "tiny-moe" and "init_from" not in warm["model"]
        assert (warm["model"]["overrides"].get("target_r") == 2.0) == (arm == "r2")
        assert last["model"] == {"init_from": str(path / "warm" / "hf")} and last["train"]["max_steps"] == 8
        assert (path / "warm" / "hf" / "model.safetensors").is_file() and list(result["train"]["stages"]) == [
            "warm",
            "train",
        ]
        assert result["train"]["wall_s"] == pytest.approx(sum(r["wall_s"] for r in result["train"]["stages"].values()))
    for name in ("study.json", "study.md", "prefill.json", "loss_curves.png", "r_modality.png", "score_vs_r.png"):
        assert (out / name).is_file(), name
    assert (out / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
    data = json.loads((out / "study.json").read_text())
    assert set(data["prefill"]["arms"]) == set(ARMS) and data["prefill"]["tokens"] == 4096
    assert data["aggregate"]["r2"]["prefill_ratio"]["mean"] == data["prefill"]["arms"]["r2"]["ratio"]
    for arm in ARMS:  # per-step seconds summed over both stages, as the wall time is
        seconds = [step_seconds(read_metrics(run(out, arm) / s / "metrics.jsonl")[0]) for s in ("warm", "train")]
        assert data["runs"][arm]["0"]["train_step_s"] == pytest.approx(sum(seconds)) and min(seconds) > 0
    verdicts = {c["id"]: c["verdict"] for c in data["claims"]}
    assert verdicts["table2"] == "inconclusive (1 seed)" and verdicts["longdoc"] == "not run"  # 1 seed; task not run
    doc = (out / "study.md").read_text()
    assert "| r2 | 1 | 2 |" in doc.split("## Results")[1] and "![Score against R](score_vs_r.png)" in doc


def test_table_is_built_from_the_run_files(quick):
    out, _ = quick
    path = run(out, "r2")
    metrics = path / "train" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    (ev,) = [r for r in records if r.get("split") == "eval"]
    ev["eval_bits_per_token"] = 12.3456
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    table = path / "eval" / "score_table.json"
    rows = json.loads(table.read_text())
    for row in rows:
        if (row["task"], row["metric"]) == ("cmoe_sceneqa", "acc"):
            row["score"] = 0.875
    table.write_text(json.dumps(rows))
    result = json.loads((path / "result.json").read_text())
    result["train"]["wall_s"] = 4321.0
    (path / "result.json").write_text(json.dumps(result))

    study(out, "--report-only")
    data = json.loads((out / "study.json").read_text())
    agg = data["aggregate"]["r2"]
    assert agg["bits_per_token"]["mean"] == 12.3456 and agg["score:cmoe_sceneqa:acc"]["mean"] == 0.875
    refloc = data["runs"]["r2"]["0"]["score:cmoe_refloc:IoU"]
    assert agg["mean_score"]["mean"] == pytest.approx((0.875 + refloc) / 2)
    results = (out / "study.md").read_text().split("## Results")[1].split("\n## ")[0]
    (row,) = [line for line in results.splitlines() if line.startswith("| r2 | 1 |")]
    assert "12.346" in row and "0.875" in row and "/ 4321 |" in row


def test_second_invocation_redoes_nothing(quick):
    out, _ = quick
    stamps = {
        p: p.stat().st_mtime
        for arm in ARMS
        for p in (run(out, arm) / "train" / "metrics.jsonl", run(out, arm) / "result.json")
    }
    prefill = (out / "prefill.json").stat().st_mtime
    proc = study(out, timeout=300)
    assert "training (" not in proc.stdout and "evaluating (" not in proc.stdout
    assert proc.stdout.count("finished before (result.json): skipped") == len(ARMS)
    assert "prefill: up to date" in proc.stdout
    assert {p: p.stat().st_mtime for p in stamps} == stamps and (out / "prefill.json").stat().st_mtime == prefill


def test_claim_verdicts_follow_the_rule():
    """Gap against spread per comparison, chance and seed counts, and the claim's verdict from its comparisons."""
    from eval.study.claims import compare, judge

    def agg(mean, std, n=3):
        return {"mean": mean, "std": std, "n": n}

    arms = {
        "a": {"bits_per_token": agg(7.0, 0.05), "mean_score": agg(0.5, 0.01), "x": agg(1.0, None, 1)},
        "b": {"bits_per_token": agg(7.2, 0.10), "mean_score": agg(0.1, 0.01), "x": agg(2.0, None, 1)},
    }
    chance = {"a": {"mean_score": 0.2}, "b": {"mean_score": 0.2}}
    verdict = lambda **c: compare({"a": "a", "b": "b", **c}, arms, chance)["verdict"]
    assert verdict(metric="bits_per_token", expect="lower") == "reproduced"  # gap 0.2 > spread 0.1
    assert verdict(metric="bits_per_token", expect="higher") == "not reproduced"
    assert verdict(metric="mean_score", expect="higher") == "inconclusive (at or below chance)"  # b at chance
    assert verdict(metric="x", expect="lower") == "inconclusive (1 seed)"
    arms["b"]["bits_per_token"] = agg(7.08, 0.10)
    assert verdict(metric="bits_per_token", expect="lower") == "inconclusive at this scale"  # gap 0.08 < 0.1
    arms["b"]["bits_per_token"] = agg(7.2, 0.10)
    both = [
        {"a": "a", "b": "b", "metric": "bits_per_token", "expect": "lower"},
        {"a": "a", "b": "b", "metric": "mean_score", "expect": "higher"},
    ]
    [claim] = judge([{"id": "c", "paper": "p", "claim": "t", "compare": both}], arms, chance)
    assert claim["verdict"] == "reproduced on 1 of 2 comparisons; the rest inconclusive (at or below chance)"
    both[0]["expect"] = "higher"
    [claim] = judge([{"id": "c", "paper": "p", "claim": "t", "compare": both}], arms, chance)
    assert claim["verdict"] == "not reproduced (1 of 2 comparisons; the rest inconclusive)"


@pytest.mark.parametrize(
    "name", ["study.yaml", "study_staged.yaml", "spatial.yaml", "spatial_staged.yaml", "spatial_focus.yaml"]
)
def test_shipped_study_configs_load_and_match(name):
    """Every study YAML under scripts/configs passes the checks (arms, claims, task metrics) and every arm is
    compute-matched to the baseline, as ``scripts/study.py`` checks before it trains anything."""
    from eval.study.arms import ArmError, build_arms
    from eval.study.config import load_study_config

    cfg = load_study_config(str(ROOT / "scripts" / "configs" / name))
    arms = build_arms(cfg, cfg["arms"])
    assert [a.name for a in arms] == [spec["name"] for spec in cfg["arms"]]
    assert all(a.report["within_tolerance"] for a in arms)
    bad = {**cfg["arms"][1], "vlm": {"image_chunking": "spiral"}}
    with pytest.raises(ArmError, match="image_chunking='spiral' is invalid"):
        build_arms(cfg, [cfg["arms"][0], bad])


def test_quick_without_config_uses_the_shipped_study(tmp_path, monkeypatch, capsys):
    """``scripts/study.py --quick`` needs no ``--config``: the default is scripts/configs/study.yaml, found from any
    working directory, and resolves to the same study as naming it."""
    from eval.study.cli import main, parse_args
    from eval.study.config import load_study_config

    monkeypatch.chdir(tmp_path)
    args = parse_args(["--quick", "--out", str(tmp_path / "out")])
    assert Path(args.config) == CONFIG and args.quick
    resolved = load_study_config(args.config, args.set, quick=args.quick, out=args.out)
    assert resolved == load_study_config(str(CONFIG), quick=True, out=str(tmp_path / "out"))
    assert resolved["quick"] and resolved["out"] == str(tmp_path / "out")
    # the command line gets as far as choosing arms from that config (an unknown arm: exit 2 before any run)
    assert main(["--quick", "--out", str(tmp_path / "out"), "--arms", "nope"]) == 2
    assert "--arms: unknown arm 'nope'; the study has moe," in capsys.readouterr().err
