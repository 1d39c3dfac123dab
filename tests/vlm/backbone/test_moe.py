"""MoE FFN: grouped dispatch equals the per-token definition; load-balancing and z losses."""

# Shape suffixes (docs/paper.md §0): E experts.

import pytest
import torch
from naive_reference import moe_per_token

from vlm.backbone.moe import MoE, grouped_mm_supported, load_balancing_loss, router_z_loss


def _moe(norm_topk_prob=True, shared=1, experts=6, k=2):
    torch.manual_seed(0)
    moe = MoE(16, experts, k, 24, shared_experts=shared, norm_topk_prob=norm_topk_prob)
    for w in (moe.w_gate_up, moe.w_down):
        torch.nn.init.normal_(w, std=0.2)
    return moe


@pytest.mark.parametrize("norm_topk_prob,shared,k", [(True, 1, 2), (False, 0, 3), (True, 2, 1)])
def test_dispatch_matches_per_token_reference(norm_topk_prob, shared, k):
    moe = _moe(norm_topk_prob, shared, k=k)
    x = torch.randn(37, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, stats = moe(x)
    y_ref = moe_per_token(moe, x_ref)
    assert torch.allclose(y, y_ref, atol=1e-5)
    assert int(stats.tokens_per_expert_E.sum()) == 37 * k  # dropless: every token reaches k experts
    g = torch.randn_like(y)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-5)


def test_gated_shared_expert_of_its_own_width():
    """Qwen2-MoE's shared expert: its own width, output scaled by sigmoid(w_g . x) per token."""
    torch.manual_seed(0)
    moe = MoE(16, 6, 2, 24, shared_experts=1, shared_dim=40, shared_gate=True)
    for w in (moe.w_gate_up, moe.w_down):
        torch.nn.init.normal_(w, std=0.2)
    assert moe.shared.gate_proj.out_features == 40 and moe.shared_gate.weight.shape == (1, 16)
    x = torch.randn(11, 16)
    y, _ = moe(x)
    ungated = moe_per_token(moe, x) - moe.shared(x)  # the reference adds the shared expert ungated
    assert torch.allclose(y, ungated + torch.sigmoid(moe.shared_gate(x)) * moe.shared(x), atol=1e-5)


def test_grouped_matmul_and_expert_loop_agree():
    moe = _moe(experts=8, k=3)
    x = torch.randn(50, 16)
    assert grouped_mm_supported(x.device, x.dtype), "this torch has F.grouped_mm on CPU: both paths get tested"
    weights = torch.randn(50, 16)
    results = []
    for dispatch in ("grouped", "loop"):
        moe.zero_grad()
        moe.dispatch = dispatch
        y, _ = moe(x)
        (y * weights).sum().backward()
        results.append((y, moe.w_gate_up.grad.clone(), moe.w_down.grad.clone(), moe.router.weight.grad.clone()))
    for a, b in zip(*results):
        assert torch.allclose(a, b, atol=1e-6)


def test_dispatch_with_unused_experts_and_empty_input():
    moe = _moe(experts=16, k=1)
    y, stats = moe(torch.randn(3, 16))
    assert (stats.tokens_per_expert_E == 0).sum() >= 13
    y0, _ = moe(torch.zeros(0, 16))
    assert y0.shape == (0, 16)
    y0.sum().backward()  # ZeRO / DDP expect every parameter to get a gradient, even from an all-padding batch
    assert moe.w_gate_up.grad is not None and moe.w_down.grad is not None


def test_load_balancing_loss_is_e_sum_f_p():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.5, 0.1, 0.4], [0.2, 0.3, 0.5]])
    idx = torch.tensor([[0], [1], [0], [2]])
    f = torch.tensor([2 / 4, 1 / 4, 1 / 4])
    p = probs.mean(0)
    assert load_balancing_loss(probs, idx).item() == pytest.approx(3 * (f * p).sum().item(), rel=1e-6)
    uniform = torch.full((6, 3), 1 / 3)
    assert load_balancing_loss(uniform, torch.tensor([[0], [1], [2], [0], [1], [2]])).item() == pytest.approx(1.0)


def test_router_z_loss():
    logits = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    expected = (torch.logsumexp(logits, -1) ** 2).mean()
    assert router_z_loss(logits).item() == pytest.approx(expected.item())
