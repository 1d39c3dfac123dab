"""Data ingestion vs training consumption: does the loader keep the ``small`` VLM fed?

    python scripts/bench_data.py [--samples-per-kind 96] [--seq-len 1024] [--batch-size 8] [--workers 0 1 2]
                                 [--split-documents] [--device cuda|cpu]

Writes synthetic shards (scenes + documents + text, ``--samples-per-kind`` each) to a temporary folder, then
in one run measures:

* the loader (``data_pipelines.loader.loader_from_config`` over a ``DataConfig``, with the shipped tokenizer and
  the model's image processor) with 0, 1 and 2 workers: samples/s and tokens/s in steady state (the first batch,
  which pays for worker start-up and the first shard opens, is timed separately), ``--repeats`` times round-robin,
  median shown;
* the training step of ``ConceptMoEVLM.from_preset("small")`` (forward + backward + AdamW, on CUDA when there
  is one, fp32) on batches from that loader: tokens/s consumed.

Tokens are row positions (``batch_size * seq_len`` per batch, padding included: what the model processes);
the real (non-padding) share is printed as packing efficiency. Samples are the samples the loader read
(``loader.stats()["samples"]``). The loader streams (``epochs=None``), so the shards are read round and round.
The ratio ingestion / consumption should be >= 5.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from data_pipelines.loader import loader_from_config
from data_pipelines.run_config import DataConfig
from data_pipelines.synthetic import interleave
from data_pipelines.tokenizer import load_tokenizer
from data_pipelines.writer import load_manifest, write_shards
from vision_tower import ImageProcessor
from vlm import ConceptMoEVLM

KINDS = ("scenes", "documents", "text")


def write_synthetic_shards(out_dir: Path, samples_per_kind: int, seed: int) -> list[str]:
    """Scenes, documents and text round-robin (every shard mixes the kinds), in about 8 shards (>= 1 per worker)."""
    samples = interleave(KINDS, samples_per_kind, seed, "train")
    manifest = write_shards(samples, out_dir, "train", max_count=max(1, len(KINDS) * samples_per_kind // 8))
    return load_manifest(out_dir / "train")["paths"] if manifest else []


def measure_loader(loader, max_batches: int) -> dict:
    """Time to the first batch, then steady-state rates over the next ``max_batches``."""
    start = time.perf_counter()
    iterator = iter(loader)
    first = next(iterator)
    first_s = time.perf_counter() - start
    samples_before, positions, n = loader.stats()["samples"], 0, 0
    start = time.perf_counter()
    for batch in iterator:
        positions, n = positions + batch["input_ids"].numel(), n + 1
        if n == max_batches:
            break
    seconds = time.perf_counter() - start
    stats = loader.stats()
    iterator.close()  # stops the workers
    return {
        "first_batch_s": first_s,
        "samples_per_s": (stats["samples"] - samples_before) / seconds,
        "tokens_per_s": positions / seconds,
        "efficiency": stats["packing_efficiency"],
        "skipped": sum(stats["skipped"].values()),
        "first": first,
    }


def median_run(runs: list[dict]) -> dict:
    """The run with the median tokens/s (its samples/s and first-batch time come along)."""
    return sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]


def measure_step(model, batches: list[dict], repeats: int, device: torch.device) -> dict:
    """Median seconds of one forward + backward + AdamW step, after one warm-up step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()
    times = []
    for i in range(repeats + 1):
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batches[i % len(batches)].items()}
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i > 0:
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return {"step_s": seconds, "tokens_per_s": batches[0]["input_ids"].numel() / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples-per-kind", type=int, default=96)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--batches", type=int, default=12, help="steady-state batches timed per loader setting")
    parser.add_argument("--repeats", type=int, default=3, help="loader measurements per setting (median)")
    parser.add_argument("--steps", type=int, default=3, help="timed training steps (after one warm-up)")
    parser.add_argument("--split-documents", action="store_true", help="let documents run on into the next row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    tokenizer = load_tokenizer()
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = ConceptMoEVLM.from_preset("small", image_token_id=image_token_id, vocab_size=len(tokenizer)).to(device)
    cfg = model.config
    image_processor = ImageProcessor(
        patch_size=cfg.patch_size, max_patches=cfg.max_patches, pixel_shuffle=cfg.pixel_shuffle
    )

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        shards = write_synthetic_shards(Path(tmp), args.samples_per_kind, args.seed)
        print(
            f"wrote {len(shards)} shards ({len(KINDS)} x {args.samples_per_kind} samples) in "
            f"{time.perf_counter() - start:.1f} s"
        )

        data = DataConfig(
            shards=shards, seq_len=args.seq_len, batch_size=args.batch_size, split_documents=args.split_documents
        )

        def loader(num_workers: int):
            return loader_from_config(
                replace(data, num_workers=num_workers), tokenizer, image_processor, seed=args.seed
            )

        # Round-robin repeats, median per setting: load drift on a shared machine hits every setting alike.
        runs = {w: [] for w in args.workers}
        for _ in range(args.repeats):
            for w in args.workers:
                runs[w].append(measure_loader(loader(w), args.batches))
        results = {w: median_run(r) for w, r in runs.items()}

    batches = [r["first"] for r in runs[args.workers[0]]]
    step = measure_step(model, batches, args.steps, device)

    print(
        f"\nrows {args.batch_size} x {args.seq_len}; tokens = row positions; step: small VLM, {args.device}, "
        f"fwd+bwd+AdamW, {step['step_s']:.3f} s/step\n"
    )
    print(
        "| reader | first batch (s) | samples/s | tokens/s | packing efficiency | skipped | ingestion / consumption |"
    )
    print("|---|---|---|---|---|---|---|")
    for w, res in results.items():
        ratio = res["tokens_per_s"] / step["tokens_per_s"]
        print(
            f"| loader, {w} workers | {res['first_batch_s']:.2f} | {res['samples_per_s']:.1f} | "
            f"{res['tokens_per_s']:,.0f} | {res['efficiency']:.1%} | {res['skipped']} | {ratio:.1f}x |"
        )
    print(f"| training step (small) | | | {step['tokens_per_s']:,.0f} | | | 1.0x |")
    best = max(res["tokens_per_s"] for res in results.values()) / step["tokens_per_s"]
    print(f"\nbest ingestion / consumption: {best:.1f}x (target >= 5x): {'OK' if best >= 5 else 'BELOW TARGET'}")


if __name__ == "__main__":
    main()
