"""Compression-ratio report (R total / text / image) of a training run or an evaluation output folder.

    python scripts/r_report.py RUN_DIR_OR_JSONL [--out DIR] [--target-r 2]

Writes DIR/r_report.json and DIR/r_report.png (default DIR: the run folder, or the JSONL file's folder).
Reads RUN_DIR/metrics.jsonl (one record per optimiser step) and/or per-sample evaluation records with
lmms-eval's *_results.json for task scores; see eval/r_report.py. Bad input: exit code 2 and a one-line message.
Steps with a NaN / inf loss or R (or skipped by the trainer for one) are never dropped silently: a warning line on
stderr names them, and r_report.json counts them (nonfinite_steps, train.nonfinite_at / nonfinite_by_key, warnings).
"""

from __future__ import annotations

import argparse
import logging
import sys

from eval.r_report import ReportInputError, write_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="a run folder (metrics.jsonl), an evaluation output folder, or one JSONL file")
    parser.add_argument("--out", default=None, help="output folder (default: the run folder or the JSONL's folder)")
    parser.add_argument("--target-r", type=float, default=None, help="target R drawn dashed (default: from the log)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        write_report(args.path, out_dir=args.out, target_r=args.target_r)
    except (ReportInputError, OSError) as e:
        print(f"r_report: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
