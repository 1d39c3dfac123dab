"""Inference speed: ConceptMoE vs its compute-matched MoE, next to the ideal of the FLOP/byte model (the paper's
latency comparison, §4.4 and Fig. 5, at toy scale).

    python scripts/bench_inference.py [--preset small-moe] [--full] [--device cuda --dtype bf16] [--json OUT]

Pairs (``vlm.accounting.flops.match`` on the baseline preset, params and linear FLOPs within 2%): strategy 1 at
R = 2 and R = 1.5, strategy 2 (looped concept layers) at R = 2 - or one trained ConceptMoE from ``--checkpoint DIR``.
Random init by default, so the dynamic router's R is not its target: the candidates use ``fixed`` chunking
(a boundary every R tokens, exactly the target R) unless ``--chunking dynamic`` (random router q/k, R ~ 2).
Every figure is a ratio baseline / candidate measured round-robin in the same run (median of the rounds),
printed next to the ideal of ``vlm.accounting.inference_cost`` at the R actually measured, and the fraction achieved:

* prefill: one forward of N tokens, batch 1, ``use_cache=True``, logits of the last position only;
* decode: tokens/s of ``--decode-steps`` one-token steps on a cache of ~KV tokens (the prompt is KV minus half
  the steps run, so the cache averages KV over the run), batch 1 and 8; the roofline ideal uses the peak
  FLOP/s and bandwidth measured here at the start (``--peak-flops`` / ``--bandwidth`` override them);
* KV cache: ``cache.kv_bytes()`` after the prefill (a ratio of bytes, not a timing).
"""

# Shape suffixes (docs/paper.md §0): B batch rows, N tokens per row, 1 a singleton axis.

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoConfig

from vlm import ConceptMoEConfig, ConceptMoEForCausalLM, ConceptMoEVLM
from vlm.accounting.flops import match, match_report
from vlm.accounting.inference_cost import ideal_decode_speedup, ideal_kv_ratio, ideal_prefill_speedup, measure_device

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PAIRS = (("S1 R=2", 1, 2.0), ("S1 R=1.5", 1, 1.5), ("S2 R=2", 2, 2.0))


def describe(cfg: ConceptMoEConfig) -> str:
    """A one-line shape of a config (what the matching changed)."""
    if not cfg.chunked:
        return f"{cfg.chunking} E={cfg.num_experts} k={cfg.top_k}"
    loop = f" loop={cfg.concept_loop}x{cfg.concept_loop_layers or cfg.concept_layers}" if cfg.concept_loop > 1 else ""
    return f"{cfg.chunking} R={cfg.target_r:g} k_c={cfg.concept_top_k} E_c={cfg.concept_num_experts}{loop}"


def build_models(args, device: torch.device, dtype: torch.dtype) -> tuple[ConceptMoEForCausalLM, dict]:
    """The baseline (random init) and the candidates: matched configs, or the checkpoint."""
    base_cfg = ConceptMoEConfig.from_preset(args.preset, max_position_embeddings=1 << 20)

    def load(cfg_or_dir) -> ConceptMoEForCausalLM:
        torch.manual_seed(0)
        if isinstance(cfg_or_dir, str):  # a ConceptMoEForCausalLM folder, or a VLM export (its language model)
            is_vlm = AutoConfig.from_pretrained(cfg_or_dir).model_type == ConceptMoEVLM.config_class.model_type
            model = (
                ConceptMoEVLM.from_pretrained(cfg_or_dir).language_model
                if is_vlm
                else ConceptMoEForCausalLM.from_pretrained(cfg_or_dir)
            )
        else:
            model = ConceptMoEForCausalLM(cfg_or_dir)
        return model.to(device=device, dtype=dtype).eval()

    if args.checkpoint:
        return load(base_cfg), {"checkpoint": load(args.checkpoint)}
    extra = {"boundary_router_init": "random"} if args.chunking == "dynamic" else {}
    cands = {name: match(base_cfg, r, s, chunking=args.chunking, **extra) for name, s, r in PAIRS}
    return load(base_cfg), {name: load(cfg) for name, cfg in cands.items()}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def round_robin(steps: dict, repeats: int, device: torch.device) -> dict:
    """Median seconds of each callable, timed round-robin after one warm-up call each: drift on a shared
    machine hits every model alike instead of whichever ran during a slow spell."""
    for step in steps.values():
        step()
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            sync(device)
            start = time.perf_counter()
            step()
            sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def prefill(model, n: int, batch: int, device: torch.device, seen: dict | None = None):
    """A closure running one prefill of random tokens (its output lands in ``seen['out']``)."""
    gen = torch.Generator().manual_seed(n)
    ids_BN = torch.randint(0, model.config.vocab_size, (batch, n), generator=gen).to(device)
    mask_BN = torch.ones(batch, n, dtype=torch.long, device=device)

    def step():
        out = model(input_ids=ids_BN, attention_mask=mask_BN, use_cache=True, logits_to_keep=1)
        if seen is not None:
            seen["out"] = out
        return out

    return step, mask_BN


def bench_prefill(base, cands: dict, lengths: list[int], repeats: int, device) -> list[dict]:
    """Prefill latency and KV bytes per length: base and all candidates timed round-robin."""
    rows = []
    for n in lengths:
        seen = {name: {} for name in ["base", *cands]}
        models = {"base": base, **cands}
        steps = {name: prefill(m, n, 1, device, seen[name])[0] for name, m in models.items()}
        sec = round_robin(steps, repeats, device)
        base_kv = seen["base"]["out"].cache.kv_bytes()["total"]
        for name, model in cands.items():
            out = seen[name]["out"]
            r = out.chunk_stats["r"]
            kv = out.cache.kv_bytes()["total"]
            ideal = ideal_prefill_speedup(base.config, model.config, n, r=r, all_logits=False)
            ideal_kv = ideal_kv_ratio(base.config, model.config, n, r=r)
            rows.append(
                dict(pair=name, n=n, r=r, base_s=sec["base"], cand_s=sec[name], speedup=sec["base"] / sec[name])
            )
            rows[-1].update(ideal=ideal, base_kv=base_kv, cand_kv=kv, kv_ratio=base_kv / kv, kv_ideal=ideal_kv)
            print(f"  prefill N={n} {name}: {rows[-1]['speedup']:.3f}x (ideal {ideal:.3f}x, R={r:.3f})", flush=True)
        del seen, steps
    return rows


def decoder(model, kv_len: int, batch: int, n_steps: int, total_steps: int, device, log: dict):
    """Prefill a cache to about ``kv_len - total_steps / 2`` tokens, then return a closure that decodes
    ``n_steps`` greedy tokens; ``log`` collects (tokens, concepts added) for the measured R."""
    step, mask_BN = prefill(model, max(kv_len - total_steps // 2, 1), batch, device)
    with torch.inference_mode():
        out = step()
    state = dict(cache=out.cache, next_B1=out.logits[:, -1:].argmax(-1), mask_BN=mask_BN)
    log.update(tokens=0, concepts=0)
    ones_B1 = torch.ones(batch, 1, dtype=torch.long, device=device)

    def run():
        before = state["cache"].concept_lengths().sum()
        for _ in range(n_steps):
            state["mask_BN"] = torch.cat([state["mask_BN"], ones_B1], dim=1)
            out = model(
                input_ids=state["next_B1"], attention_mask=state["mask_BN"], cache=state["cache"], use_cache=True
            )
            state["next_B1"] = out.logits[:, -1:].argmax(-1)
        log["tokens"] += n_steps * batch
        log["concepts"] += int(state["cache"].concept_lengths().sum() - before)

    return run


def bench_decode(base, cands, kv_lens, batches, args, device, hw: dict, dtype_bytes: int) -> list[dict]:
    """Decode tokens/s per (KV length, batch): base and all candidates timed round-robin."""
    rows = []
    total = args.decode_steps * (args.repeats + 1)
    for kv_len in kv_lens:
        for batch in batches:
            models = {"base": base, **cands}
            logs = {name: {} for name in models}
            steps = {n: decoder(m, kv_len, batch, args.decode_steps, total, device, logs[n]) for n, m in models.items()}
            sec = round_robin(steps, args.repeats, device)
            tps = {name: batch * args.decode_steps / s for name, s in sec.items()}
            for name, model in cands.items():
                r = logs[name]["tokens"] / max(logs[name]["concepts"], 1)
                aligned = model.config.chunking == "fixed"
                ideal = ideal_decode_speedup(
                    base.config, model.config, kv_len, batch, r=r, dtype_bytes=dtype_bytes, aligned=aligned, **hw
                )
                speedup = tps[name] / tps["base"]
                row = dict(pair=name, kv=kv_len, batch=batch, r=r, base_tps=tps["base"], cand_tps=tps[name])
                rows.append({**row, "speedup": speedup, "ideal": ideal})
                print(f"  decode KV={kv_len} B={batch} {name}: {speedup:.3f}x (ideal {ideal:.3f}x)", flush=True)
            del steps
    return rows


def pct(row: dict, key: str = "speedup", ideal: str = "ideal") -> str:
    """Fraction of ideal achieved, bold when at least 90%."""
    frac = row[key] / row[ideal]
    return f"**{frac:.0%}**" if frac >= 0.9 else f"{frac:.0%}"


def print_tables(prefill_rows: list[dict], decode_rows: list[dict]) -> None:
    """The Markdown tables of the run."""
    if prefill_rows:
        print("\nPrefill (batch 1):\n")
        print("| pair | N | R | MoE ms | ConceptMoE ms | speedup | ideal | of ideal |")
        print("|---|---|---|---|---|---|---|---|")
        for r in prefill_rows:
            print(
                f"| {r['pair']} | {r['n']} | {r['r']:.2f} | {1e3 * r['base_s']:,.0f} | {1e3 * r['cand_s']:,.0f} "
                f"| {r['speedup']:.2f}x | {r['ideal']:.2f}x | {pct(r)} |"
            )
        print("\nKV cache after the prefill (batch 1):\n")
        print("| pair | N | R | MoE MB | ConceptMoE MB | reduction | ideal | of ideal |")
        print("|---|---|---|---|---|---|---|---|")
        for r in prefill_rows:
            print(
                f"| {r['pair']} | {r['n']} | {r['r']:.2f} | {r['base_kv'] / 2**20:,.1f} | {r['cand_kv'] / 2**20:,.1f} "
                f"| {r['kv_ratio']:.3f}x | {r['kv_ideal']:.3f}x | {pct(r, 'kv_ratio', 'kv_ideal')} |"
            )
    if decode_rows:
        print("\nDecode:\n")
        print("| pair | KV | batch | R | MoE tok/s | ConceptMoE tok/s | speedup | ideal | of ideal |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in decode_rows:
            print(
                f"| {r['pair']} | {r['kv']} | {r['batch']} | {r['r']:.2f} | {r['base_tps']:,.1f} "
                f"| {r['cand_tps']:,.1f} | {r['speedup']:.2f}x | {r['ideal']:.2f}x | {pct(r)} |"
            )


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small-moe", help="baseline preset (the candidates are matched to it)")
    parser.add_argument(
        "--checkpoint",
        help="a trained ConceptMoEForCausalLM or ConceptMoEVLM export (replaces the "
        "matched pairs; the baseline is --preset, e.g. small-moe for a small checkpoint)",
    )
    parser.add_argument("--chunking", choices=("fixed", "dynamic"), default="fixed")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--lengths", type=ints, default=None, help="prefill lengths (default 1024,2048,4096)")
    parser.add_argument("--decode-lengths", type=ints, default=None, help="KV lengths (default 1024,2048)")
    parser.add_argument("--batches", type=ints, default=[1, 8], help="decode batch sizes")
    parser.add_argument("--full", action="store_true", help="prefill 1K..32K and decode 1K..16K")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per model (median)")
    parser.add_argument("--decode-steps", type=int, default=12, help="decode steps per timed round")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--peak-flops", type=float, help="FLOP/s for the roofline (default: measured)")
    parser.add_argument("--bandwidth", type=float, help="bytes/s for the roofline (default: measured)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--json", help="write every row and the setup to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    full = [1 << i for i in range(10, 16)]
    lengths = args.lengths or (full if args.full else [1024, 2048, 4096])
    kv_lens = args.decode_lengths or (full[:5] if args.full else [1024, 2048])
    device, dtype = torch.device(args.device), DTYPES[args.dtype]

    hw = measure_device(device, dtype)
    hw = dict(peak_flops=args.peak_flops or hw["peak_flops"], bandwidth=args.bandwidth or hw["bandwidth"])
    base, cands = build_models(args, device, dtype)
    print(f"# baseline {args.preset}: {describe(base.config)}; {args.device} {args.dtype}, torch {torch.__version__}")
    print(
        f"# roofline: {hw['peak_flops'] / 1e9:,.1f} GFLOP/s, {hw['bandwidth'] / 1e9:,.1f} GB/s (measured unless given)"
    )
    for name, model in cands.items():
        rep = match_report(base.config, model.config)
        print(
            f"# {name}: {describe(model.config)}; params {rep['params_mismatch']:+.2%}, "
            f"linear FLOPs/token {rep['flops_linear_mismatch']:+.2%}"
        )
    if args.chunking == "fixed" and not args.checkpoint:
        print("# random init: fixed chunking at the target R (a boundary every R tokens); R below is measured")
    with torch.inference_mode():
        prefill_rows = [] if args.skip_prefill else bench_prefill(base, cands, lengths, args.repeats, device)
        dtype_bytes = torch.empty((), dtype=dtype).element_size()
        decode_rows = (
            [] if args.skip_decode else bench_decode(base, cands, kv_lens, args.batches, args, device, hw, dtype_bytes)
        )
    print_tables(prefill_rows, decode_rows)
    if args.json:
        setup = dict(vars(args), roofline=hw, torch=torch.__version__, threads=torch.get_num_threads())
        with open(args.json, "w") as f:
            json.dump(dict(setup=setup, prefill=prefill_rows, decode=decode_rows), f, indent=1)


if __name__ == "__main__":
    main()
