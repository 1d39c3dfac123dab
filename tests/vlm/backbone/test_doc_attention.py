"""Document-aware attention without N x N masks (issue #16): every implementation the chooser can pick, forced."""

# Shape suffixes (docs/paper.md §0): B batch rows, N positions per row, H query heads, G key/value heads,
# K head dim, 1 a singleton axis.

import os
import platform
import subprocess
import sys
import textwrap
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from vlm import ConceptMoEConfig, ConceptMoEForCausalLM
from vlm.backbone import doc_attention as doc_attention_module
from vlm.backbone.doc_attention import (
    ENV_VAR,
    FlexAttentionError,
    choose_impl,
    doc_attention,
    plan_doc_attention,
    verify_flex,
)
from vlm.backbone.layers import attention_mask, make_layout

MODES = [("dynamic", "sum"), ("dynamic", "last"), ("fixed", "sum"), ("fixed", "last"), ("none", "sum")]
CUDA = torch.cuda.is_available()
# flex has no backward on CPU in this torch: forced there, it is checked on logits (no_grad) only
GRAD_IMPLS = ["loop"] + (["flex"] if CUDA else [])
DEVICE = "cuda" if CUDA else "cpu"


@pytest.fixture(params=["compiled", "eager"])
def flex_kernel(request, monkeypatch):
    """The kernel a forced ``flex`` runs; a test runs its body under ``with flex_kernel:``. ``eager``: torch's own
    uncompiled ``flex_attention`` with the same block mask, on every machine: it checks this project's plan (mask,
    CPU padding, cut back). ``compiled``: the kernel users get. Inductor's CPU kernel is wrong on some CPUs even on
    padded rows (docs/flex_cpu.md); there the self-check refuses it in one line, which is the behaviour owed
    (test_compiled_flex_is_right_or_refused_in_one_line), and the compiled case is skipped with that line."""
    verify_flex.cache_clear()  # a pass recorded for one kernel must not vouch for the other
    if request.param == "eager":
        from torch.nn.attention.flex_attention import flex_attention

        monkeypatch.setattr(doc_attention_module, "_compiled_flex", lambda: flex_attention)

    @contextmanager
    def run():
        try:
            yield
        except FlexAttentionError as refused:
            if request.param == "eager":
                raise
            pytest.skip(f"compiled flex refused on this machine: {refused}")

    yield run()
    verify_flex.cache_clear()


def tiny_model(chunking, merge, **extra):
    torch.manual_seed(0)
    config = ConceptMoEConfig.from_preset(
        "tiny", chunking=chunking, concept_merge=merge, boundary_router_init="random", **extra
    )
    return ConceptMoEForCausalLM(config).to(DEVICE).eval()  # eval: no boundary noise, so runs are comparable


def packed_and_alone(model, docs, pad_left=0, pad_right=0):
    """Logits of the documents packed in one row (with optional padding on either side), and of each alone."""
    ids = torch.cat(
        [torch.zeros(1, pad_left, dtype=torch.long)] + docs + [torch.zeros(1, pad_right, dtype=torch.long)], 1
    )
    doc_ids = torch.cat(
        [torch.full((1, pad_left), 0)]
        + [torch.full_like(d, i) for i, d in enumerate(docs)]
        + [torch.full((1, pad_right), 0)],
        1,
    )
    valid = torch.ones_like(ids)
    valid[:, :pad_left] = 0
    valid[:, ids.shape[1] - pad_right :] = 0
    packed = model(ids.to(DEVICE), doc_ids=doc_ids.to(DEVICE), attention_mask=valid.to(DEVICE)).logits
    packed = packed[:, pad_left : ids.shape[1] - pad_right]
    alone = torch.cat([model(d.to(DEVICE)).logits for d in docs], dim=1)
    return packed, alone


def grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("impl", GRAD_IMPLS)
@pytest.mark.parametrize("chunking,merge", MODES + [("dynamic-wide-looped", "sum")])
def test_packed_logits_and_gradients_equal_each_document_alone(chunking, merge, impl, monkeypatch):
    monkeypatch.setenv(ENV_VAR, impl)
    extra = {}
    if chunking == "dynamic-wide-looped":
        chunking, extra = "dynamic", dict(concept_d_model=96, concept_num_experts=4, concept_top_k=2, concept_loop=2)
    model = tiny_model(chunking, merge, **extra)
    torch.manual_seed(2)
    docs = [torch.randint(0, 512, (1, n)) for n in (13, 20, 7)]
    weight = torch.randn(1, 40, 512, device=DEVICE)  # a fixed upstream gradient on every logit
    for pad_left, pad_right in ((0, 0), (5, 0), (0, 6)):  # packed; left padding; right padding
        packed, alone = packed_and_alone(model, docs, pad_left, pad_right)
        torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
        g_packed = grads(model, (packed * weight).sum())  # the two graphs are separate
        g_alone = grads(model, (alone * weight).sum())
        assert g_packed.keys() == g_alone.keys() and len(g_packed) > 10
        for name in g_packed:  # relative to the tensor's scale: the tied embedding sums ~40 fp32 terms per entry
            err = (g_packed[name] - g_alone[name]).abs().max().item()
            assert err <= 1e-5 * g_alone[name].abs().max().item() + 1e-9, (name, pad_left, pad_right, err)


@pytest.mark.parametrize("chunking,merge", MODES)
def test_flex_packed_logits_equal_each_document_alone(chunking, merge, flex_kernel, monkeypatch):
    """``flex`` forced (compiled once per process with dynamic shapes, or eager): logits of packed and padded rows."""
    monkeypatch.setenv(ENV_VAR, "flex")
    model = tiny_model(chunking, merge)
    torch.manual_seed(2)
    docs = [torch.randint(0, 512, (1, n)) for n in (13, 20, 7)]
    with flex_kernel, torch.no_grad():
        for pad_left, pad_right in ((0, 0), (5, 0), (0, 6)):
            packed, alone = packed_and_alone(model, docs, pad_left, pad_right)
            torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def dense_reference(q_BHNK, k_BGNK, v_BGNK, doc_BN):
    """SDPA with the dense [B, 1, N, N] mask; padding queries (all-False rows) set to 0."""
    rep = q_BHNK.shape[1] // k_BGNK.shape[1]
    mask_B1NN = attention_mask(doc_BN)
    out_BHNK = F.scaled_dot_product_attention(
        q_BHNK, k_BGNK.repeat_interleave(rep, 1), v_BGNK.repeat_interleave(rep, 1), attn_mask=mask_B1NN
    )
    return torch.where((doc_BN >= 0)[:, None, :, None], out_BHNK, torch.zeros_like(out_BHNK))


def test_doc_attention_matches_the_dense_mask_with_gqa_and_padding():
    check_against_the_dense_mask("loop")


def test_flex_matches_the_dense_mask_with_gqa_and_padding(flex_kernel):
    with flex_kernel:
        check_against_the_dense_mask("flex")


def check_against_the_dense_mask(impl):
    torch.manual_seed(0)
    doc_BN = torch.tensor([[-1, -1, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, -1, -1]])
    q_BHNK, k_BGNK, v_BGNK = torch.randn(2, 4, 12, 8), torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8)
    with torch.set_grad_enabled(impl == "loop"):  # flex: no backward on CPU
        plan = plan_doc_attention(doc_BN, impl)
        assert plan.impl == impl
        tensors = [t.clone().requires_grad_(impl == "loop") for t in (q_BHNK, k_BGNK, v_BGNK)]
        out_BHNK = doc_attention(*tensors, plan)
    torch.testing.assert_close(out_BHNK, dense_reference(q_BHNK, k_BGNK, v_BGNK, doc_BN), rtol=1e-5, atol=1e-6)
    if impl == "loop":
        upstream = torch.randn_like(out_BHNK)
        got = torch.autograd.grad(out_BHNK, tensors, upstream)
        ref_in = [t.clone().requires_grad_() for t in (q_BHNK, k_BGNK, v_BGNK)]
        want = torch.autograd.grad(dense_reference(*ref_in, doc_BN), ref_in, upstream)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_flex_pads_cpu_rows_to_whole_kernel_blocks(flex_kernel):
    """CPU rows go to the kernel padded to a multiple of 16 with padding ids, and come back at their own length."""
    doc_BN = torch.tensor([[0] * 13 + [1] * 20 + [2] * 7])  # 40 positions: the kernel sees 48
    with flex_kernel, torch.no_grad():
        plan = plan_doc_attention(doc_BN, "flex")
        assert (plan.n, plan.pad) == (40, 8) and plan.block_mask.seq_lengths == (48, 48)
        q_BHNK, k_BGNK, v_BGNK = torch.randn(1, 4, 40, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
        out_BHNK = doc_attention(q_BHNK, k_BGNK, v_BGNK, plan)
    torch.testing.assert_close(out_BHNK, dense_reference(q_BHNK, k_BGNK, v_BGNK, doc_BN), rtol=1e-5, atol=1e-6)
    assert plan_doc_attention(doc_BN[:, :32], "loop").impl == "loop"


def test_flex_that_disagrees_with_loop_refuses_in_one_line(monkeypatch):
    """A kernel returning NaN (what AVX2 machines got, issue #24) never reaches a caller: one-line refusal."""

    def nan_kernel(q_BHNK, k_BGNK, v_BGNK, block_mask, enable_gqa):
        return torch.full_like(q_BHNK, float("nan"))

    verify_flex.cache_clear()
    monkeypatch.setattr(doc_attention_module, "_compiled_flex", lambda: nan_kernel)
    doc_BN = torch.zeros(1, 24, dtype=torch.long)
    q_BHNK, k_BGNK = torch.randn(1, 4, 24, 16), torch.randn(1, 2, 24, 16)
    try:
        with torch.no_grad(), pytest.raises(FlexAttentionError) as refused:
            doc_attention(q_BHNK, k_BGNK, k_BGNK, plan_doc_attention(doc_BN, "flex"))
    finally:
        verify_flex.cache_clear()  # later tests check the real kernel again
    message = str(refused.value)
    assert "\n" not in message and f"{ENV_VAR}=loop" in message and "head dim 16" in message


@pytest.mark.parametrize("head_dim", [16, 8])
def test_compiled_flex_is_right_or_refused_in_one_line(head_dim):
    """The compiled kernel on this machine, as users get it: the self-check passes (then flex equals loop on its
    rows), or it refuses in one line that names the fix and the vector code that ran; never a wrong number."""
    verify_flex.cache_clear()
    try:
        verify_flex(torch.device(DEVICE), torch.float32, 4, 2, head_dim)
    except FlexAttentionError as refused:
        message = str(refused)
        assert "\n" not in message and f"{ENV_VAR}=loop" in message and f"head dim {head_dim}" in message
        assert CUDA or " code (" in message, message  # cpu: which vector code inductor generated
    finally:
        verify_flex.cache_clear()


AVX2 = platform.machine() in ("x86_64", "AMD64") and "avx2" in open("/proc/cpuinfo").read().split()


@pytest.mark.skipif(not AVX2, reason="inductor's AVX2 code runs only on x86-64 CPUs with AVX2")
def test_flex_is_right_with_avx2_code_and_the_self_check_catches_the_kernel_bug(tmp_path):
    """Inductor's AVX2 code, generated on any x86-64 machine (AVX-512 ones too): the padded path equals loop at head
    dim 16 (the tiny presets'); with the padding off, the self-check refuses the kernel that gave NaN logits (#24)."""
    script = textwrap.dedent("""
        import torch
        import vlm.backbone.doc_attention as da
        da.verify_flex(torch.device("cpu"), torch.float32, 4, 2, 16)  # raises if wrong
        da.FLEX_CPU_ALIGN = 1
        da.verify_flex.cache_clear()
        try:
            da.verify_flex(torch.device("cpu"), torch.float32, 4, 2, 16)
            print("refused 0")
        except da.FlexAttentionError:
            print("refused 1")
    """)
    # a cache of its own: kernels compiled for the machine's own ISA must not serve this run, nor the reverse
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    env.pop(ENV_VAR, None)
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    # > 0: if torch fixes the kernel this fails, and the padding in doc_attention.py can go (docs/flex_cpu.md)
    assert int(run.stdout.split()[-1]) > 0, run.stdout


def test_chooser_auto_override_and_refusals(monkeypatch):
    doc_BN = torch.zeros(1, 4096, dtype=torch.long)
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert choose_impl(doc_BN) == "loop"  # CPU: flex has no backward here, and its compile is ~15-60 s
    monkeypatch.setenv(ENV_VAR, "flex")
    with torch.no_grad():
        assert choose_impl(doc_BN) == "flex"
    with pytest.raises(ValueError, match="no backward on CPU"):
        choose_impl(doc_BN)
    monkeypatch.setenv(ENV_VAR, "dense")
    with pytest.raises(ValueError, match="allowed values"):
        choose_impl(doc_BN)


def test_layouts_hold_no_square_tensor():
    """A packed 64K-token row: a dense bool mask would be 4 GiB; the layout holds O(N) tensors and a segment list."""
    n = 65536
    layout = make_layout((torch.arange(n) // 512)[None], None, (1, n), torch.device("cpu"))
    tensors = [v for v in vars(layout).values() if isinstance(v, torch.Tensor)]
    assert max(t.numel() for t in tensors) == n and len(layout.docs.segments[0]) == n // 512
