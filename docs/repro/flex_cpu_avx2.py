"""Minimal reproduction: compiled FlexAttention on CPU is wrong with AVX2 code for head dims 8 and 16 (torch 2.14.1).

    python docs/repro/flex_cpu_avx2.py            # AVX2 code (works on any x86-64 CPU with AVX2, AVX-512 ones too)
    python docs/repro/flex_cpu_avx2.py --isa native

Plain causal attention, no document mask, one process. For each row length N it prints the largest difference
between ``torch.compile(flex_attention)`` and ``scaled_dot_product_attention(is_causal=True)``. With AVX2 code and
head dim 16, lengths with N mod 16 == 8 (8, 24, 40, 56, ...) come back wrong or NaN; every other length, head dim
32 and AVX-512 code are right. Cause (docs/flex_cpu.md): the Q K^T micro-GEMM's ``ntail_transpose_b`` kernel
takes its transpose-first branch when the tail width N is a multiple of the vector width (8 floats on AVX2) but then
loops over ``BLOCK_N / VLEN`` = 16 / 8 column vectors, not ``N / VLEN``: it reads 8 key rows past the tile and
writes 8 scores past the row (into the next row, or past the buffer into the running softmax max).
"""

import argparse
import os
import tempfile

parser = argparse.ArgumentParser()
parser.add_argument("--isa", default="avx2", help="ATEN_CPU_CAPABILITY for inductor's generated code, or 'native'")
parser.add_argument("--head-dim", type=int, default=16)
args = parser.parse_args()
if args.isa != "native":
    os.environ["ATEN_CPU_CAPABILITY"] = args.isa  # inductor picks its vector ISA from this
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp())  # no kernel from an earlier run

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: E402

flex = torch.compile(flex_attention, dynamic=True)
wrong = []
for n in (8, 16, 24, 32, 40, 48, 56, 64, 100, 128, 136, 200):
    torch.manual_seed(n)
    q, k, v = (torch.randn(1, 4, n, args.head_dim) * 2 for _ in range(3))
    mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, 1, None, n, n, device="cpu")
    with torch.no_grad():
        err = (flex(q, k, v, block_mask=mask) - F.scaled_dot_product_attention(q, k, v, is_causal=True)).abs().max()
    print(f"N={n:4d}  max |flex - sdpa| = {err.item():.3g}")
    if not err <= 1e-4:
        wrong.append(n)
print(f"torch {torch.__version__}, isa {args.isa}, head dim {args.head_dim}: wrong at N = {wrong or 'none'}")
