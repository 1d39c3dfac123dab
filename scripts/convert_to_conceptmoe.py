"""Convert a local Hugging Face MoE checkpoint into a ConceptMoE checkpoint for continual training (paper §4.3).

    python scripts/convert_to_conceptmoe.py --src HF_DIR --out DIR [--target-r 1.5] [--chunking dynamic|none]
        [--encoder-layers 4] [--decoder-layers 4] [--loop N --loop-layers M] [--top-k K] [--allow-extra]

Supported: OlmoeForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM (see docs/convert.md).
Writes DIR (save_pretrained) and DIR/conversion_report.json, and prints the params / FLOPs table.
Every source tensor the architecture has must be in HF_DIR's *.safetensors with its shape; tensors it does not have
are refused unless --allow-extra (then named in a warning line and in the report). Bad input (unsupported model,
missing / misshapen / unknown tensors, truncated file, unreadable config): exit code 2 and one line
``convert_to_conceptmoe: error: ...`` on stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import NoReturn

from vlm.accounting.convert import convert, format_report, save_conversion


def fail(err: BaseException) -> NoReturn:
    """Exit 2 with one line on stderr: the first line of the error's message."""
    lines = str(err).strip().splitlines()
    print(f"convert_to_conceptmoe: error: {lines[0] if lines else type(err).__name__}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", required=True, help="local HF checkpoint folder of the source MoE")
    parser.add_argument("--out", required=True, help="output folder for the ConceptMoE checkpoint")
    parser.add_argument("--target-r", type=float, default=1.5, help="target compression ratio R (paper CT: 1.5)")
    parser.add_argument("--chunking", choices=("dynamic", "none"), default="dynamic")
    parser.add_argument("--encoder-layers", type=int, default=4, help="first source layers -> encoder")
    parser.add_argument("--decoder-layers", type=int, default=4, help="last source layers -> decoder (joint QKV)")
    parser.add_argument("--loop", type=int, default=1, help="run the middle concept layers N times (strategy 2)")
    parser.add_argument("--loop-layers", type=int, default=0, help="how many middle layers loop (0: all)")
    parser.add_argument("--top-k", type=int, default=None, help="experts per concept in the concept model (S1)")
    parser.add_argument("--seq-len", type=int, default=4096, help="sequence length of the attention FLOPs")
    parser.add_argument(
        "--allow-extra", action="store_true", help="ignore (with a warning) source tensors the architecture lacks"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        conversion = convert(
            args.src,
            target_r=args.target_r,
            chunking=args.chunking,
            encoder_layers=args.encoder_layers,
            decoder_layers=args.decoder_layers,
            loop=args.loop,
            loop_layers=args.loop_layers,
            top_k=args.top_k,
            seq_len=args.seq_len,
            allow_extra=args.allow_extra,
        )
        save_conversion(conversion, args.out)
    except (ValueError, OSError) as e:
        fail(e)
    print(format_report(conversion.report))
    print(f"saved {args.out} (report: {args.out}/conversion_report.json)")


if __name__ == "__main__":
    main()
