"""Training throughput per process and memory peak: ConceptMoE (R=2, matched) vs its MoE baseline, one run.

    python scripts/bench_train.py [--preset small] [--seq-lens 1024 4096 8192] [--steps 3]

Every (model, seq len) cell runs in a fresh subprocess so that its memory peak (max RSS on CPU, or
``torch.cuda.max_memory_allocated`` on GPU) is its own: a full optimiser step (forward, backward, AdamW) on one
packed row of 512-token documents (``doc_ids``, as in training), median of ``--steps`` after a warm-up. Ratios
are against the baseline measured in the same run.

``--packed-vs-plain`` (issue #16) runs, for ``<preset>`` (R=2) and ``<preset>-moe``, one plain causal row (one
document, no ``doc_ids``) and one packed row of ``--doc-len``-token documents of the same length, each cell in its own
subprocess, and prints packed / plain tokens/s and peak RSS (``ru_maxrss`` of the cell's process: everything torch
allocated on CPU, model, optimiser state and activations included; ``tracemalloc`` does not see torch's allocator).

``--scaling`` measures the real training script instead: ``deepspeed --num_gpus 1`` and ``--num_gpus 2`` runs of
``scripts/train_vlm.py`` (ZeRO-2) on synthetic shards, global and per-process tokens/s from ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch


def one_cell(preset: str, seq_len: int, steps: int, doc_len: int = 512) -> dict:
    """One optimiser step per row, median of ``steps`` after a warm-up; ``doc_len`` 0 = one plain causal row."""
    from vlm import ConceptMoEConfig, ConceptMoEForCausalLM

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    overrides = {} if preset.endswith("-moe") else {"boundary_router_init": "random"}  # R ~ 2 from the first step
    config = ConceptMoEConfig.from_preset(preset, max_position_embeddings=max(seq_len, 8192), **overrides)
    model = ConceptMoEForCausalLM(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (1, seq_len), device=device)
    doc_ids = (torch.arange(seq_len, device=device) // doc_len)[None] if doc_len else None
    times, r = [], 1.0
    for i in range(steps + 1):
        start = time.perf_counter()
        out = model(ids, labels=ids, doc_ids=doc_ids)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        if i:  # the first step warms up
            times.append(time.perf_counter() - start)
        r = out.chunk_stats["r"]
    if device == "cuda":
        peak_mb = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"tokens_per_s": seq_len / statistics.median(times), "peak_mb": peak_mb, "r": r, "device": device}


def run_cell(preset: str, seq_len: int, steps: int, doc_len: int = 512) -> dict:
    cmd = [sys.executable, __file__, "--cell", preset, str(seq_len), str(steps), str(doc_len)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def packed_vs_plain(preset: str, seq_lens: list[int], steps: int, doc_len: int) -> None:
    """Issue #16: packed rows (document-aware attention, no N x N mask) against one plain causal row, same length."""
    print(
        f"# packed rows of {doc_len}-token documents vs one plain causal row, one optimiser step, {torch.__version__}"
    )
    print(
        "| model | tokens per row | plain tok/s | packed tok/s | speed ratio | plain peak MB | packed peak MB | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for model in (preset, f"{preset}-moe"):
        for n in seq_lens:
            plain = run_cell(model, n, steps, 0)
            packed = run_cell(model, n, steps, doc_len)
            print(
                f"| {model} | {n} | {plain['tokens_per_s']:,.0f} | {packed['tokens_per_s']:,.0f} "
                f"| {packed['tokens_per_s'] / plain['tokens_per_s']:.2f}x | {plain['peak_mb']:,.0f} "
                f"| {packed['peak_mb']:,.0f} | {packed['peak_mb'] / plain['peak_mb']:.2f}x |",
                flush=True,
            )


def scaling(preset: str, steps: int) -> None:
    import os
    import tempfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with tempfile.TemporaryDirectory() as tmp:
        shards = Path(tmp) / "shards"
        subprocess.run(
            [
                sys.executable,
                str(root / "scripts" / "make_shards.py"),
                "--synthetic",
                "scenes,text",
                "--out",
                str(shards),
                "--num-samples",
                "128",
                "--seed",
                "0",
            ],
            check=True,
            capture_output=True,
            env=env,
        )
        print(f"# scripts/train_vlm.py, {preset} VLM, ZeRO-2, rows 2 x 256 per process, median of steps 3..{steps}")
        print("| processes | global tok/s | tok/s per process | scaling |")
        print("|---|---|---|---|")
        base = None
        for n in (1, 2):
            run = Path(tmp) / f"run{n}"
            cmd = [
                str(bin_dir / "deepspeed"),
                "--num_gpus",
                str(n),
                "--master_port",
                str(29850 + n),
                str(root / "scripts" / "train_vlm.py"),
                "--config",
                str(root / "scripts" / "configs" / "tiny.yaml"),
                "--deepspeed",
                str(root / "scripts" / "configs" / "zero2.json"),
                "--out",
                str(run),
            ]
            for setting in (
                f"model.preset={preset}",
                f"data.shards=[{shards / 'train'}]",
                "data.eval_shards=null",
                f"train.max_steps={steps}",
                f"train.save_every={steps}",
                "train.eval_every=0",
                "train.export=false",
            ):
                cmd += ["--set", setting]
            subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=root)
            records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            tps = statistics.median(r["tokens_per_s"] for r in records if r.get("step", 0) >= 3 and "tokens_per_s" in r)
            base = base or tps
            print(f"| {n} | {tps:,.0f} | {tps / n:,.0f} | {tps / base:.2f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--scaling", action="store_true", help="1 vs 2 processes through scripts/train_vlm.py")
    parser.add_argument("--packed-vs-plain", action="store_true", help="packed vs plain causal rows (issue #16)")
    parser.add_argument("--doc-len", type=int, default=512, help="document length of packed rows")
    parser.add_argument("--cell", nargs=4, metavar=("PRESET", "SEQ_LEN", "STEPS", "DOC_LEN"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        print(json.dumps(one_cell(args.cell[0], int(args.cell[1]), int(args.cell[2]), int(args.cell[3]))))
        return
    if args.packed_vs_plain:
        packed_vs_plain(args.preset, args.seq_lens, args.steps, args.doc_len)
        return
    if args.scaling:
        scaling(args.preset, max(args.steps, 8))
        return

    print(f"# {args.preset} vs {args.preset}-moe: one optimiser step per row, packed 512-token documents")
    print(
        "| tokens per row | MoE tok/s | ConceptMoE tok/s | R | speed ratio | MoE peak MB | ConceptMoE peak MB | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n in args.seq_lens:
        base = run_cell(f"{args.preset}-moe", n, args.steps)
        cmoe = run_cell(args.preset, n, args.steps)
        print(
            f"| {n} | {base['tokens_per_s']:,.0f} | {cmoe['tokens_per_s']:,.0f} | {cmoe['r']:.2f} "
            f"| {cmoe['tokens_per_s'] / base['tokens_per_s']:.2f}x | {base['peak_mb']:,.0f} | {cmoe['peak_mb']:,.0f} "
            f"| {cmoe['peak_mb'] / base['peak_mb']:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
