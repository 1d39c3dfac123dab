"""The PNG of the per-modality R report: R over training steps (the paper's Fig. 2c) with the held-out eval R, and
per-task bars.

The training panel's R axis is logarithmic (image R / text R is then one distance at any height) and spans the 1st to
99th percentile of each series after the first ``WARMUP_FRACTION`` of steps (``r_axis``): the untrained router's
first steps (image R 75+ at step 1) would otherwise set the axis and squash total and text R near 2 flat. Points
left off the axis are counted in the title, never dropped silently.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eval.r_report_io import SERIES, Records, train_eval_r

SERIES_LABELS = {"r": "total R", "r_text": "text R", "r_image": "image R"}
SERIES_COLORS = {"r": "#333333", "r_text": "tab:blue", "r_image": "tab:orange"}
WARMUP_FRACTION = 0.1  # the first steps set no axis limit (their points are still drawn, or noted off the axis)
AXIS_PERCENTILES = (1.0, 99.0)
AXIS_PAD = 1.15  # a factor on the log axis
EVAL_MARKER = "D"  # held-out eval R: markers only, in the series' colour


def moving_average(ys: list[float], window: int) -> list[float]:
    """Mean of each value and the ``window - 1`` before it (fewer at the start)."""
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y - (ys[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


@dataclass
class RAxis:
    """The training panel's log R axis: [low, high], and the drawn points outside it."""

    low: float
    high: float
    warmup_steps: int  # leading steps left out of the percentiles
    off_axis: list[tuple[str, float, float]]  # (series, step, R), largest distance from the axis first


def r_axis(series: dict[str, Sequence[tuple[float, float]]], always: Iterable[float] = ()) -> RAxis:
    """Limits of the log R axis: per series the ``AXIS_PERCENTILES`` of its values after the first
    ``WARMUP_FRACTION`` of steps (all its values if none is left), widened to hold every value of ``always`` (target
    R, held-out eval R), padded by ``AXIS_PAD``. ``series``: key -> (step, R) points; R <= 0 or None is ignored."""
    clean = {k: [(x, y) for x, y in pts if y is not None and y > 0] for k, pts in series.items()}
    steps = sorted({x for pts in clean.values() for x, _ in pts})
    warmup = math.ceil(WARMUP_FRACTION * len(steps)) if len(steps) > 1 else 0
    after = steps[warmup] if warmup < len(steps) else math.inf
    lows, highs = [v for v in always if v is not None and v > 0], []
    highs += lows
    for pts in clean.values():
        ys = [y for x, y in pts if x >= after] or [y for _, y in pts]
        if ys:
            lo, hi = np.percentile(ys, AXIS_PERCENTILES)
            lows.append(float(lo))
            highs.append(float(hi))
    if not lows:
        return RAxis(1.0 / AXIS_PAD, 2.0 * AXIS_PAD, warmup, [])
    low, high = min(lows) / AXIS_PAD, max(highs) * AXIS_PAD
    off = [(k, x, y) for k, pts in clean.items() for x, y in pts if not low <= y <= high]
    off.sort(key=lambda o: -abs(math.log(o[2] / (high if o[2] > high else low))))
    return RAxis(low, high, warmup, off)


def _off_axis_note(axis: RAxis) -> str:
    if not axis.off_axis:
        return ""
    (key, step, r), n = axis.off_axis[0], len(axis.off_axis)
    return (
        f"\n{n} point{'s' * (n != 1)} off the axis (1st-99th percentile after the first {axis.warmup_steps} "
        f"steps), e.g. {SERIES_LABELS[key]} {r:.3g} at step {step:g}"
    )


def _log_r_axis(ax, axis: RAxis) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.set_ylim(axis.low, axis.high)
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def plot_training(ax, records: Records, train: dict) -> None:
    """Fig. 2c of the paper: total / image / text R over optimiser steps, held-out eval R as markers, target R
    dashed, on the log axis of ``r_axis``."""
    many = len(records.steps) > 200
    series = {key: [(s["step"], s[key]) for s in records.steps if s[key] is not None] for key in SERIES}
    held_out = train_eval_r(records)
    for key in ("r", "r_image", "r_text"):
        if not series[key]:
            continue
        xs, ys = zip(*series[key])
        tail = train[key]["mean_last_10pct"]
        label = f"{SERIES_LABELS[key]} (last 10%: {'n/a' if tail is None else f'{tail:.2f}'})"
        color = SERIES_COLORS[key]
        if many:  # raw steps faint, a moving average on top
            ax.plot(xs, ys, color=color, lw=0.6, alpha=0.25)
            ax.plot(xs, moving_average(list(ys), max(2, len(ys) // 50)), color=color, lw=1.8, label=label)
        else:
            ax.plot(xs, ys, color=color, lw=1.6, marker="o" if len(xs) <= 30 else None, ms=3, label=label)
    for key in ("r", "r_image", "r_text"):
        if held_out[key]:
            xs, ys = zip(*held_out[key])
            ax.plot(
                xs,
                ys,
                ls="none",
                marker=EVAL_MARKER,
                ms=7,
                color=SERIES_COLORS[key],
                mec="black",
                mew=0.8,
                label=f"held-out {SERIES_LABELS[key]}, eval mode (last: {ys[-1]:.2f})",
            )
    if train["target_r"] is not None:
        ax.axhline(train["target_r"], color="gray", ls="--", lw=1.2, label=f"target R = {train['target_r']:g}")
    axis = r_axis(series, [train["target_r"], *(y for pts in held_out.values() for _, y in pts)])
    _log_r_axis(ax, axis)
    ratio = train["image_to_text_r"]["mean_last_10pct"]
    subtitle = f"\nimage R / text R = {ratio:.2f} over the last 10% of steps" if ratio is not None else ""
    ax.set_title(f"Compression ratio over training: {records.name}{subtitle}{_off_axis_note(axis)}")
    if train["nonfinite_steps"]:  # on the figure too: those steps are gaps in the curves
        warning = (
            f"WARNING: {train['nonfinite_steps']} steps with a non-finite loss / R, first at step "
            f"{train['nonfinite_at'][0]} (left out; see nonfinite_at in r_report.json)"
        )
        ax.text(0.01, 0.02, warning, transform=ax.transAxes, color="red", fontsize=9, fontweight="bold")
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("R = tokens / concepts (log scale)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="best", fontsize=9)


def _per_dataset(ev: dict) -> bool:
    return any(len(t.get("datasets", {})) > 1 for t in ev["tasks"].values())


def _eval_groups(ev: dict) -> list[tuple[str, dict, dict | None]]:
    """(label, summary, score) per bar group: per dataset when some task spans several datasets, else per task."""
    per_dataset = _per_dataset(ev)
    groups = []
    for task, t in ev["tasks"].items():
        if per_dataset and t.get("datasets"):
            for ds, d in t["datasets"].items():
                score = d["score"] or (t["score"] if len(t["datasets"]) == 1 else None)
                groups.append((f"{task}\n{ds}", d, score))
        else:
            groups.append((task, t, t["score"]))
    return groups


def _plot_eval(ax, ev: dict, target_r: float | None) -> None:
    """Grouped bars of R total / text / image (mean ± std over samples) per task, the score above each group."""
    groups = _eval_groups(ev)
    width = 0.26
    bars = [
        (i, j, key, g[key]["mean"], g[key]["std"]) for j, key in enumerate(SERIES) for i, (_, g, _) in enumerate(groups)
    ]
    bars = [b for b in bars if b[3] is not None]
    top = max([mean + std for *_, mean, std in bars] + [target_r or 0.0]) or 1.0
    labelled = set()
    for i, j, key, mean, std in bars:
        x = i + (j - 1) * width
        label = None if key in labelled else SERIES_LABELS[key]
        labelled.add(key)
        ax.bar(x, mean, width, yerr=std, capsize=3, color=SERIES_COLORS[key], label=label)
        ax.text(x, mean + std + 0.01 * top, f"{mean:.2f}", ha="center", va="bottom", fontsize=7)
    for i, (_, _, score) in enumerate(groups):
        if score is not None:
            ax.text(
                i,
                top * 1.12,
                f"{score['metric']} = {score['value']:.3g}",
                ha="center",
                va="bottom",
                fontsize=9,
                fontweight="bold",
                bbox={"boxstyle": "round,pad=0.25", "fc": "#fff8dc", "ec": "#bbbbbb"},
            )
    if target_r is not None:
        ax.axhline(target_r, color="gray", ls="--", lw=1.2, label=f"target R = {target_r:g}")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(
        [f"{label}\n(n={g['n']})" for label, g, _ in groups], fontsize=8, rotation=20 if len(groups) > 6 else 0
    )
    ax.set_ylim(0, top * 1.35)
    ax.set_ylabel("R = tokens / concepts")
    unit = "task / dataset" if _per_dataset(ev) else "task"
    ax.set_title(f"Compression ratio per {unit} (mean ± std over samples), score above each group")
    ax.grid(axis="y", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)


def agg_figure(**kwargs):
    """A matplotlib ``Figure`` (``kwargs`` as its constructor's) drawn by Agg: no display, no pyplot global state,
    so figures can be drawn from any thread and nothing needs closing."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def plot_report(records: Records, summary: dict, out_png: str | Path) -> Path:
    """PNG with one panel per kind of data present: R over training steps, and R per task with scores."""
    panels = [p for p in ("train", "eval") if summary[p] is not None]
    n_groups = len(_eval_groups(summary["eval"])) if summary["eval"] else 0
    fig = agg_figure(figsize=(max(10.0, 1.3 * n_groups), 4.8 * max(1, len(panels))), dpi=110, layout="constrained")
    axes = fig.subplots(max(1, len(panels)), 1, squeeze=False)[:, 0]
    for ax, panel in zip(axes, panels):
        if panel == "train":
            plot_training(ax, records, summary["train"])
        else:
            target = summary["train"]["target_r"] if summary["train"] else None
            _plot_eval(ax, summary["eval"], target)
    out_png = Path(out_png)
    fig.savefig(out_png)
    return out_png


# ----------------------------------------------------------------------------------------------------------------
# Entry point
