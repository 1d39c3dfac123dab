"""Slow, obviously-correct reference implementations that the model's fast paths are checked against.

Written from the equations, independently of ``vlm``'s code: explicit softmax attention, per-token
MoE routing with a Python loop over tokens, and the plain MoE transformer the ``none`` mode must equal.
"""

# Shape suffixes (docs/paper.md §0): N tokens of one row, M concepts, D model width, H heads, K head dim,
# T tokens flattened (the MoE's input rows).

import math

import torch
import torch.nn.functional as F


def rms_norm(x, weight, eps):
    return weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x_HNK, pos_N, theta):
    hd = x_HNK.shape[-1]
    out = torch.empty_like(x_HNK)
    for n, p in enumerate(pos_N.tolist()):
        for i in range(hd // 2):
            angle = p / theta ** (2 * i / hd)
            a, b = x_HNK[:, n, i], x_HNK[:, n, i + hd // 2]
            out[:, n, i] = a * math.cos(angle) - b * math.sin(angle)
            out[:, n, i + hd // 2] = b * math.cos(angle) + a * math.sin(angle)
    return out


def attention(block, x_ND, pos_N, doc_N, cfg):
    """One sequence: softmax(QKᵀ/√d + mask) V with KV heads repeated for GQA."""
    attn = block.attn
    n, hd, h, g = x_ND.shape[0], attn.head_dim, attn.n_heads, attn.n_kv_heads
    q = attn.q_proj(x_ND).view(n, h, hd).transpose(0, 1)
    k = attn.k_proj(x_ND).view(n, g, hd).transpose(0, 1)
    v = attn.v_proj(x_ND).view(n, g, hd).transpose(0, 1)
    q, k = rope(q, pos_N, cfg.rope_theta), rope(k, pos_N, cfg.rope_theta)
    k, v = k.repeat_interleave(h // g, dim=0), v.repeat_interleave(h // g, dim=0)
    scores = q @ k.transpose(1, 2) / math.sqrt(hd)
    allowed = torch.tensor([[j <= i and doc_N[i] == doc_N[j] for j in range(n)] for i in range(n)])
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return attn.o_proj((probs @ v).transpose(0, 1).reshape(n, h * hd))


def moe_per_token(moe, x_TD):
    """Route every token on its own: softmax, top-k, (renormalise), sum of its experts' SwiGLU outputs."""
    out = torch.zeros_like(x_TD)
    for t in range(x_TD.shape[0]):
        probs = moe.router(x_TD[t]).float().softmax(-1)
        w, idx = probs.topk(moe.top_k)
        if moe.norm_topk_prob:
            w = w / w.sum()
        for weight, e in zip(w, idx.tolist()):
            f = moe.w_down.shape[1]
            gate, up = moe.w_gate_up[e, :, :f], moe.w_gate_up[e, :, f:]
            hidden = F.silu(x_TD[t] @ gate) * (x_TD[t] @ up)
            out[t] += weight * (hidden @ moe.w_down[e])
        if moe.shared is not None:
            out[t] += moe.shared(x_TD[t])
    return out


def plain_moe_transformer_logits(model, ids_N, doc_N=None):
    """The MoE baseline of the paper, one sequence: embed, every layer in order, norm, lm_head."""
    cfg = model.config
    inner = model.model
    n = ids_N.shape[0]
    doc_N = torch.zeros(n, dtype=torch.long) if doc_N is None else doc_N
    pos_N = torch.tensor([sum(1 for j in range(i) if doc_N[j] == doc_N[i]) for i in range(n)])
    x = inner.embed_tokens(ids_N)
    blocks = list(inner.encoder.layers)
    blocks += [inner.concept_model.layers[i] for i in cfg.concept_schedule()]
    blocks += list(inner.decoder.layers)
    for block in blocks:
        x = x + attention(block, rms_norm(x, block.attn_norm.weight, cfg.rms_norm_eps), pos_N, doc_N, cfg)
        x = x + moe_per_token(block.ffn, rms_norm(x, block.ffn_norm.weight, cfg.rms_norm_eps))
    return model.lm_head(rms_norm(x, inner.norm.weight, cfg.rms_norm_eps))


def ema_loop(c_MD, p_M):
    """Eq. 7-8 as written: one concept at a time."""
    out, state = [], torch.zeros_like(c_MD[0])
    for m in range(c_MD.shape[0]):
        state = p_M[m] * c_MD[m] + (1 - p_M[m]) * state
        out.append(state)
    return torch.stack(out)
