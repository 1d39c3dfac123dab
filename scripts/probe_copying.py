"""Can the language model copy? Train the backbone alone on rows that repeat a random sequence; score the copy.

    python scripts/probe_copying.py --max-gap 0 --steps 400                                   # a fixed distance
    python scripts/probe_copying.py --max-gap 32 --steps 2000 --set tie_word_embeddings=true   # content-addressed

Each row: ``--length`` random tokens, a gap of 0..``--max-gap`` random tokens, the same tokens again, random tokens
after; the loss and the score are on the second copy. Prints one JSON line per evaluation (held-out accuracy on the
copied tokens, chance) and, with ``--out``, appends them there. The logic is ``vlm.training.copy_probe``; the rows
of docs/seeing.md ("Copying a needle") come from this command.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, fields
from pathlib import Path

from vlm.training.copy_probe import CopyProbeConfig, check_config, run
from vlm.training.probe import parse_overrides


def main(argv=None) -> int:
    defaults = CopyProbeConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default=defaults.preset, help="tiny-moe (no chunking) or tiny (ConceptMoE)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=JSON", help="a backbone override")
    for f in fields(CopyProbeConfig):
        if f.name not in ("preset", "overrides"):
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(getattr(defaults, f.name)))
    parser.add_argument("--out", type=Path, help="append the JSON lines to this file")
    args = parser.parse_args(argv)
    try:
        overrides = parse_overrides(args.set)
    except ValueError as err:
        parser.error(str(err))
    given = {k: v for k, v in vars(args).items() if k not in ("preset", "set", "out") and v is not None}
    cfg = CopyProbeConfig(preset=args.preset, overrides=overrides, **given)
    try:
        check_config(cfg)
    except ValueError as err:
        parser.error(str(err))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)

    def report(score) -> None:
        print(json.dumps(asdict(score)), flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps({"config": asdict(cfg), **asdict(score)}) + "\n")

    try:
        run(cfg, report)
    except ValueError as err:  # e.g. an unknown backbone field in --set: one line, not a traceback
        parser.error(str(err))
    return 0


if __name__ == "__main__":
    sys.exit(main())
