"""Held-out loss of one or more saved exports on the same shards (which stage of a recipe kept what).

    python scripts/eval_shards.py EXPORT [EXPORT ...] --shards DIR_OR_PATTERN [--shards ...] [--seq-len 512]
        [--batch-size 4] [--batches 8] [--max-patches N] [--out FILE.json]

Reads the shards with the training loader (same encoding, loss mask and packing; no shuffling: every export sees
the same batches) and prints a markdown table: loss (nats per predicted token), bits per token, tokens scored and
eval-mode R total / text / image per export; see vlm/training/held_out.py. Bad input: exit code 2 and a one-line
message.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exports", nargs="+", help="folders with ConceptMoEVLM + VLMProcessor save_pretrained output")
    parser.add_argument("--shards", action="append", required=True, help="a shard folder, file or brace pattern")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--batches", type=int, default=8, help="batches scored (default: %(default)s)")
    parser.add_argument("--max-patches", type=int, default=None, help="image budget (default: each export's own)")
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    from vlm.training.held_out import held_out_loss, markdown

    rows = []
    try:
        for export in args.exports:
            rows.append(
                held_out_loss(export, args.shards, args.seq_len, args.batch_size, args.batches, args.max_patches)
            )
    except (ValueError, OSError) as err:
        print(f"eval_shards: error: {err}", file=sys.stderr)
        return 2
    if args.out:
        with open(args.out, "w") as f:
            json.dump([r.as_dict() for r in rows], f, indent=1)
    print(markdown(rows), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
