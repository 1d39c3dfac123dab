"""The study's figures, drawn from the runs' own files (``eval.study.collect``):

- ``loss_curves.png``: training LM loss per step (moving average) of seed 0 of every arm;
- ``r_modality.png``: total / text / image R per training step of one arm's seed 0 against its target — the
  paper's Fig. 2c (ConceptMoE, arXiv 2601.21420): under one global R, how much each modality is compressed;
- ``r_control.png``: per-step total and image R of a few arms' seed 0 (the default recipe against the settings that
  made R swing), on one log axis with the ±15% band;
- ``score_vs_r.png``: mean task score and held-out bits per token (mean ± std over seeds) against the target R of
  the R-sweep arms (R = 1 for the MoE baseline; the paper's Fig. 11 direction).
"""

from __future__ import annotations

from pathlib import Path

from eval.r_report_plot import SERIES_COLORS, SERIES_LABELS, agg_figure, moving_average
from eval.study.collect import read_metrics, run_dir


def _first_seed(out: str, arm: str, seeds: int) -> Path | None:
    for seed in range(seeds):
        path = run_dir(out, arm, seed)
        if (path / "result.json").is_file():
            return path
    return None


def loss_curves(out: str, arms: list[str], seeds: int, png: Path) -> Path | None:
    """LM loss over steps, one line per arm (its lowest finished seed)."""
    fig = agg_figure(figsize=(8, 4.5))
    ax = fig.subplots()
    drawn = 0
    for i, arm in enumerate(arms):
        path = _first_seed(out, arm, seeds)
        steps = read_metrics(path / "train" / "metrics.jsonl")[0] if path else []
        points = [(s["step"], s["lm_loss"]) for s in steps if s.get("lm_loss") is not None]
        if not points:
            continue
        xs, ys = zip(*points)
        style = ("-", "--", ":")[i // 10 % 3]  # 10 colours, then the next line style: every arm stays distinct
        ax.plot(xs, moving_average(list(ys), max(1, len(ys) // 30)), style, color=f"C{i % 10}", label=arm, lw=1.2)
        drawn += 1
    if not drawn:
        return None
    ax.set(xlabel="step", ylabel="training LM loss (moving average)", title="Loss per arm (seed 0)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return png


def r_by_modality(out: str, arm: str, seeds: int, png: Path) -> Path | None:
    """Total / text / image R per step of ``arm`` (seed 0) with its target: Fig. 2c."""
    path = _first_seed(out, arm, seeds)
    steps = read_metrics(path / "train" / "metrics.jsonl")[0] if path else []
    if not steps:
        return None
    fig = agg_figure(figsize=(8, 4.5))
    ax = fig.subplots()
    for key in ("r", "r_text", "r_image"):
        points = [(s["step"], s[key]) for s in steps if s.get(key) is not None]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, label=SERIES_LABELS[key], color=SERIES_COLORS[key], lw=1.0, alpha=0.9)
    target = steps[-1].get("target_r")
    if target:
        ax.axhline(target, ls="--", color="grey", lw=1, label=f"target R = {target:g}")
        ax.axhspan(0.85 * target, 1.15 * target, color="grey", alpha=0.12, label="±15%")
    ax.set(xlabel="step", ylabel="R = tokens / concepts (train mode)", title=f"R per modality over training: {arm}")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return png


def r_control(out: str, arms: list[str], seeds: int, png: Path) -> Path | None:
    """Total (solid) and image (dotted) R per training step of each of ``arms`` (its lowest finished seed)."""
    fig = agg_figure(figsize=(8, 4.5))
    ax = fig.subplots()
    target, drawn = None, 0
    for i, arm in enumerate(arms):
        path = _first_seed(out, arm, seeds)
        steps = read_metrics(path / "train" / "metrics.jsonl")[0] if path else []
        color = f"C{i}"
        for key, style, label in (("r", "-", f"{arm}: total R"), ("r_image", ":", f"{arm}: image R")):
            points = [(s["step"], s[key]) for s in steps if s.get(key) is not None]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, style, color=color, lw=1.0, label=label)
                drawn += 1
        target = target or (steps[-1].get("target_r") if steps else None)
    if not drawn:
        return None
    if target:
        ax.axhspan(0.85 * target, 1.15 * target, color="grey", alpha=0.15, label=f"target R = {target:g} ±15%")
    ax.set(xlabel="step", ylabel="R = tokens / concepts (train mode)", title="R under control: per-step R, seed 0")
    ax.set_yscale("log")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return png


def score_vs_r(points: list[tuple[str, float, dict, dict]], png: Path, chance: float | None = None) -> Path | None:
    """``points``: (arm, target R, mean_score aggregate or None, bits_per_token aggregate or None); ``chance``: the
    mean score of the best constant answers, drawn dashed."""
    points = [p for p in points if p[2] or p[3]]
    if not points:
        return None
    fig = agg_figure(figsize=(9, 4))
    axes = fig.subplots(1, 2)
    for ax, idx, label in ((axes[0], 2, "mean task score"), (axes[1], 3, "held-out bits per token")):
        for arm, r, score, bits in points:
            stats = (score, bits)[idx - 2]
            if stats:
                ax.errorbar([r], [stats["mean"]], yerr=[stats["std"] or 0.0], fmt="o", capsize=3)
                ax.annotate(arm, (r, stats["mean"]), textcoords="offset points", xytext=(5, 4), fontsize=8)
        if idx == 2 and chance is not None:
            ax.axhline(chance, ls="--", color="grey", lw=1, label="chance")
            ax.legend(fontsize=8)
        ax.set(xlabel="target R (1 = MoE baseline)", ylabel=label)
        ax.grid(alpha=0.3)
    fig.suptitle("Score against R (mean ± std over seeds)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return png
