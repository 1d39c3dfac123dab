"""The study's doc as markdown, from the data ``eval.study.report.gather`` collected (every number from a file).

Sections: the generated banner, the notes (a markdown file inserted verbatim: the prose on why and what would be
needed; a marked placeholder when it does not exist yet), setup and seeds, the one results table (mean ± std over
seeds), eval-mode R per task, R against its target, the claims and their verdicts, the plots, the match report of
every arm and the exact commands.
"""

from __future__ import annotations

import shlex

from eval.study.claims import REPRODUCED
from eval.study.config import data_sets

SHORT = {"cmoe_sceneqa": "sceneqa", "cmoe_refloc": "refloc", "cmoe_niah": "niah", "cmoe_longdoc": "longdoc"}
NOTES_MARK = "<!-- NOTES: {path} is inserted here verbatim (the prose: why each verdict, what would be needed) -->"

DEFAULT_TITLE = "The compute-matched study: ConceptMoE against its MoE baseline in a VLM"  # the YAML's `title` wins


def _stat(stats: dict | None, digits: int = 3, pct: bool = False) -> str:
    if not stats:
        return "–"
    scale, unit = (100.0, "%") if pct else (1.0, "")
    text = f"{scale * stats['mean']:.{digits}f}{unit}"
    return text if stats.get("std") is None else f"{text} ± {scale * stats['std']:.{digits}f}{unit}"


def _mean(stats: dict | None, digits: int = 2) -> str:
    return "–" if not stats else f"{stats['mean']:.{digits}f}"


def _triple(agg: dict, prefix: str) -> str:
    return " / ".join(_mean(agg.get(f"{prefix}{k}")) for k in ("r", "r_text", "r_image"))


def _targets(arm: dict) -> str:
    t = arm["targets"]
    if not t:
        return "1 (none)"
    if "r" in t:
        return f"{t['r']:g}" + (" (fixed)" if arm["chunking"] == "fixed" else "")
    return ", ".join(f"{k.removeprefix('r_')} {v:g}" for k, v in t.items())


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def results_table(data: dict) -> list[str]:
    tasks, main = data["eval"]["tasks"], data["eval"]["main_metrics"]
    scores = [(t, m) for t in tasks for m in main[t]]
    header = ["arm", "n", "target R", "train LM loss", "held-out bits/token"]
    header += [f"{SHORT.get(t, t)} {m}" for t, m in scores] + ["mean score"]
    header += [
        "eval R held-out (tot / text / img)",
        "eval R lmms-eval (tot / text / img)",
        "train R 2nd half (tot / text / img)",
        "R in band",
        "prefill 4K ×base",
        "train s (steps / wall)",
    ]
    rows = []
    for arm in data["arms"]:
        a = data["aggregate"].get(arm["name"]) or {}
        n = len(data["seeds_by_arm"].get(arm["name"], []))
        row = [arm["name"], str(n), _targets(arm), _stat(a.get("train_lm_loss")), _stat(a.get("bits_per_token"))]
        row += [_stat(a.get(f"score:{t}:{m}")) for t, m in scores] + [_stat(a.get("mean_score"))]
        row += [
            _triple(a, "eval_"),
            _triple(a, "lmms_"),
            _triple(a, "train_"),
            _stat(a.get("r_in_band"), 0, pct=True) if arm["targets"] else "–",
            "–" if not a.get("prefill_ratio") else f"×{a['prefill_ratio']['mean']:.2f}",
            f"{_mean(a.get('train_step_s'), 0)} / {_mean(a.get('train_wall_s'), 0)}",
        ]
        rows.append(row)
    chance = next((c for c in data["chance"].values() if c), {})
    rows.append(
        ["*chance*", "", "", "", ""]
        + [
            _mean({"mean": chance[f"score:{t}:{m}"]}, 3) if chance.get(f"score:{t}:{m}") is not None else "–"
            for t, m in scores
        ]
        + [_mean({"mean": chance["mean_score"]}, 3) if chance.get("mean_score") is not None else "–"]
        + [""] * 6
    )
    return _table(header, rows)


def task_r_table(data: dict) -> list[str]:
    tasks = data["eval"]["tasks"]
    header = ["arm", "train image R (2nd half)"] + [f"{SHORT.get(t, t)} R (tot / text / img)" for t in tasks]
    rows = []
    for arm in data["arms"]:
        runs = list((data["runs"].get(arm["name"]) or {}).values())
        cells = []
        for task in tasks:
            per = [(r.get("lmms_task_r") or {}).get(task) or {} for r in runs]
            vals = [[p.get(k) for p in per if p.get(k) is not None] for k in ("r", "r_text", "r_image")]
            cells.append(" / ".join(f"{sum(v) / len(v):.2f}" if v else "–" for v in vals))
        rows.append([arm["name"], _mean((data["aggregate"].get(arm["name"]) or {}).get("train_r_image"))] + cells)
    return _table(header, rows)


def r_control_table(data: dict) -> list[str]:
    header = [
        "arm",
        "target",
        "train R 2nd half",
        "R in band (±15%)",
        "held-out eval R",
        "eval R error (vs target)",
        "within 5%",
        "R on the prefill prompt",
    ]
    prefill = data["prefill"].get("arms") or {}
    rows = []
    for arm in data["arms"]:
        if not arm["targets"]:
            continue
        a = data["aggregate"].get(arm["name"]) or {}
        err = a.get("eval_r_err")
        within = "–" if not err else ("yes" if all(v <= 0.05 for v in err["values"]) else "no")
        rows.append(
            [
                arm["name"],
                _targets(arm),
                _triple(a, "train_"),
                _stat(a.get("r_in_band"), 0, pct=True),
                _triple(a, "eval_"),
                _stat(err, 1, pct=True),
                within,
                _mean({"mean": prefill[arm["name"]]["eval_r"]}) if arm["name"] in prefill else "–",
            ]
        )
    return _table(header, rows)


def claims_section(data: dict) -> list[str]:
    lines = []
    for claim in data["claims"]:
        mark = "**" if claim["verdict"] == REPRODUCED else ""
        lines += ["", f"### {claim['paper']}: {claim['claim']}", "", f"Verdict: {mark}{claim['verdict']}{mark}", ""]
        rows = []
        for c in claim["comparisons"]:
            op = ">" if c["expect"] == "higher" else "<"
            what = f"{c['a']} {c['a_metric']} {op} {c['b']} {c['b_metric']}"
            gap = "–" if c["gap"] is None else f"{c['gap']:+.4f}"
            spread = "–" if c["spread"] is None else f"{c['spread']:.4f}"
            verdict = c["verdict"] + (" (informational)" if c["informational"] else "")
            rows.append(
                [
                    what,
                    _stat(c["a_stats"], 4),
                    _stat(c["b_stats"], 4),
                    gap,
                    spread,
                    verdict,
                    "; ".join(c["notes"]) or "",
                ]
            )
        lines += _table(["comparison", "A", "B", "gap (claimed direction)", "spread", "verdict", "notes"], rows)
    if data["claims_not_in_this_selection"]:
        lines += ["", f"Not judged (an arm not in this selection): {', '.join(data['claims_not_in_this_selection'])}."]
    return lines


def match_table(data: dict) -> list[str]:
    header = [
        "arm",
        "strategy",
        "chunking",
        "changed fields (model.overrides)",
        "params Δ",
        "linear FLOPs/token Δ",
        "attention FLOPs ×",
        "KV cache ×",
        "within 2%",
        "note",
    ]
    rows = []
    for arm in data["arms"]:
        r = arm["match_report"]
        fields = ", ".join(f"{k}={v}" for k, v in arm["overrides"].items()) or "(the baseline)"
        rows.append(
            [
                arm["name"],
                str(arm["strategy"] or "–"),
                arm["chunking"],
                fields,
                f"{100 * r['params_mismatch']:+.2f}%",
                f"{100 * r['flops_linear_mismatch']:+.2f}%",
                f"{r['attn_flops_ratio']:.2f}",
                f"{r['kv_cache_ratio']:.2f}",
                "yes" if r["within_tolerance"] else "NO",
                arm.get("note") or "",
            ]
        )
    return _table(header, rows)


def seeds_lines(data: dict) -> list[str]:
    want = data["seeds_requested"]
    fewer = {a: s for a, s in data["seeds_by_arm"].items() if len(s) < want}
    if not fewer:
        return [f"Every arm has all {want} seed(s)."]
    listed = ", ".join(f"{a} ({len(s)})" for a, s in fewer.items())
    lines = [f"Arms with fewer than the {want} seed(s) asked for (finished seeds in brackets): {listed}."]
    outcomes = (data.get("invocation") or {}).get("outcomes") or {}
    failed = sorted(k for k, v in outcomes.items() if v == "failed")
    budget = sorted(k for k, v in outcomes.items() if v == "budget")
    if failed:
        lines.append(f"Failed in the last invocation (see their train.log / eval.log): {', '.join(failed)}.")
    if budget:
        lines.append(f"Not started, budget spent: {', '.join(budget)}.")
    return lines


def commands_lines(data: dict, study: dict) -> list[str]:
    cmd = data["invocation"].get("command")
    lines = ["The study (this doc, study.json, the plots):", "", "```", cmd or "(not recorded)", "```"]
    runs = data.get("commands") or {}
    if runs.get("train"):
        lines += [
            "",
            f"Each run, e.g. `{runs['run']}` (every run's own in its result.json): training, then "
            "lmms-eval, then `eval.r_report.write_report` and `eval.score_table.write_table` on its `eval/` "
            "folder:",
            "",
            "```",
            *(shlex.join(cmd) for cmd in runs.get("stages") or ()),
            shlex.join(runs["train"]),
            shlex.join(runs["eval"]),
            "```",
        ]
    if data["prefill"].get("command"):
        lines += ["", "Prefill phase:", "", "```", shlex.join(data["prefill"]["command"]), "```"]
    built = [
        f"`{shlex.join(e['command'])}`"
        if "creates" in e
        else f"`scripts/make_shards.py {shlex.join(e['build'])} --out {e['dir']}`"
        for e in data_sets(study)
    ]
    evals = f"`scripts/make_eval_data.py --out {study['eval']['tasks_dir']} {shlex.join(study['eval']['build'])}`"
    return lines + ["", f"Data (built only when missing): {'; '.join([*built, evals])}."]


def render(data: dict, study: dict, links: dict, notes: str | None, notes_path: str | None) -> str:
    lines = [
        f"# {study.get('title') or DEFAULT_TITLE}",
        "",
        f"> Generated by `scripts/study.py` on {data['generated']} from the files under `{data['out']}` (all "
        "numbers: study.json there). Do not edit by hand: `--report-only` rebuilds it. ConceptMoE: arXiv 2601.21420.",
        "",
        notes.rstrip() if notes else NOTES_MARK.format(path=notes_path or "a notes file"),
        "",
        "## Setup",
        "",
        *setup_lines(data),
        "",
        "## Results",
        "",
        *results_table(data),
        "",
        results_legend(data),
        "",
        "## Eval-mode R per task (lmms-eval prompts)",
        "",
        *task_r_table(data),
        "",
        "## R against its target",
        "",
        *r_control_table(data),
        "",
        "## Claims",
        "",
        "Rule: with at least 2 seeds per side, reproduced when the mean gap in the claimed direction exceeds the "
        "spread (the larger std over seeds), not reproduced when the opposite gap does, else inconclusive at this "
        "scale; a task score at or below chance on either side makes the comparison inconclusive.",
        *claims_section(data),
        "",
        "## Plots",
        "",
        *plot_lines(data, links),
    ]
    lines += ["## Match report", "", *match_table(data), "", "## Commands", "", *commands_lines(data, study), ""]
    return "\n".join(lines)


def _ran_settings(data: dict) -> tuple[dict, dict]:
    """The train and data settings the runs used (their train.yaml), not what the config says now."""
    tb = data["train_base"]
    train, dat = tb.get("train") or {}, tb.get("data") or {}
    if data["run_settings"]:
        ran = data["run_settings"][0]
        train = {k.removeprefix("train."): v for k, v in ran.items() if k.startswith("train.")}
        dat = {k.removeprefix("data."): v for k, v in ran.items() if k.startswith("data.")}
    return train, dat


def setup_lines(data: dict) -> list[str]:
    train, dat = _ran_settings(data)
    n = len(data["run_settings"])
    mixed = "" if n < 2 else f" **The runs differ in their settings** ({n} variants: study.json run_settings)."
    stages = data.get("stages") or []
    staged = [
        "- Stages before the last, each from the export of the one before (the first builds the arm's model): "
        + "; ".join(f"`{s['name']}` {s['max_steps']} steps on {', '.join(s['shards'])}" for s in stages)
        + ". The last stage:"
    ]
    return [
        f"- Baseline `{data['baseline']}` (`chunking: none`); every other arm is `vlm.accounting.flops.match` of it "
        f"(match report below), from the chunking settings {data['chunked_defaults']}.",
        *(staged if stages else []),
        f"- Training (`scripts/train_vlm.py`, one process): {train.get('max_steps')} steps, batch "
        f"{dat.get('batch_size')} rows of {dat.get('seq_len')} tokens, lr {train.get('lr')}, warmup "
        f"{train.get('warmup')}; held-out evaluation on {train.get('eval_batches')} eval batches at the end.{mixed}",
        f"- lmms-eval: {', '.join(data['eval']['tasks'])}, `--limit {data['eval']['limit']}`.",
        f"- {' '.join(seeds_lines(data))}",
    ]


def results_legend(data: dict) -> str:
    pf = data["prefill"]
    return (
        "Mean ± std over seeds (n − 1); R triples are means. Train LM loss: mean `lm_loss` over the last 10% of steps. "
        "Held-out: the run's final evaluation on the eval shards (eval mode, no noise). lmms-eval R: token-weighted "
        "over the prompts of all tasks. Train R: mean per-step R over the second half of training (train mode). R in "
        f"band: share of those steps within ±{100 * data['r_band']:g}% of the target (per-modality targets: text and "
        f"image each within band of its own). Prefill: {pf.get('tokens', '–')}"
        f"-token text prompt, median of {pf.get('repeats', '–')}, 1 thread, the seed-0 export against the baseline's "
        "in the same rounds (the baseline's own row: it against itself, the noise of the measurement). Train s: sum "
        "of per-step times / the training subprocess's wall time (its last attempt; start-up, evaluation, checkpoints "
        "and export included; concurrent runs share the cores)."
    )


def plot_lines(data: dict, links: dict) -> list[str]:
    titles = {
        "loss": "Training loss per arm",
        "r_modality": f"R per modality over training ({data['plots_r_arm']})",
        "r_control": "Per-step R against the target (the arms of the YAML's plots.r_control)",
        "score_vs_r": "Score against R",
    }
    lines = []
    for key, title in titles.items():
        if key in links:
            lines += [f"![{title}]({links[key]})", ""]
    return lines
