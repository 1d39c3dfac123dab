"""Parameter and FLOP accounting for ConceptMoE, and compute matching of the three strategies of the paper's §3.5
(docs/paper.md §9).

Conventions (the paper fixes only what is matched; the rest is ours, docs/paper.md §12.13):

* FLOPs = 2 x multiply-accumulates, forward pass only, per *token* (per input position N, not per concept).
  Only matrix products count: norms, RoPE, activations, softmax, bias adds, top-k, the EMA / dechunk and
  embedding lookups are free.
* ``flops_linear_per_token``: every weight matmul ("non-attention FLOPs", what the paper matches, footnote 2).
  Token-level layers (encoder, decoder), the chunk module, the joint-decoding projections (Eq. 11) and the
  LM head run at full rate; concept layers (each entry of ``config.concept_schedule()``, so strategy-2 loops
  count once per application) and the d <-> d_c projectors run once per concept, i.e. are divided by R.
* ``flops_attn_per_token``: attention-map FLOPs (QK^T and AV) with the *causal* convention: a query at
  position i attends to i keys, ~N/2 on average, so one token layer costs 2 * 2 * H * hd * N / 2 =
  2 * H * hd * N per token (the full square would be 4 * H * hd * N). A concept layer sees N/R concepts
  and runs once per R tokens: (1/R) * 2 * H * hd_c * (N/R). With MHA (H * hd = d) the concept layers total
  2 * L_C * d * N^2 / R^2 over a sequence: the paper's Table 1 L_C * d * N^2 / R^2 up to the constant, hence its
  R^2 (S1), R^2 L_C / (L_C + L_loop) (S2) and R^1.5 (S3 with d_c = sqrt(R) d) reductions.
* ``kv_cache_per_token``: cached K and V elements per token: 2 * KV * hd per token layer, and
  2 * KV * hd_c / R per concept-layer application (Table 1's 2 * L_C * d * N with MHA). Joint decoding adds
  no cache: c W^c is folded into the token's K and V.
* ``params_active`` = ``params_total`` minus the routed experts a token does not use: (E - k) * 3 * w * F per
  distinct MoE layer. Embedding and LM head are included (``params_active_nonembed`` excludes both).
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass

from vlm.backbone.config import ConceptMoEConfig
from vlm.backbone.presets import PAPER_SCALE_MOE

logger = logging.getLogger(__name__)

TOLERANCE = 0.02


# ----------------------------------------------------------------------------- plain view of a config
_FIELDS = [k for k in inspect.signature(ConceptMoEConfig.__init__).parameters if k not in ("self", "kwargs")]


class _Fields:
    """Plain-attribute copy of a ConceptMoEConfig with the config's own derived properties.

    Attribute access on a ``PretrainedConfig`` is slow (~1 us), and ``match`` evaluates thousands of
    candidates; this keeps the search fast without re-implementing the derived values.
    """

    chunked = ConceptMoEConfig.chunked
    effective_r = ConceptMoEConfig.effective_r
    token_head_dim = ConceptMoEConfig.token_head_dim
    concept_head_dim = ConceptMoEConfig.concept_head_dim
    dense_ffn_dim = ConceptMoEConfig.dense_ffn_dim
    concept_schedule = ConceptMoEConfig.concept_schedule

    def __init__(self, fields: dict):
        self.__dict__.update(fields)

    @classmethod
    def of(cls, config) -> _Fields:
        return config if isinstance(config, cls) else cls({k: getattr(config, k) for k in _FIELDS})


# ----------------------------------------------------------------------------- one transformer block
@dataclass(frozen=True)
class _Block:
    """One pre-norm block (attention + MoE or dense SwiGLU) at width w, head dim hd (Eq. 1's E, C, D blocks)."""

    width: int
    head_dim: int
    experts: int
    top_k: int
    ffn_dim: int

    def attn_weights(self, cfg) -> int:
        """q: w x H hd, k and v: w x KV hd, o: H hd x w."""
        return self.width * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) * self.head_dim

    def params(self, cfg) -> int:
        """Both norms, attention (+ q/k/v biases, + qk norms), FFN: router w x E, E routed experts (3 w F each)
        and the shared SwiGLU (3 w x its width, + its gate), or one dense SwiGLU of ``dense_ffn_dim``."""
        q, kv = cfg.n_heads * self.head_dim, cfg.n_kv_heads * self.head_dim
        n = 2 * self.width + self.attn_weights(cfg)
        n += (q + 2 * kv) if cfg.attention_bias else 0
        n += {"none": 0, "head": 2 * self.head_dim, "full": q + kv}[cfg.qk_norm]
        if cfg.ffn == "dense":
            return n + 3 * self.width * cfg.dense_ffn_dim
        w, f = self.width, self.ffn_dim
        return n + w * self.experts + 3 * w * (f * self.experts + self.shared_width(cfg)) + self.shared_gate(cfg)

    def shared_width(self, cfg) -> int:
        """Hidden width of the shared SwiGLU: ``shared_expert_dim``, else ``shared_experts`` x F (0: none)."""
        return 0 if cfg.shared_experts == 0 else cfg.shared_expert_dim or cfg.shared_experts * self.ffn_dim

    def shared_gate(self, cfg) -> int:
        """The shared expert's sigmoid gate (``shared_expert_gate``, Qwen2-MoE): a w -> 1 projection."""
        return self.width if cfg.shared_expert_gate and cfg.shared_experts > 0 else 0

    def inactive_params(self, cfg) -> int:
        """Routed-expert weights a token does not touch: (E - k) * 3 * w * F."""
        return 0 if cfg.ffn == "dense" else (self.experts - self.top_k) * 3 * self.width * self.ffn_dim

    def linear_flops(self, cfg) -> int:
        """2 x MACs for one token: projections, router, k routed + shared experts (or the dense FFN)."""
        w, f = self.width, self.ffn_dim
        dense = cfg.ffn == "dense"
        routed = w * self.experts + 3 * w * (f * self.top_k + self.shared_width(cfg)) + self.shared_gate(cfg)
        return 2 * (self.attn_weights(cfg) + (3 * w * cfg.dense_ffn_dim if dense else routed))

    def attn_map_flops(self, cfg, n_keys: float) -> float:
        """Causal QK^T + AV for one query over a sequence of n_keys: 2 * H * hd * n_keys."""
        return 2 * cfg.n_heads * self.head_dim * n_keys

    def kv_elements(self, cfg) -> int:
        return 2 * cfg.n_kv_heads * self.head_dim


# ----------------------------------------------------------------------------- count
def count(config: ConceptMoEConfig, seq_len: int = 4096, r: float | None = None) -> dict:
    """Params, active params, per-token forward FLOPs and KV cache of ``config`` at ``seq_len`` and compression ratio
    ``r`` (default ``config.effective_r``), by the module docstring's conventions.

    Keys: ``params_total``, ``params_active``, ``params_active_nonembed``, ``params_embedding``,
    ``flops_linear_per_token``, ``flops_attn_per_token``, ``flops_per_token`` (their sum), ``kv_cache_per_token``,
    ``r``, ``seq_len``, and per-part breakdowns ``params`` and ``flops_linear``.
    """
    cfg = _Fields.of(config)
    r = cfg.effective_r if r is None else float(r)
    tok = _Block(cfg.d_model, cfg.token_head_dim, cfg.num_experts, cfg.top_k, cfg.expert_dim)
    d_c = cfg.concept_d_model
    con = _Block(d_c, cfg.concept_head_dim, cfg.concept_num_experts, cfg.concept_top_k, cfg.concept_expert_dim)
    n_tok, n_con = cfg.encoder_layers + cfg.decoder_layers, len(cfg.concept_schedule())
    params = _params(cfg, tok, con, n_tok)
    flops_linear = _flops_linear(cfg, params, tok, con, n_tok, n_con, r)
    total = sum(params.values())
    inactive = n_tok * tok.inactive_params(cfg) + cfg.concept_layers * con.inactive_params(cfg)
    embed, head = params["embedding"], params["lm_head"]
    linear = sum(flops_linear.values())
    attn = n_tok * tok.attn_map_flops(cfg, seq_len) + n_con * con.attn_map_flops(cfg, seq_len / r) / r
    kv_cache = n_tok * tok.kv_elements(cfg) + n_con * con.kv_elements(cfg) / r
    return dict(
        params_total=total,
        params_active=total - inactive,
        params_embedding=embed + head,
        params_active_nonembed=total - inactive - embed - head,
        flops_linear_per_token=linear,
        flops_attn_per_token=attn,
        flops_per_token=linear + attn,
        kv_cache_per_token=kv_cache,
        r=r,
        seq_len=seq_len,
        params=params,
        flops_linear=flops_linear,
    )


def _params(cfg: _Fields, tok: _Block, con: _Block, n_tok: int) -> dict:
    """Parameters per part. Chunk module (Eq. 2, dynamic chunking only): cosine router q, k (d x d each) or a
    Linear(2d -> 1) with bias. Every chunked model has an RMSNorm(d_c) after the concept model, the d -> d_c -> d
    projectors when the concept model is wider (strategy 3, §3.5) and joint decoding's W_q^c, W_k^c, W_v^c
    (Eq. 11) in the last ``joint_layers`` decoder blocks."""
    d, d_c, V = cfg.d_model, cfg.concept_d_model, cfg.vocab_size
    q, kv = cfg.n_heads * cfg.token_head_dim, cfg.n_kv_heads * cfg.token_head_dim
    dynamic = cfg.chunking == "dynamic"
    return dict(
        embedding=V * d,
        lm_head=0 if cfg.tie_word_embeddings else d * V,
        final_norm=d,
        token_layers=n_tok * tok.params(cfg),
        concept_layers=cfg.concept_layers * con.params(cfg),
        concept_norm=d_c if cfg.chunked else 0,
        chunk=(2 * d * d if cfg.boundary_router == "cosine" else 2 * d + 1) if dynamic else 0,
        projectors=2 * d * d_c if cfg.chunked and d_c != d else 0,
        joint=cfg.joint_layers * d * (q + 2 * kv) if cfg.chunked else 0,
    )


def _flops_linear(cfg: _Fields, params: dict, tok: _Block, con: _Block, n_tok: int, n_con: int, r: float) -> dict:
    """Linear FLOPs per token and part. Full rate: token layers, chunk module (the linear router runs on N - 1 token
    pairs, counted as N), joint projections, LM head. Per concept (/ r): each of the ``n_con`` concept layer
    applications (strategy-2 loops included) and the projectors."""
    dynamic = cfg.chunking == "dynamic"
    return dict(
        token_layers=n_tok * tok.linear_flops(cfg),
        concept_layers=n_con * con.linear_flops(cfg) / r,
        chunk=(2 * params["chunk"] if cfg.boundary_router == "cosine" else 2 * 2 * cfg.d_model) if dynamic else 0,
        projectors=2 * params["projectors"] / r,
        joint=2 * params["joint"],
        lm_head=2 * cfg.d_model * cfg.vocab_size,
    )


# ----------------------------------------------------------------------------- matching (§3.5)
def match_report(baseline, candidate, seq_len: int = 4096, tol: float = TOLERANCE) -> dict:
    """How ``candidate`` compares with ``baseline``: relative mismatch (candidate / baseline - 1) of total
    params and of linear (non-attention) FLOPs per token, and candidate / baseline ratios of the
    attention-map FLOPs at ``seq_len`` and of the KV cache (the paper's Table 1; < 1 means a saving)."""
    b, c = count(baseline, seq_len), count(candidate, seq_len)
    params = c["params_total"] / b["params_total"] - 1.0
    flops = c["flops_linear_per_token"] / b["flops_linear_per_token"] - 1.0
    worst = max(abs(params), abs(flops))
    return {
        "params_mismatch": params,
        "flops_linear_mismatch": flops,
        "max_mismatch": worst,
        "within_tolerance": worst <= tol,
        "attn_flops_ratio": c["flops_attn_per_token"] / b["flops_attn_per_token"],
        "kv_cache_ratio": c["kv_cache_per_token"] / b["kv_cache_per_token"],
        "params_active_ratio": c["params_active"] / b["params_active"],
        "seq_len": seq_len,
    }


_SEARCHED = ("concept_top_k", "concept_num_experts", "concept_d_model", "concept_expert_dim")


def _structures(base: ConceptMoEConfig, r: float, strategy: int, fixed: dict):
    """Candidate values of everything but ``concept_top_k`` (solved for afterwards), with a hard and a soft
    preference (smaller = closer to the paper's shape; the soft one only among mismatches <= 0.75 tol)."""

    def values(name: str, default: range | list) -> list:
        return [fixed[name]] if fixed.get(name) is not None else list(default)

    E, L_C = base.num_experts, base.concept_layers
    if strategy in (1, 2):
        # S1/S2 keep the concept layers' shape; removing a few concept experts absorbs the chunk / joint
        # params. Both are CT-friendly (§3.5), so keeping every pretrained expert is preferred. S2: fewest
        # repetitions, looping about half the concept layers: our reading of the paper's 1.5L-top13-R2 latency
        # run (§4.4); the paper does not say which layers loop.
        loops = values("concept_loop", range(2, 5)) if strategy == 2 else [1]
        layers = values("concept_loop_layers", range(1, L_C + 1)) if strategy == 2 else [0]
        for e in values("concept_num_experts", range(E, (E + 1) // 2 - 1, -1)):
            for n in loops:
                for m in layers:
                    knobs = dict(concept_num_experts=e, concept_loop=n, concept_loop_layers=m)
                    yield knobs, (E - e, n), abs(2 * m - L_C) if n > 1 else 0
    elif strategy == 3:
        # S3: wider concept model (head dim a multiple of 8), fewer experts, slightly smaller F_c.
        # Preferred width: d_c = sqrt(R) d, the shape behind Table 1's R^1.5 (x4/3 at R=16/9 in the 12B
        # run; x1.5 at R=2 in the 60B VLM), searched within x1.25 - x1.5 of d.
        d, step = base.d_model, base.n_heads * 8
        lo, hi = math.ceil(1.25 * d / step) * step, max(math.floor(1.5 * d / step) * step, step)
        widths = values("concept_d_model", range(lo, max(hi, lo) + 1, step))
        widths.sort(key=lambda w: abs(w - math.sqrt(r) * d))
        F, f_step = base.expert_dim, 8 if base.expert_dim >= 64 else 1
        ffns = values("concept_expert_dim", range(F, max(f_step, int(0.75 * F)) - 1, -f_step))
        for rank, w in enumerate(widths):
            for f in ffns:
                for e in values("concept_num_experts", range(E - 1, 0, -1)):
                    knobs = dict(concept_d_model=w, concept_expert_dim=f, concept_num_experts=e)
                    yield knobs, (rank,), 0
    else:
        raise ValueError(f"strategy={strategy!r} is invalid: allowed values are 1, 2, 3 (the paper's §3.5)")


def match(
    baseline_config: ConceptMoEConfig,
    target_r: float,
    strategy: int,
    *,
    tol: float = TOLERANCE,
    seq_len: int = 4096,
    return_report: bool = False,
    **overrides,
):
    """A chunked ConceptMoE config (``chunking="dynamic"``, ``target_r``) whose total params and linear FLOPs per
    token (``count()``) match the plain-MoE baseline's within ``tol``; attention-map FLOPs are left out, as in the
    paper (§3.5, footnote 2; docs/paper.md §9). Unsearched fields come from ``baseline_config`` and ``overrides``;
    an override of a searched field pins it. ``strategy`` (searched in ``_structures``): 1 more active concept
    experts, 2 loops over middle concept layers, 3 a wider concept model.

    The preferred shape within ``tol`` wins, then the smallest max(|dparams|, |dflops|); with none within ``tol``
    the smallest mismatch wins and a warning is logged. Returns the config, or ``(config, match_report(...))``.
    """
    reset = {**dict.fromkeys(_SEARCHED), "concept_loop": 1, "concept_loop_layers": 0}
    reset = {k: v for k, v in reset.items() if k not in overrides}
    kwargs = {k: getattr(baseline_config, k) for k in _FIELDS}
    base = ConceptMoEConfig(**{**kwargs, **reset, **overrides, "chunking": "none", "target_r": 1.0})
    kwargs = {k: getattr(base, k) for k in _FIELDS}  # validated and normalised (n_kv_heads, joint_layers)
    kwargs.update(chunking=overrides.get("chunking", "dynamic"), target_r=float(target_r))
    search = _Search(kwargs, count(baseline_config, seq_len), seq_len, tol)
    best = search.best(base, float(target_r), strategy, overrides)
    if best is None:
        raise ValueError(f"no strategy-{strategy} candidate for this baseline (check the pinned overrides)")
    config = ConceptMoEConfig(**{**kwargs, **best[1], "concept_top_k": best[2]})
    report = match_report(baseline_config, config, seq_len, tol)
    if not report["within_tolerance"]:
        p, f = 100 * report["params_mismatch"], 100 * report["flops_linear_mismatch"]
        msg = "match(strategy=%d, R=%s): best candidate is off by params %+.2f%%, linear FLOPs %+.2f%%"
        logger.warning(msg, strategy, target_r, p, f)
    return (config, report) if return_report else config


class _Search:
    """``match``'s search: candidate configs from ``kwargs``, scored by their mismatch with the baseline's count."""

    def __init__(self, kwargs: dict, ref: dict, seq_len: int, tol: float):
        self.kwargs, self.seq_len, self.tol = kwargs, seq_len, tol
        self.p_ref, self.f_ref = ref["params_total"], ref["flops_linear_per_token"]

    def build(self, knobs: dict, k: int) -> _Fields:
        return _Fields({**self.kwargs, **knobs, "concept_top_k": k})

    def mismatch(self, cfg: _Fields) -> float:
        c = count(cfg, self.seq_len)
        return max(abs(c["params_total"] / self.p_ref - 1), abs(c["flops_linear_per_token"] / self.f_ref - 1))

    def best(self, base: ConceptMoEConfig, target_r: float, strategy: int, overrides: dict):
        """(key, knobs, k) of the best candidate, or None; key = (outside tol, hard pref, outside 0.75 tol, soft
        pref, mismatch)."""
        best, tol = None, self.tol
        for knobs, hard, soft in _structures(base, target_r, strategy, overrides):
            e = knobs["concept_num_experts"]
            k_lo = base.top_k if strategy in (1, 2) else 1
            pinned_k = overrides.get("concept_top_k")
            if best is not None and not best[0][0] and hard > best[0][1]:
                continue  # a better-shaped candidate already fits
            if pinned_k is None and k_lo > e:
                continue
            c0 = count(self.build(knobs, pinned_k or k_lo), self.seq_len)
            d_params = abs(c0["params_total"] / self.p_ref - 1)  # params do not depend on k_c
            if d_params > tol and best is not None and (not best[0][0] or d_params >= best[0][-1]):
                continue
            for k in [pinned_k] if pinned_k is not None else self.top_ks(knobs, k_lo, c0):
                err = self.mismatch(self.build(knobs, k))
                key = (err > tol, hard, err > 0.75 * tol, soft, err) if err <= tol else (True, (), True, 0, err)
                if best is None or key < best[0]:
                    best = (key, knobs, k)
        return best

    def top_ks(self, knobs: dict, k_lo: int, c0: dict) -> list[int]:
        """Linear FLOPs are affine in k_c: solve for the baseline's, then take the integer neighbours."""
        e, f0 = knobs["concept_num_experts"], c0["flops_linear_per_token"]
        slope = count(self.build(knobs, k_lo + 1), self.seq_len)["flops_linear_per_token"] - f0 if e > k_lo else 1
        k_star = k_lo + (self.f_ref - f0) / slope
        return sorted({min(max(k, k_lo), e) for k in (math.floor(k_star), math.ceil(k_star))})


# ----------------------------------------------------------------------------- CLI
def _table_rows(seq_len: int):
    """(name, config, baseline or None): presets, then matched configs for small-moe and the paper scale."""
    preset = ConceptMoEConfig.from_preset
    rows = [("tiny-moe", preset("tiny-moe"), None), ("tiny (preset)", preset("tiny"), preset("tiny-moe"))]
    rows.append(("  S1 R=2", match(preset("tiny-moe"), 2.0, 1, seq_len=seq_len), preset("tiny-moe")))
    for name, base in (
        ("small-moe", preset("small-moe")),
        ("paper-moe", ConceptMoEConfig(**PAPER_SCALE_MOE)),
    ):
        rows.append((name, base, None))
        if name == "small-moe":
            rows.append(("small (preset)", preset("small"), base))
        for strategy, r in ((1, 2.0), (1, 1.5), (2, 2.0), (3, 2.0)):
            rows.append((f"  S{strategy} R={r:g}", match(base, r, strategy, seq_len=seq_len), base))
    return rows


def _shape(cfg: ConceptMoEConfig) -> str:
    if not cfg.chunked:
        return f"E={cfg.num_experts} k={cfg.top_k} F={cfg.expert_dim}"
    out = f"k_c={cfg.concept_top_k} E_c={cfg.concept_num_experts}"
    if cfg.concept_loop > 1:
        out += f" loop={cfg.concept_loop}x{cfg.concept_loop_layers or cfg.concept_layers}"
    if cfg.concept_d_model != cfg.d_model or cfg.concept_expert_dim != cfg.expert_dim:
        out += f" d_c={cfg.concept_d_model} F_c={cfg.concept_expert_dim}"
    return out


def format_table(seq_len: int = 4096) -> str:
    """The Markdown table ``python -m vlm.accounting.flops`` prints ("!" marks a mismatch over 2%)."""
    head = [
        "config",
        "shape",
        "params",
        "active",
        "active non-emb",
        "linear GFLOP/tok",
        f"attn MFLOP/tok @{seq_len}",
        "KV/tok",
        "d params",
        "d linear FLOPs",
        "attn ratio",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, cfg, base in _table_rows(seq_len):
        c = count(cfg, seq_len)
        cells = [name, _shape(cfg)]
        cells += [f"{c[k] / 1e6:,.2f}M" for k in ("params_total", "params_active", "params_active_nonembed")]
        cells += [f"{c['flops_linear_per_token'] / 1e9:.4f}", f"{c['flops_attn_per_token'] / 1e6:,.1f}"]
        cells.append(f"{c['kv_cache_per_token']:,.0f}")
        if base is None:
            cells += ["(baseline)", "", ""]
        else:
            rep = match_report(base, cfg, seq_len)
            for key in ("params_mismatch", "flops_linear_mismatch"):
                cells.append(f"{100 * rep[key]:+.2f}%" + (" !" if abs(rep[key]) > TOLERANCE else ""))
            cells.append(f"{rep['attn_flops_ratio']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    print(format_table())


if __name__ == "__main__":
    main()
