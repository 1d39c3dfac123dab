"""Generate the local evaluation data of the lmms-eval tasks (cmoe_longdoc, cmoe_niah, cmoe_refloc, cmoe_sceneqa,
cmoe_sceneqa_one).

    python scripts/make_eval_data.py [--out eval/tasks] [--seed 0] [--tasks cmoe_niah,...] [sizes ...]

Writes OUT/<task>/data/{test.jsonl,images/,manifest.json} (the manifest with the task's chance levels, see
eval/chance.py). OUT defaults to eval/tasks relative to the current directory: run from the repository root, that
is the project's own task folder (`lmms-eval --include_path eval/tasks`); anywhere else, and for any other --out,
the task YAML and utils.py are copied next to the data, so that `lmms-eval --include_path OUT` works on its own.
With --keep a task whose data was built with the same options (its manifest's) and is intact is left as it is:
`make demo` runs it every time, and data of other sizes, or a seed, is rebuilt.
Nothing is written into the installed package. See eval/eval_data.py.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from eval.eval_data import DEFAULT_OUT, LONGDOC_PAGES, NIAH_LENGTHS, TASKS, write_eval_sets


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        default=str(DEFAULT_OUT),
        help="folder of the task folders, relative to the current directory (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated subset of {','.join(TASKS)}")
    parser.add_argument("--longdoc-per-bucket", type=int, default=20, help="documents per page count")
    parser.add_argument("--longdoc-pages", type=_ints, default=list(LONGDOC_PAGES), help="page counts, e.g. 1,4,16")
    parser.add_argument("--niah-per-bucket", type=int, default=44, help="haystacks per length (22 = one grid)")
    parser.add_argument("--niah-lengths", default=",".join(NIAH_LENGTHS), help="subset of short,medium,long")
    parser.add_argument("--refloc-n", type=int, default=200, help="scenes (one expression each)")
    parser.add_argument("--sceneqa-n", type=int, default=200, help="scenes (one question per type each)")
    parser.add_argument("--sceneqa-one-n", type=int, default=200, help="one-object scenes (cmoe_sceneqa_one)")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="leave a task's data alone when it was built with these same options and is intact (else rebuild it)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.time()
    try:
        manifests = write_eval_sets(
            args.out,
            seed=args.seed,
            tasks=[t for t in args.tasks.split(",") if t],
            longdoc_per_bucket=args.longdoc_per_bucket,
            longdoc_pages=args.longdoc_pages,
            niah_per_bucket=args.niah_per_bucket,
            niah_lengths=[n for n in args.niah_lengths.split(",") if n],
            refloc_n=args.refloc_n,
            sceneqa_n=args.sceneqa_n,
            sceneqa_one_n=args.sceneqa_one_n,
            keep=args.keep,
        )
    except ValueError as err:
        print(f"make_eval_data: error: {err}", file=sys.stderr)
        return 2
    for task, m in manifests.items():
        print(f"{task}: {m['docs']} docs -> {args.out}/{task}/data/test.jsonl")
    print(f"done in {time.time() - start:.1f}s; run: lmms-eval --model conceptmoe --include_path {args.out} ...")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
