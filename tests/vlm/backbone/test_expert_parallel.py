"""Expert parallelism on 2 gloo processes: a split MoE layer equals the whole one, forward and backward.

Each rank routes its own tokens; with the experts split over the 2 ranks, every rank's output must equal the
whole layer's output on the same tokens, the router's gradient must equal its local one, and each rank's expert
gradients must equal the whole layer's gradients summed over both ranks' tokens, for its own experts.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vlm.backbone.expert_parallel import ExpertShard, gather_experts, shard_experts
from vlm.backbone.moe import MoE

E, D, F, TOP_K, T = 8, 16, 12, 2, 24


def whole_layer(mode: str) -> MoE:
    torch.manual_seed(0)
    moe = MoE(D, E, TOP_K, F, shared_experts=1)
    for w in (moe.w_gate_up, moe.w_down):
        torch.nn.init.normal_(w, std=0.2)
    if mode == "only_rank0_experts":  # positive tokens, a router that sends every one to experts 0 and 1
        with torch.no_grad():
            moe.router.weight.zero_()
            moe.router.weight[0], moe.router.weight[1] = 5.0, 4.0
    return moe.double()


def tokens(rank: int, mode: str) -> torch.Tensor:
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)
    if mode == "no_tokens" and rank == 1:
        return x[:0]
    return x.abs() if mode == "only_rank0_experts" else x


def run_layer(moe: MoE, x_TD: torch.Tensor) -> tuple[torch.Tensor, dict]:
    x_TD = x_TD.clone().requires_grad_(True)
    y_TD, stats = moe(x_TD)
    g_TD = torch.linspace(-1, 1, y_TD.numel(), dtype=y_TD.dtype).view_as(y_TD)
    ((y_TD * g_TD).sum() + stats.balance_loss).backward()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    return y_TD.detach(), {**grads, "x": x_TD.grad.clone()}


MODES = ("routed", "only_rank0_experts", "no_tokens")


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for mode in MODES:  # one process group for every case: spawning is most of the cost
            moe = whole_layer(mode)
            shard_experts(moe, ExpertShard(group=None, size=2, rank=rank, num_experts=E))
            y, grads = run_layer(moe, tokens(rank, mode))
            full = gather_experts(moe)
            out[(mode, rank)] = {"y": y, "grads": grads, "full": full, "local": moe.w_gate_up.shape[0]}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    from vlm.training.distributed import free_port

    out = mp.Manager().dict()
    mp.start_processes(_worker, args=(free_port(), out), nprocs=2, start_method="spawn", join=True)
    return dict(out)


@pytest.mark.parametrize("mode", MODES)
def test_split_layer_equals_whole_layer(two_ranks, mode):
    got = [two_ranks[(mode, r)] for r in range(2)]
    ref = [run_layer(whole_layer(mode), tokens(r, mode)) for r in range(2)]
    half = E // 2
    for r in range(2):
        assert got[r]["local"] == half  # each rank holds exactly its share of the experts
        torch.testing.assert_close(got[r]["y"], ref[r][0], rtol=0, atol=1e-12)
        torch.testing.assert_close(got[r]["grads"]["x"], ref[r][1]["x"], rtol=0, atol=1e-12)
        torch.testing.assert_close(got[r]["grads"]["router.weight"], ref[r][1]["router.weight"], rtol=0, atol=1e-12)
        for name in ("w_gate_up", "w_down"):
            summed = ref[0][1][name] + ref[1][1][name]
            torch.testing.assert_close(got[r]["grads"][name], summed[r * half : (r + 1) * half], rtol=0, atol=1e-12)
            torch.testing.assert_close(got[r]["full"][name], getattr(whole_layer(mode), name).detach())
    if mode == "only_rank0_experts":  # rank 1's experts got no token and a zero gradient, not none
        assert not got[1]["grads"]["w_down"].any()
