"""Tokens per image and how far each image is shrunk, per evaluation task, at one or more image budgets.

    python scripts/image_budget.py [--tasks-dir eval/tasks] [--tasks cmoe_longdoc,cmoe_niah] [--max-patches 64,256]

Prints a markdown table: per task and budget the LM tokens per image and per doc, the linear scale each image is
drawn at (1.0: native) and, for pages drawn at a known font size, the height of a line of print in pixels after
the resize. Reads the tasks' data as scripts/make_eval_data.py writes it (image headers only); see
eval/image_budget.py. Bad input: exit code 2 and a one-line message.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eval.eval_data import DEFAULT_OUT
from eval.image_budget import budget_rows, markdown


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tasks-dir", default=str(DEFAULT_OUT), help="folder of the task folders (default: %(default)s)"
    )
    parser.add_argument("--tasks", default=None, help="comma-separated task names (default: every task with data)")
    parser.add_argument("--max-patches", type=_ints, default=[64], help="budgets, comma-separated (default: 64)")
    parser.add_argument(
        "--pixel-shuffle", type=int, default=2, help="patches merged per side into a token (default: 2)"
    )
    args = parser.parse_args(argv)
    root = Path(args.tasks_dir)
    names = (
        args.tasks.split(",") if args.tasks else sorted(p.parent.parent.name for p in root.glob("*/data/test.jsonl"))
    )
    if not names:
        print(f"image_budget: error: no task data under {root} (python scripts/make_eval_data.py)", file=sys.stderr)
        return 2
    try:
        rows = [row for name in names for row in budget_rows(root / name, args.max_patches, args.pixel_shuffle)]
    except ValueError as err:
        print(f"{err}", file=sys.stderr)
        return 2
    print(markdown(rows), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
