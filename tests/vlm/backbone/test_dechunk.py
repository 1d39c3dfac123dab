"""Dechunk: the parallel EMA equals its sequential definition (Eq. 7-8); plug-back and STE (Eq. 9-10)."""

# Shape suffixes (docs/paper.md §0): B batch rows, N tokens per row, D model width.

import pytest
import torch
from naive_reference import ema_loop

from vlm.backbone.dechunk import ema_over_concepts, plug_back


@pytest.mark.parametrize("m", [1, 63, 64, 65, 300])
def test_ema_matches_loop(m):
    torch.manual_seed(m)
    c = torch.randn(3, m, 8)
    p = torch.rand(3, m)
    p[:, 0] = 1.0
    p[0, m // 2] = 1.0  # a packed document start mid-row: an exact reset
    p[1, : m // 2] = 1e-4  # long runs of tiny p: decay products far below float32 range
    p[2, m // 3 :] = 1 - 1e-4
    out = ema_over_concepts(c, p, block=64)
    for row in range(3):
        assert torch.allclose(out[row], ema_loop(c[row].double(), p[row].double()).float(), atol=1e-5, rtol=1e-5)


def test_ema_reset_isolates_documents():
    torch.manual_seed(0)
    c, p = torch.randn(1, 200, 4), torch.rand(1, 200) * 0.3
    p[0, 0] = p[0, 130] = 1.0
    alone_c, alone_p = c[:, 130:].clone(), p[:, 130:].clone()
    packed = ema_over_concepts(c, p)[:, 130:]
    assert torch.allclose(packed, ema_over_concepts(alone_c, alone_p), atol=1e-6, rtol=0)


def test_ema_gradient_matches_loop_gradient():
    torch.manual_seed(0)
    c = torch.randn(1, 150, 4, dtype=torch.float64)
    p = torch.rand(1, 150, dtype=torch.float64).clamp(0.05, 0.95)
    p[0, 0] = 1.0
    c1, p1 = c.clone().requires_grad_(), p.clone().requires_grad_()
    c2, p2 = c.clone().requires_grad_(), p.clone().requires_grad_()
    weights = torch.randn(1, 150, 4, dtype=torch.float64)
    (ema_over_concepts(c1, p1) * weights).sum().backward()
    (ema_loop(c2[0], p2[0])[None] * weights).sum().backward()
    assert torch.allclose(c1.grad, c2.grad, atol=1e-5)
    assert torch.allclose(p1.grad[:, 1:], p2.grad[:, 1:], atol=1e-5)


def test_plug_back_matches_eq10_and_ste_gradient():
    h = torch.randn(1, 6, 3)
    ema = torch.randn(1, 3, 3)
    p = torch.tensor([[1.0, 0.2, 0.9, 0.1, 0.4, 0.7]], requires_grad=True)
    b = torch.tensor([[1, 0, 1, 0, 0, 1]]).bool()
    out = plug_back(h, ema, p, b)
    assert out.plug_idx_BN.tolist() == [[0, 0, 1, 1, 1, 2]]  # ψ(n) = m iff φ(m) <= n < φ(m+1)
    expected = h + ema[:, [0, 0, 1, 1, 1, 2]]  # the STE factor is exactly 1 in the forward pass
    assert torch.equal(out.z_BND, expected)
    weights = torch.randn(1, 6, 3)
    (out.z_BND * weights).sum().backward()
    # backward: d/dc of c·ĉ is ĉ, and c = p on boundaries, 1 − p elsewhere.
    grad_c = (ema[:, [0, 0, 1, 1, 1, 2]] * weights).sum(-1)
    sign = torch.where(b, 1.0, -1.0)
    assert torch.allclose(p.grad, grad_c * sign, atol=1e-6)
