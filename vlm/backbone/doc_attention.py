"""Document-aware causal attention without an N x N mask (issue #16).

A packed row holds several documents (token rows, and the concept rows built from them); position i may attend to
position j <= i of the same document, and padding (document id < 0: -1 for padded tokens, -2 for the empty concept
slots of a row) neither attends nor is attended (its output is 0). :func:`plan_doc_attention` looks at the document
ids of a row batch once, picks the implementation, and returns a :class:`DocAttention` plan that every layer of a
stack reuses; :func:`doc_attention` runs it. The plan is the only place that knows which implementation runs.

Implementations (``DOC_ATTENTION_IMPLS``):

- ``loop``: one ``scaled_dot_product_attention(..., is_causal=True)`` call per document slice, the causal fast path
  (flash kernel on CPU and GPU), with ``enable_gqa`` so K/V are never expanded. Cost is that of the documents alone
  (less than one causal row of the same length), memory O(N). One Python call per document per layer: cheap for
  documents of hundreds of tokens, and it needs the segment list on the host (one sync per layout, not per layer).
- ``flex``: ``torch.nn.attention.flex_attention`` compiled, with a ``BlockMask`` built from the document ids (what
  torchtitan does for document masking: a ``mask_mod`` comparing document ids plus causality, block mask built once
  per batch and shared by all layers, the kernel compiled once). Memory O(N) and no per-document Python.

Which one ``auto`` picks, and why (measured on this project's CPU machine, torch 2.14, docs/benchmarks.md):

- CPU: ``loop``. FlexAttention has no backward on CPU in this torch ("FlexAttention does not support backward on
  CPU"), and its inductor compile takes ~40-60 s per new shape, far more than it saves on eval rows.
- CUDA: ``flex`` for rows of at least ``FLEX_MIN_LEN`` positions (no host sync, no per-document launches), ``loop``
  below it (a compile is not worth it for short rows, and tiny test shapes stay eager).
- ``torch.nn.attention.varlen.varlen_attn`` exists in this torch but only on CUDA (``aten::_flash_attention_forward``
  has no CPU kernel), so it is not used: it could not be verified here and ``flex`` covers CUDA.

Override: ``VLM_DOC_ATTENTION=loop|flex`` (environment) or ``plan_doc_attention(..., impl=...)`` forces one.

Two safeguards keep ``flex`` from returning wrong numbers (issue #24, docs/flex_cpu.md):

- On CPU, rows are padded with padding ids to a multiple of ``FLEX_CPU_ALIGN`` positions before the kernel runs.
  Inductor's CPU FlexAttention kernel (torch 2.14) computes Q K^T with a micro-GEMM whose tail path, on AVX2 and
  for head dims 8 or 16, reads and writes a whole 16-column block past a key tile whose width is 8 mod 16: every
  logit came back NaN or wrong on AVX2-only machines. Rows of a multiple of 16 never take that path.
- The first ``flex`` call per (device, dtype, heads, head dim) in a process checks itself against ``loop`` on
  small packed rows (:func:`verify_flex`); a mismatch stops the run with one line naming ``VLM_DOC_ATTENTION=loop``.
"""

# Shape suffixes (docs/paper.md §0): B batch rows, N positions per row (tokens, or concepts), H query heads,
# G key/value heads, K head dim.

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache, lru_cache

import torch
import torch.nn.functional as F

DOC_ATTENTION_IMPLS = ("loop", "flex")
ENV_VAR = "VLM_DOC_ATTENTION"
FLEX_MIN_LEN = 1024  # CUDA rows shorter than this use ``loop``: the compile would not pay for itself
FLEX_CPU_ALIGN = 16  # CPU flex rows are padded to a multiple of this (the kernel's GEMM block width)


@dataclass
class DocAttention:
    """How the rows of one layout attend: built once per layout (tokens, or concepts), used by every layer."""

    impl: str  # one of DOC_ATTENTION_IMPLS
    n: int  # positions per row
    segments: list[list[tuple[int, int, bool]]] | None = None  # loop: per row, (start, end, is_document) runs
    block_mask: object | None = None  # flex: the BlockMask, over n + pad positions
    pad: int = 0  # flex: padding positions appended to every row before the kernel (CPU: to FLEX_CPU_ALIGN)


def choose_impl(doc_BN: torch.Tensor, impl: str | None = None) -> str:
    """The one place that decides: a forced ``impl`` or ``$VLM_DOC_ATTENTION``, else the rule in the module doc."""
    wanted = impl or os.environ.get(ENV_VAR, "auto") or "auto"
    if wanted != "auto":
        if wanted not in DOC_ATTENTION_IMPLS:
            raise ValueError(f"doc attention {wanted!r}: allowed values are auto, {', '.join(DOC_ATTENTION_IMPLS)}")
        if wanted == "flex" and doc_BN.device.type == "cpu" and torch.is_grad_enabled():
            raise ValueError(
                "doc attention 'flex' has no backward on CPU in this torch: run under no_grad, or use loop"
            )
        return wanted
    if doc_BN.device.type == "cuda" and doc_BN.shape[1] >= FLEX_MIN_LEN:
        return "flex"
    return "loop"


def plan_doc_attention(doc_BN: torch.Tensor, impl: str | None = None) -> DocAttention:
    """The attention plan of rows whose document ids are ``doc_BN`` (equal id = same document, adjacent runs only;
    ids < 0 = padding). Layouts number documents as segments, so a run of equal ids is one document."""
    chosen = choose_impl(doc_BN, impl)
    n = doc_BN.shape[1]
    if chosen == "flex":
        pad = -n % FLEX_CPU_ALIGN if doc_BN.device.type == "cpu" else 0
        return DocAttention("flex", n, block_mask=_block_mask(F.pad(doc_BN, (0, pad), value=-1)), pad=pad)
    return DocAttention("loop", n, segments=_segments(doc_BN))


def doc_attention(q_BHNK: torch.Tensor, k_BGNK: torch.Tensor, v_BGNK: torch.Tensor, plan: DocAttention):
    """Causal attention within each document of each row; padding positions get 0. Returns [B, H, N, K]."""
    if q_BHNK.shape[2] != plan.n or k_BGNK.shape[2] != plan.n:
        raise ValueError(f"doc attention planned for {plan.n} positions, got {q_BHNK.shape[2]} queries")
    gqa = k_BGNK.shape[1] != q_BHNK.shape[1]
    if plan.impl == "flex":
        verify_flex(q_BHNK.device, q_BHNK.dtype, q_BHNK.shape[1], k_BGNK.shape[1], q_BHNK.shape[3])
        return _flex(q_BHNK, k_BGNK, v_BGNK, plan, gqa)
    return _loop(q_BHNK, k_BGNK, v_BGNK, plan.segments, gqa)


# ----------------------------------------------------------------------------- loop
def _segments(doc_BN: torch.Tensor) -> list[list[tuple[int, int, bool]]]:
    """Per row, the runs of equal ids as (start, end, is_document); one device-to-host copy for the whole batch."""
    b, n = doc_BN.shape
    new_BN = torch.ones_like(doc_BN, dtype=torch.bool)
    new_BN[:, 1:] = doc_BN[:, 1:] != doc_BN[:, :-1]
    rows, starts = new_BN.nonzero(as_tuple=True)
    runs = torch.stack([rows, starts, doc_BN[rows, starts]], dim=1).tolist()
    segments: list[list[tuple[int, int, bool]]] = [[] for _ in range(b)]
    for i, (row, start, doc) in enumerate(runs):
        end = runs[i + 1][1] if i + 1 < len(runs) and runs[i + 1][0] == row else n
        segments[row].append((start, end, doc >= 0))
    return segments


def _loop(q_BHNK, k_BGNK, v_BGNK, segments, gqa: bool) -> torch.Tensor:
    """Each document its own causal SDPA call on its slice (the fast path); padding runs are zeros."""
    rows = []
    for row, runs in enumerate(segments):
        q, k, v = q_BHNK[row : row + 1], k_BGNK[row : row + 1], v_BGNK[row : row + 1]
        outs = [
            F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, enable_gqa=gqa)
            if real
            else q.new_zeros(1, q.shape[1], e - s, q.shape[3])
            for s, e, real in runs
        ]
        rows.append(outs[0] if len(outs) == 1 else torch.cat(outs, dim=2))
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)


# ----------------------------------------------------------------------------- flex
def _block_mask(doc_BN: torch.Tensor):
    """FlexAttention's BlockMask for document-causal attention; padding (id < 0) attends nothing."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc_BN = doc_BN.contiguous()

    def document_causal(b, h, q_idx, kv_idx):
        q_doc = doc_BN[b, q_idx]
        return (q_doc == doc_BN[b, kv_idx]) & (q_idx >= kv_idx) & (q_doc >= 0)

    b, n = doc_BN.shape
    # Eager create_block_mask evaluates mask_mod on the whole [B, N, N] grid; compiled (as torchtitan does) it builds
    # only the block metadata. Eager on CPU, where flex is a forced, forward-only choice for small rows.
    build = create_block_mask if doc_BN.device.type == "cpu" else _compiled_block_mask()
    return build(document_causal, b, None, n, n, device=doc_BN.device)


@lru_cache(maxsize=1)
def _compiled_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask, dynamic=True)


def _flex(q_BHNK, k_BGNK, v_BGNK, plan: DocAttention, gqa: bool) -> torch.Tensor:
    """The compiled kernel on rows padded by ``plan.pad`` zero positions (padding ids: they attend nothing and
    nothing attends them, so the real positions are unchanged); the padding is cut off again."""
    if plan.pad:
        q_BHNK, k_BGNK, v_BGNK = (F.pad(t, (0, 0, 0, plan.pad)) for t in (q_BHNK, k_BGNK, v_BGNK))
    out_BHNK = _compiled_flex()(q_BHNK, k_BGNK, v_BGNK, block_mask=plan.block_mask, enable_gqa=gqa)
    return out_BHNK[:, :, : plan.n] if plan.pad else out_BHNK


class FlexAttentionError(RuntimeError):
    """``flex`` disagrees with ``loop`` on this device: the run stops rather than train or answer on wrong numbers."""


# Rows of the self-check: documents and padding whose lengths leave every kind of key-tile tail (8 mod 16 among
# them) and a full 128-wide tile plus a tail, with left padding and empty concept slots, as packed rows have them.
_CHECK_DOCS = (
    [0] * 8,
    [0] * 5 + [1] * 19,
    [-1] * 3 + [0] * 13 + [1] * 20 + [2] * 4,
    [0] * 56,
    [0] * 90 + [1] * 60 + [-2] * 2,
)


@cache
def verify_flex(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    """Runs ``flex`` once on small packed rows against ``loop`` (cached per process and key); raises a one-line
    :class:`FlexAttentionError` if any output is not finite or differs beyond the dtype's rounding."""
    gen = torch.Generator().manual_seed(0)
    gqa, worst = kv_heads != heads, 0.0
    with torch.no_grad():
        for docs in _CHECK_DOCS:
            doc_BN = torch.tensor([docs], device=device)
            q_BHNK, k_BGNK, v_BGNK = (  # std 2: scores of a few units, so a wrong softmax shows
                (2 * torch.randn(1, h, doc_BN.shape[1], head_dim, generator=gen)).to(device, dtype)
                for h in (heads, kv_heads, kv_heads)
            )
            plan = plan_doc_attention(doc_BN, "flex")
            got = _flex(q_BHNK, k_BGNK, v_BGNK, plan, gqa).float()
            want = _loop(q_BHNK, k_BGNK, v_BGNK, _segments(doc_BN), gqa).float()
            worst = max(worst, (got - want).abs().max().nan_to_num(float("inf")).item())  # NaN counts as inf
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    if not worst <= tolerance:
        raise FlexAttentionError(
            f"doc attention 'flex' is wrong on this {_device_name(device)} ({dtype}, head dim {head_dim}: "
            f"max |flex - loop| = {worst:.3g}); set {ENV_VAR}=loop (or auto)"
        )


def _device_name(device: torch.device) -> str:
    """``cuda``, or ``cpu`` with the vector code inductor generated for it (``cpu, avx2 code``): the CPU kernel's
    bugs depend on it (docs/flex_cpu.md), so a refusal says which one ran."""
    if device.type != "cpu":
        return device.type
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return f"cpu, {pick_vec_isa()} code"


@lru_cache(maxsize=1)
def _compiled_flex():
    """flex_attention compiled once per process, with dynamic shapes: concept rows change length every step under
    dynamic chunking, and one dynamic compile (~15 s on CPU) serves every length. Without compiling, flex_attention
    runs its eager reference, which materialises the N x N scores."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)
