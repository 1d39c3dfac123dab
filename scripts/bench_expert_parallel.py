"""Expert parallelism on 2 processes: bytes exchanged per routed input per MoE layer, tokens/s and memory per rank,
``expert_parallel`` 2 against data parallelism (``expert_parallel`` 1) measured in the same run.

    python scripts/bench_expert_parallel.py [--preset small] [--tokens 2048] [--steps 4]

Each setting runs in 2 fresh gloo processes (CPU; NCCL where CUDA is there) on the text backbone of the preset
(ConceptMoE, chunking on): ``--steps`` training steps of forward, backward and the gradient all-reduce a
data-parallel engine does (every gradient at EP 1; at EP 2 all but the experts', which have no replica), on
``--tokens`` random tokens per rank. Measured per setting: the median step's tokens/s (both ranks), the bytes
each rank sends to the other in the token exchanges per routed input (a token or a concept) per MoE layer, the
expert parameters each rank holds, the model state those make (fp32 weights, gradients and Adam's two moments: 16
bytes a parameter) and the process's peak RSS. The formula the exchange is checked against: a routed input
sends ``top_k`` rows of ``d_model`` out and gets them back, ``2 * top_k * d_model * 4`` bytes in fp32, of which
the share for remote experts, ``(N - 1) / N`` under balanced routing, crosses between ranks (here one more
column goes out with each row: its routing weight).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vlm import ConceptMoEConfig, ConceptMoEForCausalLM
from vlm.backbone.expert_parallel import EXPERT_WEIGHTS, ExpertShard, shard_experts
from vlm.backbone.moe import MoE


def _count_exchanges(counter: dict) -> None:
    """Wrap ``dist.all_to_all_single`` to add the bytes this rank sends to other ranks (token exchanges only: the
    calls with split sizes; the fixed-size count exchange is counted apart)."""
    original = dist.all_to_all_single

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        row = input[0].numel() * input.element_size() if input.dim() > 1 and input.shape[0] else 0
        phase = counter["phase"]  # set by the step: "fwd" around the forward, "bwd" around backward()
        if input_split_sizes is None:
            counter["count_bytes"] += input.numel() * input.element_size()
        else:
            me = dist.get_rank(group)
            counter[f"{phase}_remote_bytes"] += sum(n for j, n in enumerate(input_split_sizes) if j != me) * row
            counter[f"{phase}_all_bytes"] += sum(input_split_sizes) * row
        return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = counted


def _count_inputs(counter: dict) -> None:
    """Wrap ``MoE.forward`` to add up the routed inputs (tokens or concepts) of every layer call."""
    original = MoE.forward

    def forward(self, x_TD):
        counter["inputs"] += x_TD.shape[0]
        counter["slots"] += x_TD.shape[0] * self.top_k
        return original(self, x_TD)

    MoE.forward = forward


def _sync_grads(model: torch.nn.Module, world: int) -> None:
    """One flat all-reduce of the replicated gradients (the experts' too when they are not split)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None and getattr(p, "allreduce", True)]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _worker(rank: int, port: int, args, ep: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    keys = ("count_bytes", "fwd_remote_bytes", "fwd_all_bytes", "bwd_remote_bytes", "bwd_all_bytes", "inputs", "slots")
    counter = dict.fromkeys(keys, 0)
    counter["phase"] = "fwd"
    _count_exchanges(counter)
    _count_inputs(counter)
    torch.manual_seed(0)
    config = ConceptMoEConfig.from_preset(args.preset, max_position_embeddings=args.tokens)
    model = ConceptMoEForCausalLM(config)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if ep > 1:
        for moe in layers:
            shard_experts(moe, ExpertShard(group=None, size=ep, rank=rank, num_experts=moe.num_experts))
            for w in EXPERT_WEIGHTS:
                getattr(moe, w).allreduce = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    times = []
    for step in range(args.steps + 1):
        ids = torch.randint(0, config.vocab_size, (1, args.tokens), generator=g)
        if step == 1:  # the first step warms up; its exchanges are not counted
            counter.update(dict.fromkeys(keys, 0))
        start = time.perf_counter()
        counter["phase"] = "fwd"
        loss = model(input_ids=ids, labels=ids).loss
        counter["phase"] = "bwd"
        loss.backward()
        _sync_grads(model, 2)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    experts = sum(getattr(m, w).numel() for m in layers for w in EXPERT_WEIGHTS)
    params = sum(p.numel() for p in model.parameters())
    out[rank] = {
        **counter,
        "step_s": statistics.median(times[1:]),
        "expert_params": experts,
        "params": params,
        "d_model": config.d_model,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    dist.destroy_process_group()


def measure(args, ep: int) -> dict:
    from vlm.training.distributed import free_port

    out = mp.Manager().dict()
    mp.start_processes(_worker, args=(free_port(), args, ep, out), nprocs=2, start_method="spawn", join=True)
    ranks = [out[r] for r in range(2)]
    row = {k: sum(r[k] for r in ranks) for k in ranks[0] if k.endswith("bytes") or k in ("inputs", "slots")}
    row.update(
        tokens_per_s=2 * args.tokens / max(r["step_s"] for r in ranks),
        expert_params_per_rank=ranks[0]["expert_params"],
        params_per_rank=ranks[0]["params"],
        model_state_mb_per_rank=ranks[0]["params"] * 16 / 2**20,
        peak_rss_mb=max(r["peak_rss_mb"] for r in ranks),
        d_model=ranks[0]["d_model"],
    )
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="a ConceptMoE text preset (its experts must split by 2)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank per step")
    parser.add_argument("--steps", type=int, default=4, help="measured steps (after one warm-up step)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    rows = {ep: measure(args, ep) for ep in (1, 2)}
    two, one = rows[2], rows[1]
    per_input = two["fwd_all_bytes"] / two["inputs"]
    remote = two["fwd_remote_bytes"] / two["inputs"]
    backward = two["bwd_all_bytes"] / two["inputs"]
    formula = 2 * (two["slots"] / two["inputs"]) * two["d_model"] * 4
    print(f"preset {args.preset}, 2 processes, {args.tokens} tokens per rank per step, fp32")
    print("| expert_parallel | tokens/s | expert params / rank | params / rank | model state / rank | peak RSS |")
    print("|---|---|---|---|---|---|")
    for ep, r in rows.items():
        print(
            f"| {ep} | {r['tokens_per_s']:,.0f} | {r['expert_params_per_rank']:,} | {r['params_per_rank']:,} | "
            f"{r['model_state_mb_per_rank']:.0f} MB | {r['peak_rss_mb']:.0f} MB |"
        )
    print(
        f"EP 2 / EP 1: tokens/s {two['tokens_per_s'] / one['tokens_per_s']:.2f}x, model state per rank "
        f"{two['model_state_mb_per_rank'] / one['model_state_mb_per_rank']:.2f}x"
    )
    print(
        f"bytes per routed input per MoE layer, forward (out and back): {per_input:,.0f} for all its slots "
        f"(formula 2 * top_k * d_model * 4 = {formula:,.0f}; ratio {per_input / formula:.3f}), {remote:,.0f} of "
        f"them to the other rank (share {remote / per_input:.2f}); the backward exchanges {backward:,.0f} more; "
        f"the count exchange {two['count_bytes'] / 2:,.0f} bytes per rank over the run"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(k): v for k, v in rows.items()}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
