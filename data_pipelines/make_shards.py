"""Write train / eval webdataset shards from the synthetic generators or local sources (``scripts/make_shards.py``).

    python scripts/make_shards.py --synthetic scenes,documents,needles,text --out data/syn --num-samples 1000 --seed 0
    python scripts/make_shards.py --synthetic scenes_chat --option max_objects=1 --option object_size=0.6,0.95 ...
    python scripts/make_shards.py --from-jsonl docs.jsonl --out data/docs --eval-fraction 0.05
    python scripts/make_shards.py --from-dir img2dataset_out/ --out data/pairs
    python scripts/make_shards.py --from-text notes/*.txt --text-unit paragraph --out data/notes --tokenizer tok/
    python scripts/make_shards.py --from-llava llava_v1_5_mix665k.json --image-root llava_images/ --out data/sft
    python scripts/make_shards.py --from-messages chats.jsonl --out data/chats

Synthetic: ``--num-samples`` per kind for train and ``--eval-samples`` (default a tenth) per kind for eval, the
kinds interleaved round-robin; ``--option KEY=VALUE`` goes to the kinds whose generator takes it (a curriculum's
easy stage: ``max_objects=1``, ``object_size=0.6,0.95``), and the manifest records the options.
Sources: one pass, each sample goes to eval when a hash of its key falls under ``--eval-fraction`` (default 0:
train only, no eval folder); ``--from-llava`` / ``--from-messages`` write conversations, their image paths
relative to ``--image-root`` (default: the file's folder); an entry whose image resolves outside that folder
(``..``, an absolute path, a symlink out) is skipped as ``outside_image_root`` unless
``--allow-outside-image-root``. Writes ``OUT/<split>/*.tar`` + ``manifest.json`` and prints one summary line per
split. Manifests count text tokens with the shipped tokenizer (``data_pipelines/assets/tokenizer``), or with
``--tokenizer DIR``. A progress bar of the samples goes to stderr when it is a terminal; ``--quiet`` drops it.

A run writes into a hidden folder beside ``OUT`` and puts it in the place of ``OUT`` only when it succeeded, so
``OUT`` then holds exactly this run's splits; on any error, or when the run wrote no sample, an earlier ``OUT`` is
kept as it was (an empty run over one exits 2). ``OUT`` must hold nothing but splits of shards. Samples whose
images the loader would refuse (undecodable, cut, over ``--max-image-pixels``) are skipped and counted per split.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence

from tqdm import tqdm

from data_pipelines import conversation_sources, sources, synthetic
from data_pipelines.schema import MAX_IMAGE_PIXELS, Sample
from data_pipelines.writer import DatasetRefused, SplitWriter, staged_dataset

logger = logging.getLogger(__name__)


def _counted(samples: Iterable[Sample], counter: Counter) -> Iterator[Sample]:
    for sample in samples:
        counter[sample.meta.get("kind", "?")] += 1
        yield sample


def progress(samples: Iterable[Sample], enabled: bool, desc: str, total: int | None = None) -> Iterable[Sample]:
    """``samples`` with a tqdm bar on stderr when ``enabled`` and stderr is a terminal (tqdm's ``disable=None``)."""
    return tqdm(samples, desc=desc, total=total, unit=" samples", disable=None if enabled else True)


def make_synthetic(
    kinds: Sequence[str],
    out_dir: str,
    num_samples: int,
    seed: int,
    eval_samples: int | None = None,
    tokenizer=None,
    generator_options: dict | None = None,
    show_progress: bool = False,
    **writer_options,
) -> dict[str, dict]:
    """Train and eval shards of the synthetic ``kinds`` in ``out_dir`` (replaced as a whole: ``staged_dataset``);
    ``generator_options`` go to the kinds that take them (``synthetic.interleave``); ``show_progress``: a bar per
    split (:func:`progress`). Returns ``{split: manifest}``."""
    unknown = sorted(set(kinds) - set(synthetic.GENERATORS))
    if unknown or not kinds:
        raise ValueError(f"synthetic kinds must be among {sorted(synthetic.GENERATORS)}, got {list(kinds)}")
    if num_samples < 0 or (eval_samples is not None and eval_samples < 0):
        raise ValueError(f"num_samples / eval_samples must be >= 0, got {num_samples} / {eval_samples}")
    if eval_samples is None:
        eval_samples = (num_samples + 9) // 10
    manifests = {}
    with staged_dataset(out_dir) as stage:
        for split, n in (("train", num_samples), ("eval", eval_samples)):
            per_kind: Counter = Counter()
            extra = {"source": "synthetic", "generator": "data_pipelines.synthetic", "kinds": list(kinds)}
            extra.update(seed=seed, options=dict(generator_options or {}), kind_samples=per_kind)  # filled at close
            samples = synthetic.interleave(kinds, n, seed, split, generator_options)
            samples = progress(samples, show_progress, split, total=n * len(kinds))
            with SplitWriter(stage, split, manifest_extra=extra, tokenizer=tokenizer, **writer_options) as writer:
                for sample in _counted(samples, per_kind):
                    writer.write(sample)
            manifests[split] = writer.manifest
    return manifests


def is_eval(key: str, eval_fraction: float) -> bool:
    """Stable hash split of a key: the same key lands on the same side in every run."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") < eval_fraction * 2**64


def make_from_source(
    samples: Iterable[Sample],
    stats: sources.SourceStats,
    source: dict,
    out_dir: str,
    eval_fraction: float = 0.0,
    tokenizer=None,
    show_progress: bool = False,
    **writer_options,
) -> dict[str, dict]:
    """Route one source stream into train (and eval when ``eval_fraction`` > 0) in ``out_dir`` (replaced as a
    whole: ``staged_dataset``); returns ``{split: manifest}``. Both manifests record the whole source's ``read`` /
    ``skipped`` counts. ``show_progress``: a bar of the samples read (:func:`progress`)."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    splits = ["train", "eval"] if eval_fraction > 0 else ["train"]
    manifests = {}
    with staged_dataset(out_dir) as stage:
        writers = {split: SplitWriter(stage, split, tokenizer=tokenizer, **writer_options) for split in splits}
        try:
            for sample in progress(samples, show_progress, "samples"):
                writers["eval" if eval_fraction > 0 and is_eval(sample.key, eval_fraction) else "train"].write(sample)
            for split, writer in writers.items():
                writer.manifest_extra = {"source": {**source, **stats.as_dict()}, "eval_fraction": eval_fraction}
                manifests[split] = writer.close()
        except BaseException:
            for writer in writers.values():
                writer.abort()
            raise
    return manifests


def _summary(split: str, manifest: dict, out_dir: str) -> str:
    tokens = f", {manifest['text_tokens']:,} text tokens" if manifest["text_tokens"] is not None else ""
    skipped = manifest["skipped"]
    skips = f" ({sum(skipped.values()):,} skipped {skipped})" if skipped else ""
    return (
        f"{split}: {manifest['samples']:,} samples{skips}, {manifest['images']:,} images, {manifest['text_chars']:,} "
        f"text chars{tokens} in {len(manifest['shards'])} shards -> {out_dir}/{split}/{manifest['brace'] or '(none)'}"
    )


def parse_value(text: str) -> int | float | str | list:
    """``1`` -> 1, ``0.5`` -> 0.5, ``0.6,0.95`` -> [0.6, 0.95]; anything else stays a string."""
    if "," in text:
        return [parse_value(part.strip()) for part in text.split(",")]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_options(pairs: Sequence[str], parser: argparse.ArgumentParser) -> dict:
    """``--option KEY=VALUE`` pairs as a dict (a malformed pair or a repeated key: a one-line usage error)."""
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip() or key.strip() in options:
            parser.error(f"--option {pair!r}: expected KEY=VALUE, each KEY once")
        options[key.strip()] = parse_value(value.strip())
    return options


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--synthetic", metavar="KIND[,KIND...]", help=f"kinds among {sorted(synthetic.GENERATORS)}")
    src.add_argument("--from-jsonl", nargs="+", metavar="FILE", help="JSONL files of interleaved documents")
    src.add_argument("--from-dir", metavar="DIR", help="a folder of *.jsonl documents or img2dataset pairs")
    src.add_argument("--from-text", nargs="+", metavar="FILE", help="plain-text files")
    src.add_argument("--from-llava", metavar="FILE", help="LLaVA instruction data (JSON list or JSONL)")
    src.add_argument("--from-messages", metavar="FILE", help="HF / OpenAI chat messages (JSONL or JSON list)")
    parser.add_argument("--out", required=True, help="output folder: OUT/train, OUT/eval")
    parser.add_argument("--num-samples", type=int, help="synthetic: train samples per kind")
    parser.add_argument("--eval-samples", type=int, help="synthetic: eval samples per kind (default: a tenth)")
    parser.add_argument("--seed", type=int, default=0, help="synthetic: generator seed (default 0)")
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="synthetic: a generator option (repeatable): an int, a float, or a comma list (object_size=0.6,0.95)",
    )
    parser.add_argument("--eval-fraction", type=float, default=0.0, help="sources: share of keys sent to eval")
    parser.add_argument("--text-unit", choices=("file", "paragraph"), default="file", help="--from-text samples")
    parser.add_argument(
        "--image-root", metavar="DIR", help="--from-llava / --from-messages: image paths' folder (default: FILE's)"
    )
    parser.add_argument(
        "--allow-outside-image-root",
        action="store_true",
        help="--from-llava / --from-messages: read images that resolve outside the image root (default: skip them)",
    )
    parser.add_argument("--max-count", type=int, default=1000, help="samples per shard at most (default 1000)")
    parser.add_argument("--max-size", type=int, default=64 * 2**20, help="bytes per shard, about (default 64 MiB)")
    parser.add_argument(
        "--tokenizer", metavar="DIR", help="HF tokenizer folder for the manifests' text token counts (default: shipped)"
    )
    parser.add_argument(
        "--max-image-pixels", type=int, default=MAX_IMAGE_PIXELS, help="bigger images skip their sample, as in loading"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not (args.from_llava or args.from_messages):
        if args.image_root is not None:
            parser.error("--image-root goes with --from-llava or --from-messages")
        if args.allow_outside_image_root:
            parser.error("--allow-outside-image-root goes with --from-llava or --from-messages")
    if args.option and not args.synthetic:
        parser.error("--option goes with --synthetic (generator options)")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        tokenizer = load_manifest_tokenizer(args.tokenizer)
    except (OSError, ValueError) as err:
        parser.error(f"--tokenizer: {err}")
    options = {"max_count": args.max_count, "max_size": args.max_size, "tokenizer": tokenizer}
    options.update(max_image_pixels=args.max_image_pixels, show_progress=not args.quiet)
    try:
        if args.synthetic:
            if args.num_samples is None:
                parser.error("--synthetic needs --num-samples")
            kinds = [k.strip() for k in args.synthetic.split(",") if k.strip()]
            options["generator_options"] = parse_options(args.option, parser)
            manifests = make_synthetic(kinds, args.out, args.num_samples, args.seed, args.eval_samples, **options)
        else:
            stats = sources.SourceStats()
            if args.from_jsonl:
                source, samples = {"type": "jsonl", "paths": args.from_jsonl}, _chain_jsonl(args.from_jsonl, stats)
            elif args.from_dir:
                source, samples = {"type": "dir", "path": args.from_dir}, sources.from_dir(args.from_dir, stats)
            elif args.from_llava or args.from_messages:
                kind, path = ("llava", args.from_llava) if args.from_llava else ("messages", args.from_messages)
                read = conversation_sources.from_llava if args.from_llava else conversation_sources.from_messages
                source = {"type": kind, "path": path, "image_root": args.image_root}
                source["allow_outside_image_root"] = args.allow_outside_image_root
                samples = read(path, args.image_root, stats, args.allow_outside_image_root)
            else:
                source = {"type": "text", "paths": args.from_text, "unit": args.text_unit}
                samples = sources.from_text(args.from_text, stats, unit=args.text_unit)
            manifests = make_from_source(samples, stats, source, args.out, args.eval_fraction, **options)
            skipped = dict(sorted(stats.skipped.items()))
            print(f"source: {stats.read:,} samples read, {sum(skipped.values()):,} entries skipped {skipped}")
    except DatasetRefused as err:  # one line, and --out as it was
        print(f"make_shards: error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:
        parser.error(str(err))
    for split, manifest in manifests.items():
        print(_summary(split, manifest, args.out))
    if sum(m["samples"] for m in manifests.values()) == 0:
        print("nothing written: no usable samples", file=sys.stderr)
        return 1
    return 0


def load_manifest_tokenizer(path: str | None):
    """The tokenizer that counts the manifests' text tokens: the folder ``path``, else the shipped one (None, with a
    warning, when that cannot be loaded: the manifests then say ``text_tokens: null``)."""
    from data_pipelines.tokenizer import load_tokenizer

    if path is not None:
        return load_tokenizer(path)
    try:
        return load_tokenizer()
    except (OSError, ValueError) as err:
        logger.warning("shipped tokenizer unavailable (%s); manifests get no text token counts", err)
        return None


def _chain_jsonl(paths: Sequence[str], stats: sources.SourceStats) -> Iterator[Sample]:
    for path in paths:
        yield from sources.from_jsonl(path, stats)


if __name__ == "__main__":
    sys.exit(main())
