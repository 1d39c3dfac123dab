"""Training-step throughput: ConceptMoE vs its compute-matched MoE baseline, and the MoE layer vs a dense FFN.

    python scripts/bench_model.py [--preset small] [--seq-lens 1024 4096] [--repeats 3]

All numbers come from one run on this machine and are printed as ratios against the baseline measured
in the same run. Forward + backward, fp32, batch 1, random init. Two row layouts: one document per row
(plain causal attention) and packed rows of 512-token documents (``doc_ids``: document-masked attention,
as in training). ConceptMoE is shown with ``fixed`` chunking at exactly R = 2 and with the learned
(``dynamic``) router; the dynamic router starts from random q/k here (p ~ 0.5, so R ~ 2 at init: the
identity init of H-Net starts far above R = 2 on an untrained ``small`` model) and its measured R is printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vlm import ConceptMoEConfig, ConceptMoEForCausalLM, flops
from vlm.layers import SwiGLU
from vlm.moe import MoE


def time_fwd_bwd(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def model_step(config: ConceptMoEConfig, seq_len: int, repeats: int, doc_len: int | None) -> tuple[float, float]:
    torch.manual_seed(0)
    model = ConceptMoEForCausalLM(config).train()
    ids = torch.randint(0, config.vocab_size, (1, seq_len))
    doc_ids = None if doc_len is None else (torch.arange(seq_len) // doc_len)[None]
    stats = {}

    def step():
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids, doc_ids=doc_ids)
        out.loss.backward()
        stats.update(out.chunk_stats)

    seconds = time_fwd_bwd(step, repeats)
    return seq_len / seconds, stats["r"]


def layer_step(module, d_model: int, tokens: int, repeats: int) -> float:
    x = torch.randn(tokens, d_model, requires_grad=True)
    grad = torch.randn(tokens, d_model)  # a dense upstream gradient, as inside a model

    def step():
        out = module(x)
        y = out[0] if isinstance(out, tuple) else out
        (y * grad).sum().backward()

    return tokens / time_fwd_bwd(step, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="ConceptMoE preset; its baseline is <preset>-moe")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    base = ConceptMoEConfig.from_preset(f"{args.preset}-moe")
    cmoe = ConceptMoEConfig.from_preset(args.preset, router_init="random")
    fixed = ConceptMoEConfig.from_preset(args.preset, chunking="fixed")
    report = flops.match_report(base, cmoe)
    print(f"# {args.preset} vs {args.preset}-moe, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"# params {report['params_mismatch']:+.2%}, linear FLOPs/token {report['flops_linear_mismatch']:+.2%}")
    for layout, doc_len in (("one document per row", None), ("packed rows, 512-token documents", 512)):
        print(f"\n{layout}:\n")
        print("| seq len | MoE tok/s | ConceptMoE fixed R=2 tok/s | ratio | ConceptMoE dynamic tok/s | R | ratio |")
        print("|---|---|---|---|---|---|---|")
        for n in args.seq_lens:
            base_tps, _ = model_step(base, n, args.repeats, doc_len)
            fix_tps, _ = model_step(fixed, n, args.repeats, doc_len)
            dyn_tps, dyn_r = model_step(cmoe, n, args.repeats, doc_len)
            print(
                f"| {n} | {base_tps:,.0f} | {fix_tps:,.0f} | {fix_tps / base_tps:.2f}x "
                f"| {dyn_tps:,.0f} | {dyn_r:.2f} | {dyn_tps / base_tps:.2f}x |",
                flush=True,
            )

    d, f, k, e, s = base.d_model, base.expert_dim, base.top_k, base.num_experts, base.shared_experts
    tokens = max(args.seq_lens)
    torch.manual_seed(0)
    moe = MoE(d, e, k, f, shared_experts=s)
    for w in (moe.w_gate_up, moe.w_down):
        torch.nn.init.normal_(w, std=0.02)
    dense = SwiGLU(d, (k + s) * f)  # same active FLOPs as the MoE (router excluded)
    layer_repeats = max(args.repeats, 7)  # cheap: more repeats for a stable median
    moe_tps, dense_tps = layer_step(moe, d, tokens, layer_repeats), layer_step(dense, d, tokens, layer_repeats)
    print(f"\n| layer ({tokens} tokens, d={d}) | tok/s | ratio |")
    print("|---|---|---|")
    print(f"| dense SwiGLU, hidden {(k + s) * f} | {dense_tps:,.0f} | 1.00x |")
    print(f"| MoE E={e} top-{k} F={f} + {s} shared | {moe_tps:,.0f} | {moe_tps / dense_tps:.2f}x |")


if __name__ == "__main__":
    main()
