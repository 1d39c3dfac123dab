"""Inference cost model: prefill FLOPs, decode FLOPs / bytes / roofline time, KV-cache bytes (the paper measures
latency in §4.4, Fig. 5, but gives no cost model beyond Table 1).

Built on :func:`vlm.accounting.flops.count` (same conventions: FLOPs = 2 x MACs, forward only, only matrix products
count;
concept layers, strategy-2 loops included, run once per concept, i.e. at 1/R of the token rate). The *ideal*
speedup of a candidate over a baseline is the ratio of the baseline's cost to the candidate's, evaluated at the
candidate's measured compression ratio R. It is what a perfect implementation would get if time were exactly
proportional to the modelled cost: everything outside the model (kernel launches, Python overhead, the gather /
scatter of boundary rows, softmax and norms, caches) is what makes a measurement fall short of (or beat) it.

Generalisations of the paper's Table 1 (§3.5, docs/paper.md §9; it counts concept layers only, with MHA, d per
layer):

* :func:`prefill_cost` - the "attention-map FLOPs" column (L_C d N^2 / R^2 for S1) plus every linear FLOP of
  every layer, over a whole causal prefill of N tokens.
* :func:`decode_cost` - per generated token: the attention column evaluated for one query over a cache of N keys
  (N / R for concept layers, run on 1/R of the steps), plus the bytes a step must read (weights, KV cache).
* :func:`kv_cache_bytes` - the "KV cache" column (2 L_C d N / R for S1), with token layers, GQA and loops.
"""

from __future__ import annotations

import math
import time

import torch

from vlm.accounting.flops import count
from vlm.backbone.config import ConceptMoEConfig


# ----------------------------------------------------------------------------- prefill
def prefill_cost(config: ConceptMoEConfig, seq_len: int, r: float | None = None, all_logits: bool = True) -> dict:
    """FLOPs of one causal prefill of ``seq_len`` tokens (batch 1) at compression ratio ``r``.

    Generalises Table 1's attention-map column (L_C d N^2 / R^2 for S1, R^2 L_C / (L_C + L_loop) for S2):
    ``flops_attn`` = N x ``count()["flops_attn_per_token"]`` = 2 H hd N^2 per token layer (causal: each query
    sees ~N/2 keys) and 2 H hd_c (N/R)^2 per concept-layer application; ``flops_linear`` = N x the linear FLOPs
    per token (concept layers at 1/R). ``all_logits=False`` counts the LM head on the last position only (a
    prefill that returns just the next-token logits). Returns ``flops``, ``flops_linear``, ``flops_attn``, ``r``.
    """
    c = count(config, seq_len, r)
    linear = seq_len * c["flops_linear_per_token"]
    if not all_logits:
        linear -= (seq_len - 1) * c["flops_linear"]["lm_head"]
    attn = seq_len * c["flops_attn_per_token"]
    return dict(flops=linear + attn, flops_linear=linear, flops_attn=attn, r=c["r"], seq_len=seq_len)


def ideal_prefill_speedup(baseline, candidate, seq_len: int, r: float | None = None, all_logits: bool = True):
    """Baseline prefill FLOPs / candidate prefill FLOPs (candidate at ``r``; 1.0 for identical models)."""
    base = prefill_cost(baseline, seq_len, all_logits=all_logits)["flops"]
    return base / prefill_cost(candidate, seq_len, r, all_logits)["flops"]


# ----------------------------------------------------------------------------- weights read by a decode step
def distinct_experts(num_experts: int, top_k: int, rows: float) -> float:
    """Expected experts touched when ``rows`` tokens each pick ``top_k`` of ``num_experts`` uniformly:
    E (1 - (1 - k/E)^rows): k for one row, bounded by E for a large batch."""
    return 0.0 if rows <= 0 else num_experts * (1.0 - (1.0 - top_k / num_experts) ** rows)


def _layer_params(config: ConceptMoEConfig, r: float) -> dict:
    """Per-layer parameter split (non-expert / one routed expert) of token and concept layers, from ``count``."""
    c = count(config, 1, r)["params"]
    moe = config.ffn == "moe"
    n_tok = config.encoder_layers + config.decoder_layers
    tok_expert = 3 * config.d_model * config.expert_dim if moe else 0
    con_expert = 3 * config.concept_d_model * config.concept_expert_dim if moe else 0
    tok_layer = c["token_layers"] / n_tok if n_tok else 0
    con_layer = c["concept_layers"] / config.concept_layers if config.concept_layers else 0
    return dict(
        tok_other=tok_layer - config.num_experts * tok_expert,
        tok_expert=tok_expert,
        con_other=con_layer - config.concept_num_experts * con_expert,
        con_expert=con_expert,
        always=c["final_norm"] + c["chunk"] + c["joint"] + config.d_model * config.vocab_size,  # + LM head
        per_concept_step=c["concept_norm"] + c["projectors"],
        embedding=c["embedding"],
    )


def _concept_row_counts(batch: int, r: float, aligned: bool) -> list[tuple[float, int]]:
    """(probability, rows at a boundary) for one decode step: all rows together on 1/r of the steps
    (``aligned``: fixed chunking, equal prompt lengths) or each row independently with probability 1/r."""
    if aligned:
        return [(1.0 / r, batch), (1.0 - 1.0 / r, 0)]
    p = 1.0 / r
    return [(math.comb(batch, n) * p**n * (1 - p) ** (batch - n), n) for n in range(batch + 1)]


# ----------------------------------------------------------------------------- decode
def decode_cost(
    config: ConceptMoEConfig,
    kv_len: int,
    batch: int = 1,
    r: float | None = None,
    dtype_bytes: int = 2,
    peak_flops: float | None = None,
    bandwidth: float | None = None,
    aligned: bool = False,
) -> dict:
    """Cost of one decode step (``batch`` rows, each with ``kv_len`` cached tokens) and per generated token: Table 1
    generalised to decoding (its attention column for one query over N cached keys, N / R in concept layers; its
    KV column as the bytes read back each step). A model, not measurements:

    * FLOPs per token = ``count()``'s linear FLOPs + attention 4 H hd kv_len per token layer and (1/r) 4 H hd_c
      (kv_len / r) per concept-layer application (2 x ``flops_attn_per_token``: a decode query sees every key).
    * Bytes per step = weights read (``_decode_weights``) + KV cache read (``_decode_kv_elements``); nothing stays
      on chip between steps or layers.
    * Time per step = max(FLOPs / ``peak_flops``, bytes / ``bandwidth``) (roofline, per-second units); ``time_s``
      and ``tokens_per_s`` are None unless both are given. No launch or framework overhead.
    """
    c = count(config, kv_len, r)
    r = c["r"]
    flops_tok = c["flops_linear_per_token"] + 2 * c["flops_attn_per_token"]
    weights = _decode_weights(config, batch, r, aligned)
    kv_elems = _decode_kv_elements(config, c["kv_cache_per_token"], kv_len, batch, r)
    step_bytes = dtype_bytes * (weights + kv_elems)
    step_flops = batch * flops_tok
    out = dict(
        flops_per_token=flops_tok,
        bytes_per_token=step_bytes / batch,
        weight_bytes_per_step=dtype_bytes * weights,
        kv_bytes_per_step=dtype_bytes * kv_elems,
        flops_per_step=step_flops,
        bytes_per_step=step_bytes,
        time_s=None,
        tokens_per_s=None,
        bound=None,
        r=r,
    )
    if peak_flops and bandwidth:
        t_flops, t_bytes = step_flops / peak_flops, step_bytes / bandwidth
        out.update(time_s=max(t_flops, t_bytes), bound="compute" if t_flops >= t_bytes else "memory")
        out["tokens_per_s"] = batch / out["time_s"]
    return out


def _decode_weights(config: ConceptMoEConfig, batch: int, r: float, aligned: bool) -> float:
    """Expected weights one decode step reads: every non-expert weight of the token layers, the chunk / joint /
    LM-head weights and B embedding rows; per MoE layer the distinct experts of its rows (``distinct_experts``).
    The concept model runs only on rows at a boundary (``_concept_row_counts``) and reads its weights once per
    schedule entry (a looped layer again on each application)."""
    p = _layer_params(config, r)
    n_tok = config.encoder_layers + config.decoder_layers
    weights = p["always"] + min(batch * config.d_model, p["embedding"])
    weights += n_tok * (p["tok_other"] + distinct_experts(config.num_experts, config.top_k, batch) * p["tok_expert"])
    schedule = config.concept_schedule()
    # a baseline's "concept layers" are ordinary layers: every row runs them every step
    for prob, rows in _concept_row_counts(batch, r, aligned) if config.chunked else [(1.0, batch)]:
        if rows:
            per_layer = (
                p["con_other"]
                + distinct_experts(config.concept_num_experts, config.concept_top_k, rows) * p["con_expert"]
            )
            weights += prob * (p["per_concept_step"] + len(schedule) * per_layer)
    return weights


def _decode_kv_elements(config: ConceptMoEConfig, kv_per_token: float, kv_len: int, batch: int, r: float) -> float:
    """KV elements one decode step reads: B kv_len per token layer, (B / r) (kv_len / r) per concept application,
    2 KV hd each."""
    # count() caches e_con / r per token for the concept layers; a step reads them for B / r rows of kv_len / r keys
    e_con = len(config.concept_schedule()) * 2 * config.n_kv_heads * config.concept_head_dim
    return batch * kv_len * (kv_per_token - e_con / r + e_con / (r * r))


def ideal_decode_speedup(baseline, candidate, kv_len: int, batch: int, r: float | None = None, **kwargs) -> float:
    """Baseline decode step time / candidate step time under :func:`decode_cost`'s roofline (``kwargs``:
    ``dtype_bytes``, ``peak_flops``, ``bandwidth``, ``aligned``; the baseline is never chunked)."""
    base = decode_cost(baseline, kv_len, batch, **kwargs)["time_s"]
    return base / decode_cost(candidate, kv_len, batch, r, **kwargs)["time_s"]


# ----------------------------------------------------------------------------- KV cache
def kv_cache_bytes(
    config: ConceptMoEConfig, seq_len: int, batch: int = 1, r: float | None = None, dtype_bytes: int = 2
):
    """Bytes of K and V cached for ``batch`` rows of ``seq_len`` tokens at compression ratio ``r``.

    Generalises Table 1's KV column (2 L_C d N / R for S1, 2 (L_C + L_loop) d N / R for S2): 2 KV hd elements
    per token per token layer (encoder, decoder: the decoder stays at token length, docs/paper.md §8) and per
    concept per concept-layer application (each application of a looped layer keeps its own K and V), at
    ``dtype_bytes``.
    Returns ``token``, ``concept`` and ``total`` (the split of ``cache.kv_bytes()``).
    """
    c = count(config, seq_len, r)
    n_tok = config.encoder_layers + config.decoder_layers
    if not config.chunked:
        n_tok += config.concept_layers
    token = batch * seq_len * n_tok * 2 * config.n_kv_heads * config.token_head_dim * dtype_bytes
    total = batch * seq_len * c["kv_cache_per_token"] * dtype_bytes
    return dict(token=token, concept=total - token, total=total)


def ideal_kv_ratio(baseline, candidate, seq_len: int, batch: int = 1, r: float | None = None) -> float:
    """Baseline KV bytes / candidate KV bytes: Table 1's "Reduction" (R for S1 without token layers)."""
    return kv_cache_bytes(baseline, seq_len, batch)["total"] / kv_cache_bytes(candidate, seq_len, batch, r)["total"]


# ----------------------------------------------------------------------------- the device's roofline
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_device(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, repeats: int = 5) -> dict:
    """Peak matmul FLOP/s (square matmul) and memory bandwidth (read + write of a large copy), best of ``repeats``.

    Sizes: n = 1024 and 64 MiB on CPU, n = 8192 and 2 GiB on an accelerator (large enough to leave caches).
    """
    device = torch.device(device)
    big = device.type != "cpu"
    n = 8192 if big else 1024
    mat_a = torch.randn(n, n, device=device, dtype=dtype)
    mat_b = torch.randn(n, n, device=device, dtype=dtype)
    numel = (2 << 30 if big else 64 << 20) // mat_a.element_size()
    src, dst = torch.empty(numel, device=device, dtype=dtype), torch.empty(numel, device=device, dtype=dtype)
    src.fill_(1.0)

    def best(fn) -> float:
        fn()
        _sync(device)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - start)
        return min(times)

    t_mm = best(lambda: torch.mm(mat_a, mat_b))
    t_copy = best(lambda: dst.copy_(src))
    return dict(peak_flops=2 * n**3 / t_mm, bandwidth=2 * numel * src.element_size() / t_copy)
