"""Training-step throughput: ConceptMoE vs its compute-matched MoE baseline, and the MoE layer vs a dense FFN.

    python scripts/bench_model.py [--preset small] [--seq-lens 1024 4096] [--repeats 3]

All numbers come from one run on this machine and are printed as ratios against the baseline measured
in the same run. Forward + backward, fp32, batch 1, random init (the dynamic router's R at init is
measured and printed; ``fixed`` chunking at exactly R = 2 is shown beside it).
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


def model_step(config: ConceptMoEConfig, seq_len: int, repeats: int) -> tuple[float, float]:
    torch.manual_seed(0)
    model = ConceptMoEForCausalLM(config).train()
    ids = torch.randint(0, config.vocab_size, (1, seq_len))
    stats = {}

    def step():
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids)
        out.loss.backward()
        stats.update(out.chunk_stats)

    seconds = time_fwd_bwd(step, repeats)
    return seq_len / seconds, stats["r"]


def layer_step(module, d_model: int, tokens: int, repeats: int) -> float:
    x = torch.randn(tokens, d_model, requires_grad=True)

    def step():
        out = module(x)
        y = out[0] if isinstance(out, tuple) else out
        y.sum().backward()

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
    cmoe = ConceptMoEConfig.from_preset(args.preset)
    fixed = ConceptMoEConfig.from_preset(args.preset, chunking="fixed")
    report = flops.match_report(base, cmoe)
    print(f"# {args.preset} vs {args.preset}-moe, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"# params {report['params_mismatch']:+.2%}, linear FLOPs/token {report['flops_linear_mismatch']:+.2%}")
    print(
        "\n| seq len | baseline tok/s | ConceptMoE (dynamic) tok/s | R | ratio | ConceptMoE (fixed R=2) tok/s | ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in args.seq_lens:
        base_tps, _ = model_step(base, n, args.repeats)
        dyn_tps, dyn_r = model_step(cmoe, n, args.repeats)
        fix_tps, _ = model_step(fixed, n, args.repeats)
        print(
            f"| {n} | {base_tps:,.0f} | {dyn_tps:,.0f} | {dyn_r:.2f} | {dyn_tps / base_tps:.2f}x "
            f"| {fix_tps:,.0f} | {fix_tps / base_tps:.2f}x |"
        )

    d, f, k, e, s = base.d_model, base.expert_dim, base.top_k, base.num_experts, base.shared_experts
    tokens = max(args.seq_lens)
    torch.manual_seed(0)
    moe = MoE(d, e, k, f, shared_experts=s)
    for w in (moe.w_gate_up, moe.w_down):
        torch.nn.init.normal_(w, std=0.02)
    dense = SwiGLU(d, (k + s) * f)  # same active FLOPs as the MoE (router excluded)
    moe_tps, dense_tps = layer_step(moe, d, tokens, args.repeats), layer_step(dense, d, tokens, args.repeats)
    print(f"\n| layer ({tokens} tokens, d={d}) | tok/s | ratio |")
    print("|---|---|---|")
    print(f"| dense SwiGLU, hidden {(k + s) * f} | {dense_tps:,.0f} | 1.00x |")
    print(f"| MoE E={e} top-{k} F={f} + {s} shared | {moe_tps:,.0f} | {moe_tps / dense_tps:.2f}x |")


if __name__ == "__main__":
    main()
