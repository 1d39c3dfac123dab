"""Chunk module: Eq. 2 (boundary probability), Eq. 3-4 (ratio loss), Eq. 5-6 (noise), merging."""

# Shape suffixes (docs/paper.md §0): B batch rows, N tokens per row, D model width.

import math

import pytest
import torch

from vlm import ConceptMoEConfig, ConceptMoEForCausalLM
from vlm.backbone.chunking import (
    ChunkModule,
    boundary_positions,
    cosine_boundary_probs,
    fixed_boundaries,
    merge_tokens,
    ratio_loss,
    sharpen_boundary_probs,
)
from vlm.backbone.layers import make_layout


def test_cosine_boundary_prob_matches_eq2():
    torch.manual_seed(0)
    q, k = torch.randn(1, 6, 8), torch.randn(1, 6, 8)
    p = cosine_boundary_probs(q, k)
    for n in range(1, 6):
        cos = torch.dot(q[0, n], k[0, n - 1]) / (q[0, n].norm() * k[0, n - 1].norm())
        assert p[0, n - 1].item() == pytest.approx(0.5 * (1 - cos.item()), abs=1e-6)


def test_ratio_loss_matches_eq4_by_hand():
    # p = (1.0, 0.2, 0.9, 0.1, 0.6, 0.3), b = (1, 0, 1, 0, 1, 0), one padded position that must not count.
    p = torch.tensor([[1.0, 0.2, 0.9, 0.1, 0.6, 0.3, 0.8]])
    b = torch.tensor([[1, 0, 1, 0, 1, 0, 1]]).bool()
    valid = torch.tensor([[1, 1, 1, 1, 1, 1, 0]]).bool()
    g, f, r = 3.1 / 6, 3 / 6, 3.0
    expected = r * f * g + r / (r - 1) * (1 - f) * (1 - g)  # Eq. 3 in the paper's first form
    assert ratio_loss(p, b, valid, r).item() == pytest.approx(expected, rel=1e-6)
    assert ratio_loss(p, b, valid, r).item() == pytest.approx(1.1375, rel=1e-4)


@pytest.mark.parametrize("target_r", [1.5, 2.0, 4.0])
def test_ratio_loss_minimal_at_one_over_r(target_r):
    xs = torch.linspace(0.01, 0.99, 981)
    losses = []
    for x in xs:
        n = 1000
        b = torch.zeros(1, n, dtype=torch.bool)
        b[0, : int(round(float(x) * n))] = True
        p = torch.full((1, n), float(x))
        losses.append(ratio_loss(p, b, torch.ones(1, n, dtype=torch.bool), target_r).item())
    best = xs[int(torch.tensor(losses).argmin())].item()
    assert best == pytest.approx(1 / target_r, abs=2e-3)
    assert min(losses) == pytest.approx(1.0, abs=1e-3)


def test_ratio_loss_gradient_flows_through_g_only():
    p = torch.tensor([[1.0, 0.3, 0.7, 0.2]], requires_grad=True)
    b = torch.tensor([[1, 0, 1, 0]]).bool()
    ratio_loss(p, b, torch.ones_like(b), 2.0).backward()
    f, r, n = 0.5, 2.0, 4
    expected = r / (r - 1) * ((r - 1) * f - (1 - f)) / n  # dL/dp_n = dL/dG / N
    assert torch.allclose(p.grad, torch.full_like(p, expected))


def test_sharpening_matches_eq5():
    p = torch.tensor([0.9, 0.5, 0.2, 0.0, 1.0])
    tau = 6.0
    expected = [0.9 ** (1 / tau), 0.5 ** (1 / tau), 1 - 0.8 ** (1 / tau), 0.0, 1.0]
    assert torch.allclose(sharpen_boundary_probs(p, tau), torch.tensor(expected), atol=1e-6)


def test_noise_flip_rate_matches_derivation_and_is_off_in_eval():
    """At p = 0.5 and τ = 6 a boundary is dropped with probability 1 − 0.5^{1/6} ≈ 0.109 (Eq. 5-6; docs/paper.md §4)."""
    torch.manual_seed(0)
    module = ChunkModule(4, "cosine")
    h = torch.randn(64, 200, 4)
    layout = make_layout(None, None, (64, 200), h.device)
    with torch.no_grad():
        module.q_proj.weight.copy_(torch.eye(4))
        module.k_proj.weight.copy_(torch.eye(4))
    module.train()
    out = module(h, layout, tau=6.0)
    flips = (out.b_BN != out.b_hard_BN)[:, 1:].float().mean().item()
    p = out.p_BN[:, 1:]
    predicted = (1 - torch.maximum(p, 1 - p).pow(1 / 6)).mean().item()
    assert flips == pytest.approx(predicted, abs=0.01)
    assert out.b_BN[:, 0].all(), "the first token is always a boundary, noise or not"
    module.eval()
    out_eval = module(h, layout, tau=6.0)
    assert torch.equal(out_eval.b_BN, out_eval.p_BN >= 0.5)


def test_gradients_reach_router_projections_from_the_lm_loss_alone():
    """λ = 0: the router learns from the LM loss through the STE confidences and the EMA weights."""
    config = ConceptMoEConfig.from_preset("tiny", ratio_loss_weight=0.0, boundary_router_init="random")
    model = ConceptMoEForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (2, 32))
    model(ids, labels=ids).loss.backward()
    for proj in (model.model.chunker.q_proj, model.model.chunker.k_proj):
        assert proj.weight.grad is not None and proj.weight.grad.abs().sum() > 0


def test_linear_router_is_trainable_and_forces_first_boundary():
    model = ConceptMoEForCausalLM(ConceptMoEConfig.from_preset("tiny", boundary_router="linear"))
    ids = torch.randint(0, 512, (2, 24))
    out = model(ids, labels=ids)
    out.loss.backward()
    assert model.model.chunker.proj.weight.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad():
        assert out.chunk_stats["concepts"] >= 2


def _merge_reference(h_ND, b_N, doc_N, mode):
    """Loop definition: concept m = ĥ_{φ(m)} or Σ ĥ over (φ(m−1), φ(m)] clipped at its document start."""
    concepts, window = [], []
    for n in range(h_ND.shape[0]):
        if n > 0 and doc_N[n] != doc_N[n - 1]:
            window = []
        window.append(h_ND[n])
        if b_N[n]:
            concepts.append(h_ND[n] if mode == "last" else torch.stack(window).sum(0))
            window = []
    return torch.stack(concepts)


@pytest.mark.parametrize("mode", ["sum", "last"])
def test_merge_matches_loop_definition(mode):
    torch.manual_seed(1)
    doc = torch.tensor([[0] * 7 + [1] * 5 + [2] * 4, [0] * 16])
    layout = make_layout(doc, None, (2, 16), torch.device("cpu"))
    b = (torch.rand(2, 16) < 0.4) | layout.start_BN
    b[0, 6] = False  # document 0 ends without a boundary: its tail must not leak into document 1
    h = torch.randn(2, 16, 5)
    boundary, valid = boundary_positions(b)
    merged = merge_tokens(h, b, boundary, valid, layout, mode)
    for row in range(2):
        ref = _merge_reference(h[row], b[row], doc[row], mode)
        assert torch.allclose(merged[row, : len(ref)], ref, atol=1e-6)
        assert not merged[row, len(ref) :].any()


def test_fixed_boundaries_every_r_tokens_per_document():
    doc = torch.tensor([[0] * 5 + [1] * 6])
    layout = make_layout(doc, None, (1, 11), torch.device("cpu"))
    b = fixed_boundaries(layout, 2.0)
    assert b.int().tolist() == [[1, 0, 1, 0, 1, 1, 0, 1, 0, 1, 0]]
    b15 = fixed_boundaries(make_layout(None, None, (1, 9), torch.device("cpu")), 1.5)
    assert b15.sum().item() == math.ceil(9 / 1.5)


@pytest.mark.parametrize("chunking", ["dynamic", "fixed"])
@torch.no_grad()
def test_boundary_token_ids_add_a_boundary_on_every_occurrence_and_nowhere_else(chunking):
    """In eval mode p_n depends on the encoder states only, so the forced run's boundaries are exactly the plain
    run's plus the forced tokens' (p = 1 there), and the logits before the first forced token are unchanged."""
    forced_ids = [5, 9]
    cfg = dict(vocab_size=64, chunking=chunking, boundary_router_init="random")
    torch.manual_seed(0)
    plain = ConceptMoEForCausalLM(ConceptMoEConfig(**cfg)).eval()
    forced = ConceptMoEForCausalLM(ConceptMoEConfig(**cfg, boundary_token_ids=forced_ids)).eval()
    forced.load_state_dict(plain.state_dict())
    ids = torch.randint(10, 64, (2, 30), generator=torch.Generator().manual_seed(1))
    ids[0, 13], ids[0, 21], ids[1, 7] = 5, 9, 5  # odd: not on the fixed R = 2 grid
    at_BN = torch.isin(ids, torch.tensor(forced_ids))
    a, b = plain.model(input_ids=ids).chunk, forced.model(input_ids=ids).chunk
    assert torch.equal(b.b_BN, a.b_BN | at_BN) and bool((b.p_BN[at_BN] == 1).all())
    assert not bool(a.b_BN[at_BN].all())  # the setting changed something: not every forced token was a boundary
    la, lb = plain(input_ids=ids).logits, forced(input_ids=ids).logits
    assert torch.allclose(la[0, :13], lb[0, :13], atol=1e-5) and torch.allclose(la[1, :7], lb[1, :7], atol=1e-5)
    assert not torch.allclose(la[0, 13:], lb[0, 13:], atol=1e-3)  # from the first forced token on, they differ
