"""Check shards before a long job: ``python -m data_pipelines.check [SHARD...] [--config RUN.yaml] [--json]``.

Reads every sample once through the training loader (``make_dataloader``: same decoding, image limits,
tokenisation and packing, without shuffling) with ``--num-workers`` worker processes (default: up to 4) and prints
two lines: what was read (samples, images, text tokens, rows, shards, seconds) and ONE line of skips by kind.
Each skipped sample is logged (stderr) only with ``--verbose``. ``--json`` prints one object
``{"samples": N, "images": N, "text_tokens": N, "skipped": {kind: N}, "shards": N, "seconds": S}``.

Settings are the training run's: ``--config RUN.yaml`` (a training config: sections model / data / train) gives
``data.shards`` (unless SHARDs are given), ``data.seq_len``, ``data.max_patches`` (the image budget),
``data.tokenizer``, ``data.split_documents`` and ``data.loss_on``; a field it lacks, and every option without
``--config``, takes the training default (``data_pipelines.loader.DATA_DEFAULTS``). An option given on the
command line wins over the config. Shards may be paths, brace patterns, globs, folders, ``file:`` / ``pipe:`` /
``http(s)://`` specs.

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

import yaml
from tqdm import tqdm

from data_pipelines.loader import DATA_DEFAULTS, make_dataloader
from data_pipelines.packing import LOSS_ON
from data_pipelines.schema import MAX_IMAGE_PIXELS, SKIP_KINDS

logger = logging.getLogger("data_pipelines.check")
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


def read_data_config(path: str) -> dict:
    """The ``data`` section of a training config, its missing fields filled from ``DATA_DEFAULTS``; a file that
    cannot be read, malformed YAML or an unknown data field is a one-line ValueError."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--config {path}: {getattr(err, 'strerror', None) or err}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"--config {path}: invalid YAML{where}") from None
    data = raw.get("data") if isinstance(raw, dict) else None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: no 'data' section (a training config has sections model, data, train)")
    unknown = sorted(set(data) - set(DATA_DEFAULTS) - {"shards"})
    if unknown:
        raise ValueError(f"--config {path}: unknown field 'data.{unknown[0]}'")
    return {**DATA_DEFAULTS, **data}


def check_shards(
    shards,
    tokenizer=None,
    image_processor=None,
    seq_len: int = DATA_DEFAULTS["seq_len"],
    max_image_pixels: int = MAX_IMAGE_PIXELS,
    split_documents: bool = DATA_DEFAULTS["split_documents"],
    num_workers: int = 0,
    loss_on: str = DATA_DEFAULTS["loss_on"],
    show_progress: bool = False,
) -> dict:
    """Read every sample of ``shards`` once, as training would; returns the loader's counters plus ``shards``
    (how many) and ``seconds`` (the time reading took). ``show_progress``: a tqdm bar on stderr when it is a
    terminal."""
    start = time.perf_counter()
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
        loss_on=loss_on,
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
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every skipped sample (stderr)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when any sample was skipped")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--tokenizer", help="HF tokenizer folder (default: data.tokenizer, else the package's)")
    parser.add_argument("--image-processor", help="image processor folder, e.g. an export (default: defaults)")
    parser.add_argument("--seq-len", type=int, help=f"row length (default: data.seq_len, {DATA_DEFAULTS['seq_len']})")
    parser.add_argument("--max-patches", type=int, help=f"image patch budget ({DATA_DEFAULTS['max_patches']})")
    parser.add_argument("--max-image-pixels", type=int, default=MAX_IMAGE_PIXELS)
    parser.add_argument("--split-documents", action=argparse.BooleanOptionalAction, help="as in training")
    parser.add_argument("--loss-on", choices=LOSS_ON, help=f"as in training ({DATA_DEFAULTS['loss_on']})")
    parser.add_argument("--num-workers", "--workers", type=int, default=DEFAULT_WORKERS, help="loader workers")
    return parser.parse_args(argv)


def settings(args: argparse.Namespace) -> dict:
    """Shards and data settings: the command line, else ``--config``'s data section, else ``DATA_DEFAULTS``."""
    data = read_data_config(args.config) if args.config else dict(DATA_DEFAULTS)
    out = {name: data[name] if getattr(args, name) is None else getattr(args, name) for name in FROM_CONFIG}
    out["shards"] = args.shards or data.get("shards")
    if not out["shards"]:
        raise ValueError("no shards: give SHARD patterns or a --config whose data section names shards")
    return out


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
        max_patches = run["max_patches"] if args.image_processor is None else args.max_patches
        stats = check_shards(
            run["shards"],
            load_check_tokenizer(run["tokenizer"]),
            build_image_processor(args.image_processor, max_patches),
            seq_len=run["seq_len"],
            max_image_pixels=args.max_image_pixels,
            split_documents=run["split_documents"],
            num_workers=args.num_workers,
            loss_on=run["loss_on"],
            show_progress=not args.quiet,
        )
    except (OSError, ValueError) as err:
        print(f"error: {str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}", file=sys.stderr)
        return 2
    report = {k: stats[k] for k in ("samples", "images", "text_tokens")}
    report["skipped"] = {kind: stats["skipped"][kind] for kind in SKIP_KINDS}
    report.update(shards=stats["shards"], seconds=stats["seconds"])
    lines = report_lines(stats, run["seq_len"], args.num_workers, args.strict)
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
