"""Training-step throughput: ConceptMoE vs its compute-matched MoE baseline, and the MoE layer vs a dense FFN.

    python scripts/bench_model.py [--preset small] [--seq-lens 1024 4096] [--repeats 3]

All numbers come from one run on this machine and are printed as ratios against the baseline measured
in the same run. Forward + backward, fp32, batch 1, random init. Two row layouts: one document per row
(plain causal attention) and packed rows of 512-token documents (``doc_ids``: document-masked attention,
as in training). ConceptMoE is shown with ``fixed`` chunking at exactly R = 2 and with the learned
(``dynamic``) router; the dynamic router starts from random q/k here (p ~ 0.5, so R ~ 2 at init: the
identity init of H-Net starts far above R = 2 on an untrained ``small`` model) and its measured R is printed.

``--packed-vs-plain`` (issue #16) times instead, interleaved in one process, each model (``<preset>`` fixed R=2 and
``<preset>-moe``) on one plain causal row and on a packed row of ``--doc-len``-token documents of the same length
(document-aware attention, ``vlm.backbone.doc_attention``) and prints packed / plain. Peak memory: bench_train.py.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vlm import ConceptMoEConfig, ConceptMoEForCausalLM
from vlm.accounting import flops
from vlm.backbone.layers import SwiGLU
from vlm.backbone.moe import MoE


def interleaved_medians(steps: dict, repeats: int) -> dict:
    """Median seconds per step of each callable, timed round-robin (one warm-up each first).

    Interleaving matters on a shared machine: clock and load drift hit every candidate alike instead
    of whichever happened to run during a slow spell.
    """
    for step in steps.values():
        step()
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def model_step(config: ConceptMoEConfig, seq_len: int, doc_len: int | None, stats: dict):
    """A forward + backward closure for a fresh model; its chunk statistics land in ``stats``."""
    torch.manual_seed(0)
    model = ConceptMoEForCausalLM(config).train()
    ids = torch.randint(0, config.vocab_size, (1, seq_len))
    doc_ids = None if doc_len is None else (torch.arange(seq_len) // doc_len)[None]

    def step():
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids, doc_ids=doc_ids)
        out.loss.backward()
        stats.update(out.chunk_stats)

    return step


def packed_vs_plain(preset: str, seq_lens: list[int], doc_len: int, repeats: int):
    """Packed rows against one plain causal row of the same length, same model, timed round-robin."""
    print(f"\npacked rows of {doc_len}-token documents vs one plain causal row (forward + backward):\n")
    print("| seq len | MoE plain tok/s | MoE packed tok/s | ratio | CMoE R=2 plain tok/s | packed tok/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for n in seq_lens:
        longest = max(n, 8192)  # plain rows use positions up to n - 1
        base_n = ConceptMoEConfig.from_preset(f"{preset}-moe", max_position_embeddings=longest)
        # fixed chunking: exactly R = 2 in both layouts, so the ratio measures the attention path alone (a random
        # dynamic router gives packed and plain rows different R, which changes the concept model's work)
        cmoe_n = ConceptMoEConfig.from_preset(preset, chunking="fixed", max_position_embeddings=longest)
        steps = {
            "base plain": model_step(base_n, n, None, {}),
            "base packed": model_step(base_n, n, doc_len, {}),
            "cmoe plain": model_step(cmoe_n, n, None, {}),
            "cmoe packed": model_step(cmoe_n, n, doc_len, {}),
        }
        tps = {name: n / sec for name, sec in interleaved_medians(steps, repeats).items()}
        print(
            f"| {n} | {tps['base plain']:,.0f} | {tps['base packed']:,.0f} "
            f"| {tps['base packed'] / tps['base plain']:.2f}x | {tps['cmoe plain']:,.0f} | {tps['cmoe packed']:,.0f} "
            f"| {tps['cmoe packed'] / tps['cmoe plain']:.2f}x |",
            flush=True,
        )


def layer_step(module, x: torch.Tensor, grad: torch.Tensor):
    def step():
        module.zero_grad(set_to_none=True)
        out = module(x)
        y = out[0] if isinstance(out, tuple) else out
        (y * grad).sum().backward()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="ConceptMoE preset; its baseline is <preset>-moe")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per model (median)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--packed-vs-plain", action="store_true", help="packed vs plain causal rows (issue #16)")
    parser.add_argument("--doc-len", type=int, default=512, help="document length of packed rows")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    base = ConceptMoEConfig.from_preset(f"{args.preset}-moe")
    cmoe = ConceptMoEConfig.from_preset(args.preset, boundary_router_init="random")
    fixed = ConceptMoEConfig.from_preset(args.preset, chunking="fixed")
    report = flops.match_report(base, cmoe)
    print(f"# {args.preset} vs {args.preset}-moe, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"# params {report['params_mismatch']:+.2%}, linear FLOPs/token {report['flops_linear_mismatch']:+.2%}")
    if args.packed_vs_plain:
        packed_vs_plain(args.preset, args.seq_lens, args.doc_len, args.repeats)
        return
    for layout, doc_len in (("one document per row", None), ("packed rows, 512-token documents", 512)):
        print(f"\n{layout}:\n")
        print("| seq len | MoE tok/s | ConceptMoE fixed R=2 tok/s | ratio | ConceptMoE dynamic tok/s | R | ratio |")
        print("|---|---|---|---|---|---|---|")
        for n in args.seq_lens:
            dyn_stats = {}
            steps = {
                "base": model_step(base, n, doc_len, {}),
                "fixed": model_step(fixed, n, doc_len, {}),
                "dynamic": model_step(cmoe, n, doc_len, dyn_stats),
            }
            tps = {name: n / sec for name, sec in interleaved_medians(steps, args.repeats).items()}
            print(
                f"| {n} | {tps['base']:,.0f} | {tps['fixed']:,.0f} | {tps['fixed'] / tps['base']:.2f}x "
                f"| {tps['dynamic']:,.0f} | {dyn_stats['r']:.2f} | {tps['dynamic'] / tps['base']:.2f}x |",
                flush=True,
            )

    d, f, k, e, s = base.d_model, base.expert_dim, base.top_k, base.num_experts, base.shared_experts
    tokens = max(args.seq_lens)
    torch.manual_seed(0)
    moe = MoE(d, e, k, f, shared_experts=s)
    for w in (moe.w_gate_up, moe.w_down):
        torch.nn.init.normal_(w, std=0.02)
    dense = SwiGLU(d, (k + s) * f)  # same active FLOPs as the MoE (router excluded)
    x = torch.randn(tokens, d, requires_grad=True)
    grad = torch.randn(tokens, d)  # a dense upstream gradient, as inside a model
    steps = {"moe": layer_step(moe, x, grad), "dense": layer_step(dense, x, grad)}
    sec = interleaved_medians(steps, max(args.repeats, 15))  # cheap: more rounds for a stable median
    moe_tps, dense_tps = tokens / sec["moe"], tokens / sec["dense"]
    print(f"\n| layer ({tokens} tokens, d={d}) | tok/s | ratio |")
    print("|---|---|---|")
    print(f"| dense SwiGLU, hidden {(k + s) * f} | {dense_tps:,.0f} | 1.00x |")
    print(f"| MoE E={e} top-{k} F={f} + {s} shared | {moe_tps:,.0f} | {moe_tps / dense_tps:.2f}x |")


if __name__ == "__main__":
    main()
