"""Local evaluation sets for the lmms-eval tasks in ``eval/tasks``, from the synthetic training generators.

``write_eval_sets(out, seed)`` writes, per task, ``OUT/<task>/data/test.jsonl`` (one doc per line), the images under
``OUT/<task>/data/images/`` and ``OUT/<task>/data/manifest.json`` (options, counts, a hash of the JSONL). ``OUT``
defaults to ``eval/tasks`` relative to the current directory (``DEFAULT_OUT``), never to the installed package: from
the repository root that is the package's own task folder, which ``lmms-eval --include_path eval/tasks`` reads.
When ``OUT`` is any other folder, the task's YAML and ``utils.py`` are copied next to the data (each task's
``utils.py`` reads the ``data/`` beside itself), so that ``--include_path OUT`` is self-contained.

Disjoint from training: every sample comes from the generators' ``"eval"`` split (its own random streams, and the
``eval`` side of the local text corpus for every paragraph of text), with a seed derived per task and bucket;
training shards use the ``"train"`` split. Deterministic: the same seed gives byte-identical files.

- ``cmoe_longdoc``: ``documents`` with a fixed page count per bucket (``LONGDOC_PAGES``); the question asks for the
  code word planted on one page. Pages are 384-512 px wide (A4 / letter), fonts 10-16 px: readable only near
  native resolution, so the task asks for ``image_max_patches = LONGDOC_MAX_PATCHES`` (1536 patches of 16 px:
  every page fits unscaled, ~190-350 tokens per page after the 2x2 merge, ~11k tokens for 32 pages).
- ``cmoe_niah``: ``needles`` with a fixed haystack size per length bucket (``NIAH_LENGTHS``, in units: a corpus
  paragraph or an image), depths 0..1 in tenths, needle as text or drawn in an image; every 22 consecutive
  samples of a bucket cover the depth x modality grid.
- ``cmoe_refloc``: ``scenes``; one referring expression per scene that names exactly one object, and its
  normalised ``[x1, y1, x2, y2]`` box.

Buckets are interleaved (bucket 0 sample 0, bucket 1 sample 0, ...), so ``--limit k`` sees every bucket early.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

from data_pipelines.synthetic import documents, needles, scenes

TASKS = ("cmoe_longdoc", "cmoe_niah", "cmoe_refloc")
TASKS_DIR = Path(__file__).resolve().parent / "tasks"  # the shipped task definitions (read, never written)
DEFAULT_OUT = Path("eval") / "tasks"  # where the data goes by default: relative to the current directory
LONGDOC_PAGES = (1, 2, 4, 8, 16, 32)  # page counts the task reports ANLS / EM for
LONGDOC_MAX_PATCHES = 1536
NIAH_LENGTHS = {"short": 8, "medium": 32, "long": 128}  # haystack units per length bucket
NIAH_DEPTHS = needles.DEPTHS
NIAH_MODALITIES = needles.MODALITIES
SPLIT = "eval"


def _bucket_seed(seed: int, task_index: int, bucket_index: int) -> int:
    """One generator seed per (task, bucket): different buckets never share a random stream."""
    return 1_000_000 + seed * 1000 + task_index * 100 + bucket_index


def _interleave(streams: Sequence[Iterator[dict]]) -> Iterator[dict]:
    """Round-robin over the bucket streams until all are exhausted."""
    streams = list(streams)
    while streams:
        alive = []
        for stream in streams:
            row = next(stream, None)
            if row is not None:
                yield row
                alive.append(stream)
        streams = alive


def _save_image(data: bytes, images_dir: Path, name: str) -> str:
    """Write the generator's encoded bytes as they are; returns the path relative to the data folder."""
    (images_dir / name).write_bytes(data)
    return f"images/{name}"


# ----------------------------------------------------------------------------------------------------------------
# The three tasks


def longdoc_rows(n_per_bucket: int, seed: int, pages: Sequence[int], images_dir: Path) -> Iterator[dict]:
    """Docs of ``cmoe_longdoc``: one bucket per page count."""

    def bucket(b: int, n_pages: int) -> Iterator[dict]:
        gen_seed = _bucket_seed(seed, 0, b)
        for i, sample in enumerate(documents.generate(n_per_bucket, gen_seed, SPLIT, n_pages, n_pages)):
            doc_id = f"longdoc-p{n_pages:02d}-{i:05d}"
            images = [seg.image for seg in sample.segments if seg.image is not None]
            paths = [_save_image(img, images_dir, f"{doc_id}-page{k:02d}.png") for k, img in enumerate(images)]
            qa, meta = sample.qa[0], sample.meta
            yield {
                "id": doc_id,
                "key": sample.key,
                "group": f"pages={n_pages}",
                "num_pages": n_pages,
                "pages": paths,
                "question": qa["q"],
                "answer": qa["a"],
                "answer_page": qa["page"],
                "page_size": meta["page_size"],
                "font_size": meta["font_size"],
                "columns": meta["columns"],
                "generator": {"kind": "documents", "seed": gen_seed, "split": SPLIT, "index": i},
            }

    for p in pages:
        if p not in LONGDOC_PAGES:
            raise ValueError(f"longdoc page count {p} is not one of {LONGDOC_PAGES} (the task's metric buckets)")
    return _interleave([bucket(LONGDOC_PAGES.index(p), p) for p in pages])


def niah_rows(n_per_bucket: int, seed: int, lengths: Sequence[str], images_dir: Path) -> Iterator[dict]:
    """Docs of ``cmoe_niah``: one bucket per haystack length; depth x modality cycle inside each bucket."""

    def bucket(b: int, name: str) -> Iterator[dict]:
        units, gen_seed = NIAH_LENGTHS[name], _bucket_seed(seed, 1, b)
        for i, sample in enumerate(needles.generate(n_per_bucket, gen_seed, SPLIT, units, units)):
            doc_id = f"niah-{name}-{i:05d}"
            segments = []
            for k, seg in enumerate(sample.segments[:-1]):  # the last segment is the question
                if seg.image is not None:
                    segments.append({"image": _save_image(seg.image, images_dir, f"{doc_id}-{k:03d}.png")})
                else:
                    segments.append({"text": seg.text})
            meta = sample.meta
            yield {
                "id": doc_id,
                "key": sample.key,
                "group": f"{meta['needle_modality']}/{name}",
                "length": name,
                "units": units,
                "depth": meta["depth"],
                "modality": meta["needle_modality"],
                "segments": segments,
                "question": sample.qa[0]["q"],
                "answer": sample.qa[0]["a"],
                "needle": meta["needle"],
                "generator": {"kind": "needles", "seed": gen_seed, "split": SPLIT, "index": i},
            }

    for name in lengths:
        if name not in NIAH_LENGTHS:
            raise ValueError(f"niah length {name!r} is not one of {sorted(NIAH_LENGTHS)}")
    return _interleave([bucket(list(NIAH_LENGTHS).index(name), name) for name in lengths])


def referring_expression(rng: random.Random, target: dict, objects: list[dict]) -> tuple[str, str]:
    """(expression, kind) naming ``target`` and no other object of the scene."""
    unique = lambda **kv: sum(all(o[k] == v for k, v in kv.items()) for o in objects) == 1
    options = [(f"{target['colour']} {target['shape']}", "colour+shape")]
    if unique(shape=target["shape"]):
        options.append((target["shape"], "shape"))
    if unique(colour=target["colour"]):
        options.append((f"{target['colour']} object", "colour"))
    if unique(size=target["size"], shape=target["shape"]):
        options.append((f"{target['size']} {target['shape']}", "size+shape"))
    if unique(position=target["position"]):
        where = "in the center" if target["position"] == "center" else f"at the {target['position']}"
        options.append((f"{target['shape']} {where}", "shape+position"))
    return rng.choice(options)


def refloc_rows(n: int, seed: int, images_dir: Path) -> Iterator[dict]:
    """Docs of ``cmoe_refloc``: one scene and one referring expression each."""
    gen_seed = _bucket_seed(seed, 2, 0)
    for i, sample in enumerate(scenes.generate(n, gen_seed, SPLIT)):
        rng = random.Random(f"refloc/{gen_seed}/{i}")
        meta = sample.meta
        target = rng.choice(meta["objects"])
        expression, kind = referring_expression(rng, target, meta["objects"])
        doc_id = f"refloc-{i:05d}"
        yield {
            "id": doc_id,
            "key": sample.key,
            "group": kind,
            "image": _save_image(sample.segments[0].image, images_dir, f"{doc_id}.png"),
            "expression": expression,
            "bbox": target["box"],
            "canvas": [meta["canvas"]["width"], meta["canvas"]["height"]],
            "num_objects": len(meta["objects"]),
            "generator": {"kind": "scenes", "seed": gen_seed, "split": SPLIT, "index": i},
        }


# ----------------------------------------------------------------------------------------------------------------
# Writing


def _write_task(out: Path, task: str, rows: Iterator[dict], options: dict) -> dict:
    """JSONL + manifest of one task (the images were written by the row generator)."""
    data_dir = out / task / "data"
    lines = [json.dumps(row, sort_keys=True) + "\n" for row in rows]
    text = "".join(lines)
    (data_dir / "test.jsonl").write_text(text, encoding="utf-8")
    manifest = {
        "task": task,
        "docs": len(lines),
        "options": options,
        "jsonl_sha256": hashlib.sha256(text.encode()).hexdigest(),
    }
    (data_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return manifest


def install_task_files(out: Path, task: str) -> None:
    """Copy the task's YAML and utils.py from ``eval/tasks/<task>`` into ``OUT/<task>`` (unless it is that folder)."""
    src, dst = TASKS_DIR / task, out / task
    if src.resolve() == dst.resolve():
        return
    dst.mkdir(parents=True, exist_ok=True)
    for path in sorted(src.iterdir()):
        if path.is_file() and path.suffix in (".yaml", ".py"):
            shutil.copyfile(path, dst / path.name)


def write_eval_sets(
    out: str | Path = DEFAULT_OUT,
    seed: int = 0,
    tasks: Sequence[str] = TASKS,
    longdoc_per_bucket: int = 20,
    longdoc_pages: Sequence[int] = LONGDOC_PAGES,
    niah_per_bucket: int = 44,
    niah_lengths: Sequence[str] = tuple(NIAH_LENGTHS),
    refloc_n: int = 200,
) -> dict[str, dict]:
    """Write the chosen tasks' data (replacing any earlier data of those tasks); returns their manifests."""
    out = Path(out)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; choose from {list(TASKS)}")
    manifests = {}
    for task in tasks:
        data_dir = out / task / "data"
        if data_dir.exists():
            shutil.rmtree(data_dir)
        (data_dir / "images").mkdir(parents=True)
        install_task_files(out, task)
        images = data_dir / "images"
        if task == "cmoe_longdoc":
            options = {"per_bucket": longdoc_per_bucket, "pages": list(longdoc_pages)}
            rows = longdoc_rows(longdoc_per_bucket, seed, longdoc_pages, images)
            options["image_max_patches"] = LONGDOC_MAX_PATCHES
        elif task == "cmoe_niah":
            options = {"per_bucket": niah_per_bucket, "lengths": {k: NIAH_LENGTHS[k] for k in niah_lengths}}
            rows = niah_rows(niah_per_bucket, seed, niah_lengths, images)
        else:
            options = {"n": refloc_n}
            rows = refloc_rows(refloc_n, seed, images)
        manifests[task] = _write_task(out, task, rows, {"seed": seed, "split": SPLIT, **options})
    return manifests
