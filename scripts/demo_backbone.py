"""CPU demo: train a ConceptMoE backbone and its compute-matched MoE baseline on local text, side by side.

    python scripts/demo_backbone.py [--preset tiny] [--steps 500] [--out runs/demo]

The corpus is the standard library's docstrings of this Python (no network), byte-tokenised. Prints
loss and R while training, then held-out bits per byte and R for both models. With ``--out`` the
ConceptMoE model is saved with ``save_pretrained`` (loadable with ``AutoModelForCausalLM``).
"""

from __future__ import annotations

import argparse
import time

import torch

from data_pipelines.local_text import ByteTokenizer, load_local_text_corpus, packed_batches
from vlm import ConceptMoEConfig, ConceptMoEForCausalLM
from vlm.accounting import flops
from vlm.training.single_process import TrainConfig, evaluate, train


def run(name: str, config: ConceptMoEConfig, corpus: dict, args) -> dict:
    tok = ByteTokenizer()
    torch.manual_seed(args.seed)
    model = ConceptMoEForCausalLM(config)
    start = time.time()

    def log(rec: dict) -> None:
        if rec["skipped"]:
            print(f"[{name}] step {rec['step']:4d}  skipped (non-finite loss)", flush=True)
        elif rec["step"] % args.log_every == 0 or rec["step"] == 1:
            ratio = f" ratio {rec['ratio_loss']:.3f}" if config.chunking == "dynamic" else ""
            print(
                f"[{name}] step {rec['step']:4d}  loss {rec['loss']:.3f}  lm {rec['lm_loss']:.3f}{ratio}  "
                f"R {rec['r']:.2f}  {rec['tokens_per_s']:,.0f} tok/s",
                flush=True,
            )

    batches = packed_batches(corpus["train"], tok, args.seq_len, args.batch_size, seed=args.seed)
    history = train(
        model,
        batches,
        TrainConfig(max_steps=args.steps, save_every=args.steps, seed=args.seed, lr=args.lr, warmup=20),
        on_step=log,
    )
    held_out = evaluate(model, packed_batches(corpus["eval"], tok, args.seq_len, args.batch_size, seed=0))
    tail = [h for h in history[-min(50, len(history)) :] if not h["skipped"]]
    return {
        "model": model,
        "params": flops.count(config)["params_total"],
        "train_r": sum(h["r"] for h in tail) / len(tail),
        "eval_r": held_out["eval_r"],
        "bits_per_byte": held_out["eval_bits_per_token"],
        "minutes": (time.time() - start) / 60,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="ConceptMoE preset (baseline: <preset>-moe)")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--no-baseline", action="store_true", help="train only the ConceptMoE model")
    parser.add_argument("--out", default=None, help="save the trained ConceptMoE model here (HF format)")
    args = parser.parse_args()

    corpus = load_local_text_corpus()
    n_bytes = sum(len(d.encode()) for d in corpus["train"])
    print(f"corpus: {len(corpus['train'])} train / {len(corpus['eval'])} eval docstrings, {n_bytes / 1e6:.1f} MB")
    vocab = ByteTokenizer.vocab_size
    runs = {args.preset: ConceptMoEConfig.from_preset(args.preset, vocab_size=vocab)}
    if not args.no_baseline:
        runs[f"{args.preset}-moe"] = ConceptMoEConfig.from_preset(f"{args.preset}-moe", vocab_size=vocab)
    results = {name: run(name, config, corpus, args) for name, config in runs.items()}

    print("\n| model | params | target R | train R (last 50) | eval R | eval bits/byte | minutes |")
    print("|---|---|---|---|---|---|---|")
    for name, res in results.items():
        target = runs[name].effective_r
        print(
            f"| {name} | {res['params'] / 1e6:.2f}M | {target:.1f} | {res['train_r']:.2f} | {res['eval_r']:.2f} "
            f"| {res['bits_per_byte']:.3f} | {res['minutes']:.1f} |"
        )
    if args.out:
        results[args.preset]["model"].save_pretrained(args.out)
        print(f"saved {args.preset} to {args.out}")


if __name__ == "__main__":
    main()
