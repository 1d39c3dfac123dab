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
- ``cmoe_sceneqa``: ``scenes``; per scene one doc per question type among ``SCENEQA_TYPES`` that the scene's
  ``qa`` has (count always; colour / shape when the asked object is the only one of its shape / colour; position),
  question and answer as ``scenes.questions`` gives them (of the two count questions, one drawn per scene).
- ``cmoe_sceneqa_one``: the same questions on scenes of exactly one object (the generator's sizes): reading an
  object without having to pick it out among others, reported as its own rows.

Buckets are interleaved (bucket 0 sample 0, bucket 1 sample 0, ...), so ``--limit k`` sees every bucket early.
Each manifest also holds the task's chance levels (``chance``: metric -> the score of the best constant answer,
``chance_constant``: that answer; see ``eval.chance``), computed from the written ``test.jsonl``, and for the
``cmoe_sceneqa`` ``unbound``: per colour / shape / position metric, the score of a reader that knows every value of
the asked attribute in the scene but not which object has which, and names one of them at random (each doc's
``unbound``: 1 / the distinct values among its scene's objects). A score at that level reads the scene's colours
(or shapes) without binding them to the object the question names.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

from data_pipelines.prompts import SCENEQA_TYPES
from data_pipelines.synthetic import documents, needles, scenes
from eval import chance, metrics

TASKS = ("cmoe_longdoc", "cmoe_niah", "cmoe_refloc", "cmoe_sceneqa", "cmoe_sceneqa_one")
SCENEQA_TASKS = {"cmoe_sceneqa": 5, "cmoe_sceneqa_one": 1}  # task -> the most objects a scene holds
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
        for i, sample in enumerate(needles.generate(n_per_bucket, gen_seed, SPLIT, units, units, answer="sentence")):
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
                "answer": sample.qa[0]["value"],  # what the score looks for in the restated sentence
                "needle": meta["needle"],
                "generator": {"kind": "needles", "seed": gen_seed, "split": SPLIT, "index": i},
            }

    for name in lengths:
        if name not in NIAH_LENGTHS:
            raise ValueError(f"niah length {name!r} is not one of {sorted(NIAH_LENGTHS)}")
    return _interleave([bucket(list(NIAH_LENGTHS).index(name), name) for name in lengths])


def refloc_rows(n: int, seed: int, images_dir: Path) -> Iterator[dict]:
    """Docs of ``cmoe_refloc``: one scene and one referring expression each."""
    gen_seed = _bucket_seed(seed, 2, 0)
    for i, sample in enumerate(scenes.generate(n, gen_seed, SPLIT)):
        rng = random.Random(f"refloc/{gen_seed}/{i}")
        meta = sample.meta
        target = rng.choice(meta["objects"])
        expression, kind = scenes.referring_expression(rng, target, meta["objects"])
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


def sceneqa_rows(n: int, seed: int, images_dir: Path, task: str = "cmoe_sceneqa") -> Iterator[dict]:
    """Docs of ``cmoe_sceneqa`` (or ``cmoe_sceneqa_one``): per scene, one question of each type in
    ``SCENEQA_TYPES`` its ``qa`` holds, in that order (the image written once per scene)."""
    gen_seed = _bucket_seed(seed, TASKS.index(task), 0)
    options = {} if task == "cmoe_sceneqa" else {"options": {"max_objects": SCENEQA_TASKS[task]}}
    for i, sample in enumerate(scenes.generate(n, gen_seed, SPLIT, max_objects=SCENEQA_TASKS[task])):
        rng = random.Random(f"sceneqa/{gen_seed}/{i}")
        meta = sample.meta
        image = _save_image(sample.segments[0].image, images_dir, f"sceneqa-{i:05d}.png")
        for qtype in SCENEQA_TYPES:
            items = [qa for qa in sample.qa if qa["type"] == qtype]
            if not items:
                continue
            qa = rng.choice(items)
            binding = {}
            if qtype != "count":  # the share of right answers of one of the scene's values named at random
                binding["unbound"] = round(chance.unbound_share(meta["objects"], qtype), 6)
            yield {
                **binding,
                "id": f"sceneqa-{i:05d}-{qtype}",
                "key": sample.key,
                "group": qtype,
                "type": qtype,
                "image": image,
                "question": qa["q"],
                "answer": qa["a"],
                "canvas": [meta["canvas"]["width"], meta["canvas"]["height"]],
                "num_objects": len(meta["objects"]),
                "generator": {"kind": "scenes", "seed": gen_seed, "split": SPLIT, "index": i, **options},
            }


# ----------------------------------------------------------------------------------------------------------------
# Chance levels


def _masks(docs: list[dict], key: str, values) -> dict:
    return {value: [d[key] == value for d in docs] for value in values}


def unbound_levels(docs: list[dict]) -> dict[str, float]:
    """``acc_<type>`` -> the mean of the docs' ``unbound`` over the docs of that type (types without it: left out)."""
    out = {}
    for qtype in SCENEQA_TYPES:
        values = [d["unbound"] for d in docs if d.get("type") == qtype and "unbound" in d]
        if values:
            out[f"acc_{qtype}"] = sum(values) / len(values)
    return out


def chance_levels(task: str, docs: list[dict]) -> tuple[dict, dict]:
    """(metric -> the best constant answer's score, metric -> that answer) for every metric of ``task``, on
    ``docs`` (``eval.chance``; None for a metric whose bucket is empty, as the task reports NaN there)."""
    answers = [str(d.get("answer", "")) for d in docs]
    if task == "cmoe_refloc":
        found = chance.best_constant_boxes([d["bbox"] for d in docs])
    elif task in SCENEQA_TASKS:
        types = [d["type"] for d in docs]
        by_type = chance.best_constant_answer(answers, metrics.short_answer_match, _masks(docs, "type", SCENEQA_TYPES))
        found = {f"acc_{t}": by_type[t] for t in SCENEQA_TYPES}
        found["acc"] = chance.best_constant_per_group(answers, types, metrics.short_answer_match)
    elif task == "cmoe_niah":
        subsets = {"acc": [True] * len(docs)}
        subsets |= {f"acc_{m}": mask for m, mask in _masks(docs, "modality", NIAH_MODALITIES).items()}
        subsets |= {f"acc_depth_{round(d * 100)}": mask for d, mask in _masks(docs, "depth", NIAH_DEPTHS).items()}
        subsets |= {f"acc_len_{n}": mask for n, mask in _masks(docs, "length", NIAH_LENGTHS).items()}
        found = chance.best_constant_answer(answers, metrics.needle_found, subsets)
    elif task == "cmoe_longdoc":
        subsets = {"": [True] * len(docs)} | {
            f"_pages_{p}": m for p, m in _masks(docs, "num_pages", LONGDOC_PAGES).items()
        }
        found = {}
        for name, score in (("anls", metrics.anls), ("exact_match", metrics.exact_match)):
            found |= {name + suffix: v for suffix, v in chance.best_constant_answer(answers, score, subsets).items()}
    else:
        raise ValueError(f"no chance levels for task {task!r}")
    return {m: v for m, (v, _) in found.items()}, {m: c for m, (_, c) in found.items()}


# ----------------------------------------------------------------------------------------------------------------
# Writing


def _write_task(out: Path, task: str, rows: Iterator[dict], options: dict) -> dict:
    """JSONL + manifest of one task (the images were written by the row generator); the chance levels are
    computed from the JSONL as written."""
    data_dir = out / task / "data"
    lines = [json.dumps(row, sort_keys=True) + "\n" for row in rows]
    text = "".join(lines)
    (data_dir / "test.jsonl").write_text(text, encoding="utf-8")
    written = (data_dir / "test.jsonl").read_text(encoding="utf-8").splitlines()
    docs = [json.loads(line) for line in written]
    levels, constants = chance_levels(task, docs)
    unbound = unbound_levels(docs) if SCENEQA_TASKS.get(task, 1) > 1 else {}  # one object: nothing to bind
    manifest = {
        "task": task,
        "docs": len(lines),
        "options": options,
        "jsonl_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "chance": levels,
        "chance_constant": constants,
        **({"unbound": unbound} if unbound else {}),
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


def _task_options(task: str, seed: int, sizes: dict) -> dict:
    """The options a task's data is built from (what its manifest records as ``options``)."""
    if task == "cmoe_longdoc":
        options = {"per_bucket": sizes["longdoc_per_bucket"], "pages": list(sizes["longdoc_pages"])}
        options["image_max_patches"] = LONGDOC_MAX_PATCHES
    elif task == "cmoe_niah":
        lengths = sizes["niah_lengths"]
        options = {"per_bucket": sizes["niah_per_bucket"], "lengths": {k: NIAH_LENGTHS[k] for k in lengths}}
    elif task == "cmoe_refloc":
        options = {"n": sizes["refloc_n"]}
    else:
        n = sizes["sceneqa_n"] if task == "cmoe_sceneqa" else sizes["sceneqa_one_n"]
        options = {"n": n, "types": list(SCENEQA_TYPES), "max_objects": SCENEQA_TASKS[task]}
    return {"seed": seed, "split": SPLIT, **options}


def _kept(data_dir: Path, options: dict) -> dict | None:
    """The manifest of data already written with ``options`` and intact (its JSONL hashes as recorded), else None."""
    try:
        manifest = json.loads((data_dir / "manifest.json").read_text(encoding="utf-8"))
        text = (data_dir / "test.jsonl").read_bytes()
    except (OSError, ValueError):
        return None
    same = manifest.get("options") == json.loads(json.dumps(options))  # as the manifest stores them (JSON)
    return manifest if same and manifest.get("jsonl_sha256") == hashlib.sha256(text).hexdigest() else None


def write_eval_sets(
    out: str | Path = DEFAULT_OUT,
    seed: int = 0,
    tasks: Sequence[str] = TASKS,
    longdoc_per_bucket: int = 20,
    longdoc_pages: Sequence[int] = LONGDOC_PAGES,
    niah_per_bucket: int = 44,
    niah_lengths: Sequence[str] = tuple(NIAH_LENGTHS),
    refloc_n: int = 200,
    sceneqa_n: int = 200,
    sceneqa_one_n: int = 200,
    keep: bool = False,
) -> dict[str, dict]:
    """Write the chosen tasks' data (replacing any earlier data of those tasks); returns their manifests. ``keep``:
    leave a task's data as it is when its manifest records the same options and its JSONL is intact (a rerun of
    the same command costs nothing; other sizes or a seed rebuild it)."""
    out = Path(out)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; choose from {list(TASKS)}")
    sizes = dict(
        longdoc_per_bucket=longdoc_per_bucket,
        longdoc_pages=longdoc_pages,
        niah_per_bucket=niah_per_bucket,
        niah_lengths=niah_lengths,
        refloc_n=refloc_n,
        sceneqa_n=sceneqa_n,
        sceneqa_one_n=sceneqa_one_n,
    )
    manifests = {}
    for task in tasks:
        data_dir, options = out / task / "data", _task_options(task, seed, sizes)
        if keep and (manifest := _kept(data_dir, options)) is not None:
            install_task_files(out, task)
            manifests[task] = manifest
            continue
        if data_dir.exists():
            shutil.rmtree(data_dir)
        (data_dir / "images").mkdir(parents=True)
        install_task_files(out, task)
        images = data_dir / "images"  # the docs are built from ``options``, what the manifest (and ``keep``) reads
        if task == "cmoe_longdoc":
            rows = longdoc_rows(options["per_bucket"], seed, options["pages"], images)
        elif task == "cmoe_niah":
            rows = niah_rows(options["per_bucket"], seed, list(options["lengths"]), images)
        elif task == "cmoe_refloc":
            rows = refloc_rows(options["n"], seed, images)
        else:
            rows = sceneqa_rows(options["n"], seed, images, task)
        manifests[task] = _write_task(out, task, rows, options)
    return manifests
