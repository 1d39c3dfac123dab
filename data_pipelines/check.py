"""Check shards before a long job: ``python -m data_pipelines.check SHARD_OR_GLOB... [--json] [--tokenizer DIR]``.

Reads every sample once through the training loader (``make_dataloader``: same decoding, image limits,
tokenisation and packing, without shuffling) and reports samples read, text tokens, images and skips by kind.
``--json`` prints one object ``{"samples": N, "images": N, "text_tokens": N, "skipped": {kind: N}}``.

Exit status: 0 when at least one sample was read (skips are reported, not fatal); 1 when none could be read;
2 for bad arguments (e.g. a pattern that matches no file).

Tokenizer: ``--tokenizer DIR`` (any HF tokenizer folder), else the package's default tokenizer
(``data_pipelines.tokenizer.load_tokenizer``), else, if that cannot be loaded, a byte-level count.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from data_pipelines.loader import make_dataloader
from data_pipelines.schema import MAX_IMAGE_PIXELS, SKIP_KINDS

logger = logging.getLogger("data_pipelines.check")


def load_check_tokenizer(path: str | None):
    """The tokenizer at ``path``, else the package default, else ``local_text.ByteTokenizer``."""
    if path is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    try:
        from data_pipelines.tokenizer import load_tokenizer

        return load_tokenizer()
    except Exception as err:  # module missing, or its files not built: counting bytes still checks the shards
        from data_pipelines.local_text import ByteTokenizer

        logger.warning("default tokenizer unavailable (%s: %s); counting text tokens as bytes", type(err).__name__, err)
        return ByteTokenizer()


def check_shards(
    shards,
    tokenizer=None,
    image_processor=None,
    seq_len: int = 1024,
    max_image_pixels: int = MAX_IMAGE_PIXELS,
    split_documents: bool = False,
    num_workers: int = 0,
) -> dict:
    """Read every sample of ``shards`` once, as training would; returns the loader's counters."""
    tokenizer = tokenizer if tokenizer is not None else load_check_tokenizer(None)
    loader = make_dataloader(
        shards,
        tokenizer,
        image_processor=image_processor,
        seq_len=seq_len,
        batch_size=8,
        num_workers=num_workers,
        epochs=1,
        shuffle=False,
        max_image_pixels=max_image_pixels,
        split_documents=split_documents,
    )
    for _ in loader:
        pass
    return loader.stats()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data_pipelines.check", description=__doc__.split("\n")[0])
    parser.add_argument("shards", nargs="+", help="shard paths, brace patterns, globs or folders")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--tokenizer", help="HF tokenizer folder (default: the package's tokenizer)")
    parser.add_argument("--image-processor", help="image processor folder, e.g. an export (default: defaults)")
    parser.add_argument("--seq-len", type=int, default=1024, help="row length of training (for too_long)")
    parser.add_argument("--max-image-pixels", type=int, default=MAX_IMAGE_PIXELS)
    parser.add_argument("--split-documents", action="store_true", help="as make_dataloader(split_documents=True)")
    parser.add_argument("--workers", type=int, default=0, help="loader worker processes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)

    image_processor = None
    if args.image_processor:
        from vision_tower import ImageProcessor

        image_processor = ImageProcessor.from_pretrained(args.image_processor)
    try:
        stats = check_shards(
            args.shards,
            load_check_tokenizer(args.tokenizer),
            image_processor,
            seq_len=args.seq_len,
            max_image_pixels=args.max_image_pixels,
            split_documents=args.split_documents,
            num_workers=args.workers,
        )
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report = {k: stats[k] for k in ("samples", "images", "text_tokens")}
    report["skipped"] = {kind: stats["skipped"][kind] for kind in SKIP_KINDS}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"samples read:   {report['samples']}")
        print(f"images:         {report['images']}")
        print(f"text tokens:    {report['text_tokens']}")
        print(f"packing:        {stats['rows']} rows of {args.seq_len}, {stats['packing_efficiency']:.1%} filled")
        skipped = sum(report["skipped"].values())
        print(f"skipped:        {skipped}" + "".join(f"\n  {k}: {n}" for k, n in report["skipped"].items() if n))
    if report["samples"] == 0:
        print("error: no sample could be read", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
