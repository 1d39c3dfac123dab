"""Verdicts on the claims of ConceptMoE (arXiv 2601.21420) the study tests, computed from the collected numbers.

A claim (``study.yaml`` ``claims``) is a list of comparisons "arm A's metric is higher / lower than arm B's"
(``b_metric``: another metric of B, e.g. image R against text R within one arm). Per comparison, with the per-arm
mean ± std over seeds of ``eval.study.collect.aggregate``:

- ``gap``: the mean difference in the claimed direction (positive: the claim's direction);
- ``spread``: the larger of the two sides' std over seeds;
- verdict: fewer than 2 seeds on a side: ``inconclusive (1 seed)``; a task score at or below its chance level on
  either side: ``inconclusive (at or below chance)``; else ``reproduced`` when ``gap > spread``, ``not reproduced``
  when ``-gap > spread``, and ``inconclusive at this scale`` otherwise. A side without numbers: ``not run``.

The claim's verdict: ``reproduced`` / ``not reproduced`` when every counted comparison says so; ``not reproduced
(k of n ...)`` or ``reproduced on k of n comparisons`` when the others are inconclusive; ``mixed`` when some are
reproduced and some not; ``not run`` when none ran; else ``inconclusive`` with the comparisons' reasons.
``informational`` comparisons are shown only.
"""

from __future__ import annotations

REPRODUCED, NOT_REPRODUCED, NOT_RUN = "reproduced", "not reproduced", "not run"
ONE_SEED, AT_CHANCE = "inconclusive (1 seed)", "inconclusive (at or below chance)"
SMALL_GAP = "inconclusive at this scale"


def compare(comp: dict, arms: dict, chance: dict) -> dict:
    """One comparison's numbers and verdict. ``arms``: arm -> metric -> aggregate; ``chance``: arm -> metric ->
    chance level (None where the metric has none)."""
    a_metric, b_metric = comp["metric"], comp.get("b_metric", comp["metric"])
    a = (arms.get(comp["a"]) or {}).get(a_metric)
    b = (arms.get(comp["b"]) or {}).get(b_metric)
    row = {
        "a": comp["a"],
        "a_metric": a_metric,
        "b": comp["b"],
        "b_metric": b_metric,
        "expect": comp["expect"],
        "informational": bool(comp.get("informational")),
        "a_stats": a,
        "b_stats": b,
        "notes": [],
    }
    if a is None or b is None:
        return {**row, "gap": None, "spread": None, "verdict": NOT_RUN}
    sign = 1.0 if comp["expect"] == "higher" else -1.0
    gap = sign * (a["mean"] - b["mean"])
    stds = [s["std"] for s in (a, b) if s["std"] is not None]
    spread = max(stds) if len(stds) == 2 else None
    for arm, metric, stats in ((comp["a"], a_metric, a), (comp["b"], b_metric, b)):
        level = (chance.get(arm) or {}).get(metric)
        if level is not None and stats["mean"] <= level + 1e-9:
            row["notes"].append(f"{arm} {metric} {stats['mean']:.3f} is at or below chance ({level:.3f})")
    if min(a["n"], b["n"]) < 2:
        verdict = ONE_SEED
    elif row["notes"]:
        verdict = AT_CHANCE
    elif gap > spread:
        verdict = REPRODUCED
    elif -gap > spread:
        verdict = NOT_REPRODUCED
    else:
        verdict = SMALL_GAP
    return {**row, "gap": gap, "spread": spread, "verdict": verdict}


def claim_verdict(rows: list[dict]) -> str:
    """The claim's verdict from its counted comparisons (see the module docstring): reproduced / not reproduced when
    all of them agree; a partial or mixed verdict names how many of each; else inconclusive, with the reasons."""
    counted = [r["verdict"] for r in rows if not r["informational"]]
    n, yes, no = len(counted), counted.count(REPRODUCED), counted.count(NOT_REPRODUCED)
    if counted and yes == n:
        return REPRODUCED
    if no and not yes:
        return NOT_REPRODUCED if no == n else f"{NOT_REPRODUCED} ({no} of {n} comparisons; the rest inconclusive)"
    if yes and no:
        return f"mixed ({yes} of {n} comparisons reproduced, {no} not)"
    if all(v == NOT_RUN for v in counted):
        return NOT_RUN
    reasons = {v.removeprefix("inconclusive").strip(" ()") for v in counted if v.startswith("inconclusive")}
    reasons |= {"some arms not run"} if NOT_RUN in counted else set()
    reasons = "; ".join(sorted(reasons))
    if yes:
        return f"{REPRODUCED} on {yes} of {n} comparisons; the rest inconclusive" + (f" ({reasons})" if reasons else "")
    return "inconclusive" + (f" ({reasons})" if reasons else "")


def judge(claims: list[dict], arms: dict, chance: dict) -> list[dict]:
    """Every claim with its comparisons and verdict."""
    out = []
    for claim in claims:
        rows = [compare(c, arms, chance) for c in claim["compare"]]
        out.append(
            {
                "id": claim["id"],
                "paper": claim.get("paper", ""),
                "claim": claim.get("claim", ""),
                "comparisons": rows,
                "verdict": claim_verdict(rows),
            }
        )
    return out
