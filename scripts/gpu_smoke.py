"""GPU smoke test: the whole toolkit on one GPU in a few minutes, one line per check.

    python scripts/gpu_smoke.py [--out runs/gpu_smoke] [--preset small] [--steps 20]

1. shards: synthetic scenes + text (``scripts/make_shards.py``);
2. train: ``deepspeed --num_gpus 1 scripts/train_vlm.py``, ZeRO-2 in bf16 (``scripts/configs/zero2_bf16.json``),
   the first half of ``--steps``, then ``--resume auto`` to the end: finite losses, R > 1, each step logged once;
3. export: the run's HF folder loads with ``AutoModelForImageTextToText`` / ``AutoProcessor``;
4. generate: greedy decoding from an image + question on the GPU, in bf16;
5. bench: ``scripts/bench_inference.py`` 4K prefill / decode cells in bf16 (ConceptMoE vs its matched MoE);
6. expert_parallel (2 GPUs or more): ``deepspeed --num_gpus 2``, ZeRO-2 in bf16, ``train.expert_parallel`` 2 and 1
   from the same weights on the same data: NCCL all-to-all, per-step losses side by side (``SKIP`` on one GPU; on
   CPU the same comparison runs in fp32 in ``tests/vlm/training/test_expert_parallel_run.py``).

Each line reads ``PASS|FAIL|SKIP <check> <seconds> <detail>``; the exit code is the number of failed checks. Without a
GPU it stops at once (``--allow-cpu`` runs the same checks on CPU at toy size: how CI keeps this script working).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _run(cmd: list[str], timeout: int) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"exit {proc.returncode}: {tail[0][:300]}")
    return proc.stdout


def check_shards(args) -> str:
    _run(
        [
            sys.executable,
            "scripts/make_shards.py",
            "--synthetic",
            "scenes,text",
            "--out",
            str(args.out / "shards"),
            "--num-samples",
            str(args.samples),
            "--seed",
            "0",
        ],
        timeout=600,
    )
    return f"{args.samples} samples per kind in {args.out / 'shards'}"


def _train(args, steps: int, resume: bool, run: str = "run", gpus: int = 1, extra: tuple = ()) -> None:
    launcher = (
        [sys.executable]
        if args.cpu
        else [str(BIN / "deepspeed"), "--num_gpus", str(gpus), "--master_port", str(args.master_port)]
    )
    cmd = launcher + [
        "scripts/train_vlm.py",
        "--config",
        "scripts/configs/tiny.yaml",
        "--deepspeed",
        "scripts/configs/zero2_bf16.json",
        "--out",
        str(args.out / run),
    ]
    cmd += ["--resume", "auto"] if resume else ["--overwrite"]
    sets = [
        *extra,
        f"model.preset={args.preset}",
        f"data.shards=[{args.out / 'shards' / 'train'}]",
        f"data.eval_shards=[{args.out / 'shards' / 'eval'}]",
        f"data.seq_len={args.seq_len}",
        f"train.max_steps={steps}",
        f"train.save_every={max(1, args.steps // 2)}",
        "train.eval_every=0",
        f"train.warmup={max(1, args.steps // 4)}",
        f"train.export={'true' if steps == args.steps and run == 'run' else 'false'}",
    ]
    _run(cmd + [arg for s in sets for arg in ("--set", s)], timeout=1800)


def check_train(args) -> str:
    _train(args, args.steps // 2, resume=False)
    _train(args, args.steps, resume=True)
    records = [json.loads(line) for line in (args.out / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r.get("split") != "eval"]
    if steps != list(range(1, args.steps + 1)):
        raise RuntimeError(f"steps logged {steps[:5]}...; want 1..{args.steps} once each")
    losses = [r["loss"] for r in records if not r.get("skipped")]
    if not all(math.isfinite(x) for x in losses) or records[-1]["r"] <= 1.0:
        raise RuntimeError(f"loss {losses[-1]} R {records[-1]['r']}")
    ds = json.loads((args.out / "run" / "ds_config.json").read_text())
    precision = "bf16" if ds.get("bf16", {}).get("enabled") else "fp32"
    tps = records[-1]["tokens_per_s"]
    return (
        f"{args.steps} steps ({precision}, ZeRO-2, resumed at {args.steps // 2}): loss {losses[0]:.3f} -> "
        f"{losses[-1]:.3f}, R {records[-1]['r']:.2f}, {tps:,.0f} tok/s"
    )


def _load(args):
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    import vlm  # noqa: F401  (registers the Auto classes)

    device = "cpu" if args.cpu else "cuda"
    model = AutoModelForImageTextToText.from_pretrained(args.out / "run" / "hf", dtype=torch.bfloat16).to(device)
    return model.eval(), AutoProcessor.from_pretrained(args.out / "run" / "hf"), device


def check_export(args) -> str:
    model, _, device = _load(args)
    n = sum(p.numel() for p in model.parameters())
    return f"{n / 1e6:.1f}M parameters on {device} in {next(model.parameters()).dtype}"


def check_generate(args) -> str:
    import torch
    from PIL import Image

    model, processor, device = _load(args)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    batch = processor(text=[prompt], images=[[Image.new("RGB", (96, 64), (200, 30, 30))]], return_tensors="pt")
    batch = {k: v.to(device) for k, v in batch.items()}
    batch = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in batch.items()}
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=16, do_sample=False)
    text = processor.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)[0]
    return f"{out.shape[1] - batch['input_ids'].shape[1]} new tokens: {text[:60]!r}"


def check_bench(args) -> str:
    device = ["--device", "cpu", "--dtype", "fp32"] if args.cpu else ["--device", "cuda", "--dtype", "bf16"]
    lengths = "256" if args.cpu else "4096"
    out = _run(
        [
            sys.executable,
            "scripts/bench_inference.py",
            "--preset",
            args.bench_preset,
            *device,
            "--lengths",
            lengths,
            "--decode-lengths",
            lengths,
            "--batches",
            "1",
            "--repeats",
            "2",
            "--json",
            str(args.out / "bench.json"),
        ],
        timeout=1800,
    )
    rows = [line for line in out.splitlines() if line.startswith("|") and "x" in line]
    return f"{len(rows)} rows in {args.out / 'bench.json'}"


def check_expert_parallel(args) -> str:
    import torch

    if args.cpu or torch.cuda.device_count() < 2:
        return "SKIP: fewer than 2 GPUs"
    losses = {}
    for ep in (1, 2):
        _train(args, args.steps, resume=False, run=f"ep{ep}", gpus=2, extra=(f"train.expert_parallel={ep}",))
        lines = (args.out / f"ep{ep}" / "metrics.jsonl").read_text().splitlines()
        losses[ep] = [r["loss"] for r in map(json.loads, lines) if r.get("split") != "eval"]
    gap = max(abs(a - b) for a, b in zip(losses[1], losses[2]))
    if len(losses[2]) != args.steps or gap > 0.05:
        raise RuntimeError(f"EP 2 vs EP 1 losses differ by up to {gap:.4f} over {len(losses[2])} steps")
    return f"{args.steps} steps on 2 GPUs (bf16, ZeRO-2): EP 2 losses within {gap:.2e} of EP 1"


CHECKS = (
    ("shards", check_shards),
    ("train", check_train),
    ("export", check_export),
    ("generate", check_generate),
    ("bench", check_bench),
    ("expert_parallel", check_expert_parallel),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_smoke"))
    parser.add_argument("--preset", default="small", help="VLM preset to train")
    parser.add_argument("--bench-preset", default="small-moe", help="baseline preset of the inference benchmark")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--master-port", type=int, default=29611)
    parser.add_argument("--allow-cpu", action="store_true", help="run on CPU when there is no GPU (toy sizes)")
    args = parser.parse_args(argv)
    import torch

    args.cpu = not torch.cuda.is_available()
    if args.cpu and not args.allow_cpu:
        print("FAIL cuda 0s no CUDA device (torch.cuda.is_available() is False); --allow-cpu runs the CPU path")
        return 1
    if not args.cpu:
        print(f"INFO device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name, check in CHECKS:
        start = time.perf_counter()
        try:
            detail, status = check(args), "PASS"
        except Exception as err:  # noqa: BLE001 (one line per check, whatever went wrong)
            detail, status = f"{type(err).__name__}: {str(err).strip()[:300]}", "FAIL"
            failed += 1
        if detail.startswith("SKIP"):
            status, detail = "SKIP", detail.removeprefix("SKIP: ")
        print(f"{status} {name} {time.perf_counter() - start:.0f}s {detail}", flush=True)
        if status == "FAIL" and name in ("shards", "train"):
            break  # the later checks need the run
    return failed


if __name__ == "__main__":
    raise SystemExit(main())
