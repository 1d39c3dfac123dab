"""Check shards before a long job: ``python -m data_pipelines.check [SHARD...] [--config RUN.yaml] [--json]``.

Reads every sample once through the training loader (``make_dataloader``: same decoding, image limits,
tokenisation and packing, without shuffling) with ``--num-workers`` worker processes (default: up to 4) and prints
two lines: what was read (samples, images, text tokens, rows, shards, seconds) and ONE line of skips by kind.
Each skipped sample is logged (stderr) only with ``--verbose``. ``--json`` prints one object
``{"samples": N, "images": N, "text_tokens": N, "skipped": {kind: N}, "shards": N, "seconds": S}``.

Settings are the training run's: ``--config RUN.yaml`` (a training config: sections model / data / train) gives
``data.shards`` (unless SHARDs are given), ``data.seq_len``, ``data.max_patches`` (the image budget),
``data.tokenizer``, ``data.split_documents`` and ``data.loss_on`` (``--set data.KEY=VALUE`` overrides them as
training's ``--set`` does); a field it lacks, and every option without ``--config``, takes the training default
(``data_pipelines.run_config.DataConfig``). An option given on the command line wins over the config. Shards may
be paths, brace patterns, globs, folders, ``file:`` / ``pipe:`` / ``http(s)://`` specs.

Exit status: 0 when at least one sample was read (skips are reported, not fatal); 1 when none could be read, or,
with ``--strict``, when any sample was skipped (the skip line then ends ``--strict: failed``); 2 for bad arguments
(e.g. a pattern that matches no file, an unreadable config, a tokenizer folder that is not one).

Progress: a bar of the batches read (with the samples and skips so far) on stderr when it is a terminal;
``--quiet`` drops it.

Tokenizer: ``--tokenizer DIR`` (any HF tokenizer folder, or the config's ``data.tokenizer``), else the package's
default tokenizer (``data_pipelines.tokenizer.load_tokenizer``), else, if that cannot be loaded, a byte-level count.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from functools import partial

from tqdm import tqdm

from data_pipelines.loader import loader_from_config
from data_pipelines.packing import LOSS_ON
from data_pipelines.run_config import DataConfig, default_of, read_config, resolve_section
from data_pipelines.schema import MAX_IMAGE_PIXELS, SKIP_KINDS

logger = logging.getLogger("data_pipelines.check")
_default = partial(default_of, DataConfig)
DEFAULT_WORKERS = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
FROM_CONFIG = ("seq_len", "max_patches", "tokenizer", "split_documents", "loss_on")  # besides data.shards


def load_check_tokenizer(path: str | None):
    """The tokenizer at ``path``, else the package default, else ``local_text.ByteTokenizer``."""
    from data_pipelines.tokenizer import load_tokenizer

    if path is not None:
        return load_tokenizer(path)
    try:
        return load_tokenizer()
    except Exception as err:  # module missing, or its files not built: counting bytes still checks the shards
        from data_pipelines.local_text import ByteTokenizer

        logger.warning("default tokenizer unavailable (%s: %s); counting text tokens as bytes", type(err).__name__, err)
        return ByteTokenizer()


def read_data_config(path: str, sets: list[str] = ()) -> dict:
    """The ``data`` section of a training config (``--set`` applied), unchecked; a file that cannot be read,
    malformed YAML or a config without a data section is a one-line ValueError (``ConfigError``)."""
    data = read_config(path, sets).get("data")
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: no 'data' section (a training config has sections model, data, train)")
    return data


def check_shards(
    data: DataConfig,
    tokenizer=None,
    image_processor=None,
    max_image_pixels: int = MAX_IMAGE_PIXELS,
    show_progress: bool = False,
) -> dict:
    """Read every sample of ``data.shards`` once, as training would (``data``'s settings, its ``num_workers``
    workers); returns the loader's counters plus ``shards`` (how many) and ``seconds`` (the time reading took).
    ``show_progress``: a tqdm bar on stderr when it is a terminal."""
    start = time.perf_counter()
    tokenizer = tokenizer if tokenizer is not None else load_check_tokenizer(None)
    loader = loader_from_config(
        data, tokenizer, image_processor, batch_size=8, epochs=1, shuffle=False, max_image_pixels=max_image_pixels
    )
    with tqdm(desc="checking", unit=" batches", disable=None if show_progress else True) as bar:
        counted = lambda c: f"{c['samples']} samples, {sum(c['skipped'].values())} skipped"
        for _ in loader:
            bar.update()
            if not bar.disable:
                bar.set_postfix_str(counted(loader.stats()), refresh=False)
        if not bar.disable:  # skips after the last batch too
            bar.set_postfix_str(counted(loader.stats()))
    return {**loader.stats(), "shards": len(loader.cfg["shards"]), "seconds": round(time.perf_counter() - start, 3)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m data_pipelines.check", description=__doc__.split("\n")[0])
    parser.add_argument("shards", nargs="*", help="shard paths, brace patterns, globs, folders or URLs")
    parser.add_argument("--config", help="a training config (YAML): shards and data settings from its data section")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a --config field")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every skipped sample (stderr)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when any sample was skipped")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--tokenizer", help="HF tokenizer folder (default: data.tokenizer, else the package's)")
    parser.add_argument("--image-processor", help="image processor folder, e.g. an export (default: defaults)")
    parser.add_argument("--seq-len", type=int, help=f"row length (default: data.seq_len, {_default('seq_len')})")
    parser.add_argument("--max-patches", type=int, help=f"image patch budget ({_default('max_patches')})")
    parser.add_argument("--max-image-pixels", type=int, default=MAX_IMAGE_PIXELS)
    parser.add_argument("--split-documents", action=argparse.BooleanOptionalAction, help="as in training")
    parser.add_argument("--loss-on", choices=LOSS_ON, help=f"as in training ({_default('loss_on')})")
    parser.add_argument("--num-workers", "--workers", type=int, default=DEFAULT_WORKERS, help="loader workers")
    return parser.parse_args(argv)


def settings(args: argparse.Namespace) -> DataConfig:
    """Shards and data settings: the command line, else ``--config``'s data section, else ``DataConfig``'s
    defaults; ``num_workers`` is ``--num-workers``."""
    data = read_data_config(args.config, args.set) if args.config else {}
    data.update({name: getattr(args, name) for name in FROM_CONFIG if getattr(args, name) is not None})
    data["shards"] = args.shards or data.get("shards")
    if not data["shards"]:
        raise ValueError("no shards: give SHARD patterns or a --config whose data section names shards")
    return resolve_section(DataConfig, "data", {**data, "num_workers": args.num_workers})


def build_image_processor(path: str | None, max_patches: int):
    """The image processor saved at ``path`` (``max_patches`` overriding it when given), else the training one."""
    from vision_tower import ImageProcessor

    if path:
        return ImageProcessor.from_pretrained(path, **({"max_patches": max_patches} if max_patches else {}))
    return ImageProcessor(max_patches=max_patches)


def report_lines(stats: dict, seq_len: int, num_workers: int, strict: bool = False) -> list[str]:
    """What was read, then the skips by kind (ending ``--strict: failed`` when ``strict`` and any): two lines."""
    skipped = {kind: n for kind, n in stats["skipped"].items() if n}
    kinds = " (" + ", ".join(f"{kind}: {n}" for kind, n in skipped.items()) + ")" if skipped else ""
    kinds += "; --strict: failed" if strict and skipped else ""
    return [
        f"read {stats['samples']} samples, {stats['images']} images, {stats['text_tokens']} text tokens into "
        f"{stats['rows']} rows of {seq_len} ({stats['packing_efficiency']:.1%} filled) from {stats['shards']} "
        f"shards in {stats['seconds']:.1f} s ({num_workers} workers)",
        f"skipped {sum(skipped.values())}{kinds}",
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    skips = logging.getLogger("data_pipelines.loader.skips")
    level = skips.level
    skips.setLevel(logging.DEBUG if args.verbose else logging.ERROR)
    try:
        return run_check(args)
    finally:
        skips.setLevel(level)  # main() may be called in-process: leave the logger as it was


def run_check(args: argparse.Namespace) -> int:
    """Check, print the report; the exit status (see the module docstring)."""
    try:
        run = settings(args)
        max_patches = run.max_patches if args.image_processor is None else args.max_patches
        stats = check_shards(
            run,
            load_check_tokenizer(run.tokenizer),
            build_image_processor(args.image_processor, max_patches),
            max_image_pixels=args.max_image_pixels,
            show_progress=not args.quiet,
        )
    except (OSError, ValueError) as err:
        print(f"error: {str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}", file=sys.stderr)
        return 2
    report = {k: stats[k] for k in ("samples", "images", "text_tokens")}
    report["skipped"] = {kind: stats["skipped"][kind] for kind in SKIP_KINDS}
    report.update(shards=stats["shards"], seconds=stats["seconds"])
    lines = report_lines(stats, run.seq_len, args.num_workers, args.strict)
    print(json.dumps(report) if args.json else "\n".join(lines))
    if report["samples"] == 0:
        print("error: no sample could be read", file=sys.stderr)
        return 1
    skipped = sum(report["skipped"].values())
    if args.strict and skipped:
        if args.json:  # stdout holds the JSON object alone
            print(f"error: --strict: {skipped} samples skipped", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
