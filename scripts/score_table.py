"""Score table of an lmms-eval output folder: per task and metric the score, its chance level and the task's R.

    python scripts/score_table.py EVAL_OUTPUT_DIR [--tasks-dir eval/tasks] [--out FILE.md]

Prints a markdown table (task, metric, score, chance, R total, R text, R image) and writes it to
EVAL_OUTPUT_DIR/score_table.md (+ score_table.json). Scores: the newest *_results.json under the folder; chance:
TASKS_DIR/<task>/data/manifest.json (scripts/make_eval_data.py); R: r_report.json (scripts/r_report.py), else the
plugin's r_stats_<task>.jsonl. See eval/score_table.py. Bad input: exit code 2 and a one-line message.
"""

from __future__ import annotations

import argparse
import logging
import sys

from eval.eval_data import DEFAULT_OUT
from eval.r_report_io import ReportInputError
from eval.score_table import write_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("eval_dir", help="lmms-eval's --output_path folder")
    parser.add_argument(
        "--tasks-dir", default=str(DEFAULT_OUT), help="folder of the task folders with data/ (default: %(default)s)"
    )
    parser.add_argument("--out", default=None, help="markdown file (default: EVAL_OUTPUT_DIR/score_table.md)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(write_table(args.eval_dir, args.tasks_dir, args.out), end="")
    except (ReportInputError, OSError) as err:
        print(f"score_table: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
