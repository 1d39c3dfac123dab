"""Expert parallelism (EP): each rank of an EP group holds ``E / N`` of a MoE layer's experts, and tokens travel
to the rank that owns their expert and back with two ``all_to_all`` exchanges.

The router and the shared experts stay replicated; only the stacked routed-expert weights (``MoE.w_gate_up``,
``MoE.w_down``) are split, rank ``r`` holding experts ``[r * E / N, (r + 1) * E / N)``. One layer's forward:

1. route locally (every rank routes its own tokens over all ``E`` experts, exactly as without EP);
2. sort the (token, expert) slots by expert, so the slots for rank ``j`` are one contiguous block;
3. exchange the per-expert slot counts (a fixed-size ``all_to_all``), then the slots' hidden states with their
   routing weights as one extra column (``all_to_all_single`` with those split sizes: dropless, no capacity factor);
4. the local experts run on what arrived, regrouped by local expert (the same ``MoE.expert_ffn``);
5. the outputs travel back by the reverse exchange and are added to their tokens.

Every rank takes part in both exchanges even when it sends or receives nothing, so a batch that routes no token
to a remote expert cannot hang the group. Gradients flow through the exchanges (the backward of an
``all_to_all`` is the ``all_to_all`` with the split sizes swapped), so an expert's gradient sums the contributions
of every rank's tokens: divided by the data-parallel world size, as DeepSpeed does, it equals the data-parallel
average of the same step without EP. Pure ``torch.distributed``: gloo on CPU, NCCL on GPUs.
"""

# Shape suffixes (docs/paper.md §0): D model width, S (token, expert) slots sent by this rank, R slots received,
# N ranks of the EP group, L local experts per rank.

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

EXPERT_WEIGHTS = ("w_gate_up", "w_down")  # the stacked routed-expert parameters of a MoE layer, split by EP


@dataclass(frozen=True)
class ExpertShard:
    """Where a MoE layer's experts live: ``size`` ranks in ``group``, this one ``rank``, ``num_experts`` in all."""

    group: object  # a torch.distributed ProcessGroup (None: the default group)
    size: int
    rank: int
    num_experts: int

    def __post_init__(self):
        if self.num_experts % self.size:
            raise ValueError(f"expert_parallel {self.size} must divide num_experts {self.num_experts}")

    @property
    def local(self) -> int:
        """Experts per rank (``L``)."""
        return self.num_experts // self.size

    @property
    def first(self) -> int:
        """The global index of this rank's first expert."""
        return self.rank * self.local


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with variable splits along dim 0; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows ``x[sum(in_splits[:j]) : ...]`` go to rank ``j``; ``out_splits[j]`` rows arrive from rank ``j``."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def exchange_counts(counts_E: torch.Tensor, shard: ExpertShard) -> torch.Tensor:
    """Every rank's slot counts for this rank's experts: ``[N, L]``, row ``j`` from rank ``j``."""
    received = torch.empty_like(counts_E)
    dist.all_to_all_single(received, counts_E.contiguous(), group=shard.group)
    return received.view(shard.size, shard.local)


def expert_parallel_ffn(moe, x_SD: torch.Tensor, weight_S: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """``moe.expert_ffn`` over experts spread across the EP group: slots sorted by global expert in, outputs in the
    same order out (steps 3-5 of the module docstring)."""
    shard: ExpertShard = moe.expert_shard
    send = counts_E.view(shard.size, shard.local).sum(1).tolist()
    counts_NL = exchange_counts(counts_E, shard)
    recv = counts_NL.sum(1).tolist()
    # hidden states and routing weights travel as one tensor: one exchange, so one backward exchange, in the same
    # order on every rank (two exchanges could run their backwards in different orders on different ranks)
    xw_RD1 = all_to_all(torch.cat([x_SD, weight_S[:, None].to(x_SD.dtype)], dim=1), recv, send, shard.group)
    x_RD, weight_R = xw_RD1[:, :-1], xw_RD1[:, -1]
    # what arrived is ordered (source rank, local expert): regroup it by local expert for the expert matmuls
    local_R = torch.arange(shard.local, device=counts_NL.device).repeat(shard.size)
    order_R = torch.argsort(local_R.repeat_interleave(counts_NL.reshape(-1)), stable=True)
    y_RD = moe.expert_ffn(x_RD[order_R], weight_R[order_R], counts_NL.sum(0))
    y_RD = torch.empty_like(y_RD).index_copy(0, order_R, y_RD)
    if y_RD.shape[0] == 0:  # nothing arrived: keep the exchange in the graph, its backward is a collective
        y_RD = y_RD + 0.0 * xw_RD1.sum()
    return all_to_all(y_RD, send, recv, shard.group)


def shard_experts(moe, shard: ExpertShard) -> None:
    """Keep only this rank's experts of ``moe`` (its stacked weights sliced to ``[first, first + L)``)."""
    if moe.num_experts != shard.num_experts:
        raise ValueError(f"the shard is for {shard.num_experts} experts, the layer has {moe.num_experts}")
    for name in EXPERT_WEIGHTS:
        full = getattr(moe, name)
        if full.shape[0] != moe.num_experts:
            raise ValueError(f"{name} is already split ({full.shape[0]} of {moe.num_experts} experts)")
        local = full.detach()[shard.first : shard.first + shard.local].clone()
        setattr(moe, name, torch.nn.Parameter(local, requires_grad=full.requires_grad))
    moe.expert_shard = shard


def gather_experts(moe) -> dict[str, torch.Tensor]:
    """Every expert of a split layer, gathered from the EP group: ``{name: [E, ...]}`` (a collective)."""
    shard: ExpertShard = moe.expert_shard
    out = {}
    for name in EXPERT_WEIGHTS:
        local = getattr(moe, name).detach().contiguous()
        parts = [torch.empty_like(local) for _ in range(shard.size)]
        dist.all_gather(parts, local, group=shard.group)
        out[name] = torch.cat(parts)
    return out
