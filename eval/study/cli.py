"""The command line of the study (``scripts/study.py``, ``make study``).

    python scripts/study.py [--config scripts/configs/study.yaml] [--out runs/study] [--budget-minutes M]
        [--arms a,b,...] [--seeds N] [--jobs 2] [--quick] [--report-only] [--doc PATH] [--set key=value ...] [--quiet]

Steps: the config (``eval.study.config``); the arms, matched and their match reports printed, any arm not
compute-matched refused (``eval.study.arms``); the data when missing; every (arm, seed) trained and evaluated
(``eval.study.runner``); the prefill phase; ``study.json``, the doc and the plots (``eval.study.report``).
``--report-only`` does only the last step, from the files already there. A config fault or an unmatched arm is one
line on stderr and exit code 2; a run that failed leaves exit code 1 (the report is still written).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from eval.study.arms import ArmError, build_arms, format_report
from eval.study.config import StudyConfigError, load_study_config, select_arms

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "scripts" / "configs" / "study.yaml"  # the main study


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="the study YAML (default: scripts/configs/study.yaml)")
    p.add_argument("--out", default=None, help="output folder (default: the config's out; --quick: its quick.out)")
    p.add_argument("--budget-minutes", type=float, default=None, help="start no run after this many minutes")
    p.add_argument("--arms", default=None, help="comma-separated arms (default: all; the baseline always runs)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per arm (default: the config's seeds)")
    p.add_argument("--jobs", type=int, default=None, help="concurrent runs (default: the config's jobs)")
    p.add_argument("--quick", action="store_true", help="the config's quick block: a few minutes, for the test")
    p.add_argument("--report-only", action="store_true", help="rebuild study.json, the doc and plots from the files")
    p.add_argument("--doc", default=None, help="the doc to write (default: the config's doc; --quick: OUT/study.md)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a study config field")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars (the runs' bar, make_shards')")
    return p.parse_args(argv)


def doc_paths(study: dict, doc: str | None) -> tuple[Path, Path]:
    """(the doc, the plots folder): ``--doc`` (plots beside it, in a folder of its stem), else the config's; with
    ``--quick`` both under OUT, so a quick run never touches ``docs/``."""
    if doc:
        return Path(doc), Path(doc).with_suffix("")
    if study["quick"]:
        return Path(study["out"]) / "study.md", Path(study["out"])
    return Path(study.get("doc", "docs/study.md")), Path(study.get("plots_dir", "docs/study"))


def main(argv: list[str] | None = None) -> int:
    from eval.study import report, runner

    args = parse_args(argv)
    try:
        study = load_study_config(args.config, args.set, quick=args.quick, out=args.out)
        if args.seeds is not None:
            if args.seeds < 1:
                raise StudyConfigError(f"--seeds must be >= 1, got {args.seeds}")
            study["seeds"] = args.seeds
        specs = select_arms(study, [a for a in args.arms.split(",") if a] if args.arms else None)
        arms = build_arms(study, specs)
    except (StudyConfigError, ArmError) as err:
        print(f"study: error: {err}", file=sys.stderr)
        return 2
    log = runner.Log(Path(study["out"]) / "study.log")
    command = shlex.join(["python", "scripts/study.py", *(sys.argv[1:] if argv is None else argv)])
    log(f"$ {command}")
    for arm in arms:
        log(f"match: {format_report(arm)}")
    outcomes = None
    if not args.report_only:
        runner.ensure_data(study, log, quiet=args.quiet)
        jobs = args.jobs if args.jobs is not None else int(study.get("jobs", 2))
        try:
            budget = args.budget_minutes if args.budget_minutes is not None else study.get("budget_minutes")
            outcomes = runner.run_all(study, arms, study["seeds"], jobs, budget, log, show_progress=not args.quiet)
            runner.run_prefill(study, arms, log)
        except KeyboardInterrupt:
            log("interrupted: the same command resumes (finished runs are kept, the others resume)")
            return 130
    doc, plots_dir = doc_paths(study, args.doc)
    context = {"command": command, "outcomes": outcomes, "notes": study.get("notes")}
    data = report.write(study, arms, doc, plots_dir, context)
    for claim in data["claims"]:
        log(f"claim {claim['id']} ({claim['paper']}): {claim['verdict']}")
    log(f"wrote {doc}, {Path(study['out']) / 'study.json'} and the plots under {plots_dir}")
    return 1 if outcomes and "failed" in outcomes.values() else 0
