"""Convert a local Hugging Face MoE checkpoint into a ConceptMoE checkpoint for continual training (paper §4.3).

    python scripts/convert_to_conceptmoe.py --src HF_DIR --out DIR [--target-r 1.5] [--chunking dynamic|none]
        [--encoder-layers 4] [--decoder-layers 4] [--loop N --loop-layers M] [--top-k K]

Supported: OlmoeForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM (see docs/convert.md).
Writes DIR (save_pretrained) and DIR/conversion_report.json, and prints the params / FLOPs table.
Bad input: exit code 2 and a one-line message.
"""

from __future__ import annotations

import argparse
import logging
import sys

from vlm.accounting.convert import convert, format_report, save_conversion


def main() -> None:
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
    args = parser.parse_args()
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
        )
    except (ValueError, OSError) as e:
        print(f"convert_to_conceptmoe: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    save_conversion(conversion, args.out)
    print(format_report(conversion.report))
    print(f"saved {args.out} (report: {args.out}/conversion_report.json)")


if __name__ == "__main__":
    main()
