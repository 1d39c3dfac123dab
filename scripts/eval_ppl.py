"""Text-only perplexity / bits per token / bits per byte on the held-out local corpus (see eval/ppl.py).

python scripts/eval_ppl.py CHECKPOINT_DIR [--seq-len 1024] [--batch-size 4] [--max-docs N] [--out ppl.json] [--quiet]

A progress bar of the batches goes to stderr when it is a terminal; --quiet drops it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eval.ppl import evaluate_ppl


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pretrained", help="a folder with ConceptMoEVLM + VLMProcessor save_pretrained output")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-docs", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_bars = hf_logging.is_progress_bar_enabled()  # transformers' own ("Loading weights"): off with --quiet too
    if args.quiet:
        hf_logging.disable_progress_bar()
    try:
        result = evaluate_ppl(
            args.pretrained, args.seq_len, args.batch_size, args.max_docs, args.device, show_progress=not args.quiet
        )
    except (OSError, ValueError) as err:
        print(f"eval_ppl: error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    finally:
        if hf_bars:
            hf_logging.enable_progress_bar()
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
