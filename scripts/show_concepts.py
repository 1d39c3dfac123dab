"""Show which tokens a ConceptMoE VLM merges into concepts: text spans and image regions, as a PNG (and HTML).

    python scripts/show_concepts.py --model DIR --image IMG [--image IMG ...] --text "..." [--chat] --out PATH.png
    python scripts/show_concepts.py --model DIR --shards 'data/demo/tasks/eval/*.tar' --index K --out PATH.png

``DIR`` is an exported model folder (``ConceptMoEVLM`` + ``VLMProcessor``, e.g. ``runs/demo/stage2/hf``). ``--text``
holds one ``<image>`` marker per image where it goes; missing markers are prepended. ``--chat`` wraps the text as a
user turn through the processor's chat template (with the assistant header, as eval/lmms_plugin.py prompts).
``--shards``/``--index``: the K-th sample (0-based, reading order) of webdataset shards, encoded as the training
loader encodes it. ``--max-patches`` / ``--image-chunking`` override the saved image budget / scan order (to see what
the trained router makes of them). Writes PATH.png, and PATH.html beside it with ``--html`` or when the input holds
more than ``HTML_TOKENS`` tokens; prints one summary line (paths, R total / text / image). See eval/concepts.py (the
data) and eval/concepts_plot.py (the pictures). Bad input: exit status 2 and a one-line message.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HTML_TOKENS = 400


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="exported model folder (model + processor)")
    parser.add_argument("--image", action="append", default=[], help="an image file (repeat for several)")
    parser.add_argument("--text", default="", help="the text, with <image> markers where the images go")
    parser.add_argument("--chat", action="store_true", help="wrap the text as a user turn (chat template)")
    parser.add_argument("--shards", default=None, help="webdataset shards (path, glob, brace pattern) instead")
    parser.add_argument("--index", type=int, default=0, help="which sample of --shards (0-based)")
    parser.add_argument("--out", default="concepts.png", help="the PNG to write (default: concepts.png)")
    parser.add_argument("--html", action="store_true", help="also write the HTML page (PATH.html)")
    parser.add_argument("--max-patches", type=int, default=None, help="image patch budget (default: the saved one)")
    parser.add_argument("--image-chunking", default=None, help="override the image scan order (vlm/image_scan.py)")
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    args = parser.parse_args(argv)
    if args.shards and (args.image or args.text):
        parser.error("give --shards/--index, or --image/--text, not both")
    if not args.shards and not (args.image or args.text):
        parser.error("nothing to show: give --text and/or --image, or --shards with --index")
    return args


def summary(cmap, png: Path, page: Path | None) -> str:
    r = lambda v: "n/a" if v is None else f"{v:.4f}"
    where = f"{png}" + (f" + {page}" if page else "")
    s = cmap.stats
    return (
        f"{where}: R {r(s['r'])} text {r(cmap.r(0))} image {r(cmap.r(1))} "
        f"({s['tokens']} tokens, {s['concepts']} concepts, {cmap.open_tail} in the open tail)"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    from transformers.utils import logging as hf_logging

    from eval.concepts import concept_map, concept_map_for_sample, open_image_file, with_image_markers
    from eval.concepts_plot import draw_concepts, write_html
    from vlm import ConceptMoEVLM, VLMProcessor

    hf_logging.disable_progress_bar()  # the output is one line
    try:
        if not Path(args.model, "config.json").is_file():
            raise ValueError(f"--model {args.model}: no config.json (not an exported model folder)")
        processor = VLMProcessor.from_pretrained(args.model)
        if args.max_patches is not None:
            processor.image_processor.max_patches = args.max_patches
        model = ConceptMoEVLM.from_pretrained(args.model).to(torch.device(args.device)).eval()
        if args.image_chunking is not None:
            model.set_chunking(image_chunking=args.image_chunking)
        if args.shards:
            cmap = concept_map_for_sample(model, processor, args.shards, args.index)
        else:
            images = [open_image_file(path) for path in args.image]
            text = with_image_markers(args.text, len(images))
            if args.chat:
                messages = [{"role": "user", "content": text}]
                text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            source = ", ".join(Path(p).name for p in args.image) or "text"
            cmap = concept_map(model, processor, text, images, source=source)
        png = draw_concepts(cmap, args.out)
        page = None
        if args.html or len(cmap.pieces) > HTML_TOKENS:
            page = write_html(cmap, Path(args.out).with_suffix(".html"), png=png)
    except (ValueError, OSError) as err:
        print(f"show_concepts: error: {err}".splitlines()[0], file=sys.stderr)
        raise SystemExit(2) from None
    print(summary(cmap, png, page))


if __name__ == "__main__":
    main()
