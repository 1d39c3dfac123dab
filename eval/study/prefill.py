"""Prefill time of one fixed long text prompt, each arm's export against the baseline's, in one process.

    python -m eval.study.prefill --out OUT/prefill.json --baseline moe=RUN/train/hf --arm r2=RUN/train/hf ...

The prompt: the documents of the local text corpus's eval side (``data_pipelines.local_text``, the standard
library's docstrings) joined and tokenized with the baseline export's tokenizer, cut to ``--tokens`` (4096): the
same token ids for every arm (all arms share the tokenizer; a different vocabulary is refused). Each model runs in
eval mode, without gradients, on one thread: one forward of batch 1 with ``use_cache=True`` and the logits of the
last position only (what a generation's prefill does; ``scripts/bench_inference.py`` times it the same way).
Per arm: one warm-up call of the baseline and of the arm, then ``--repeats`` rounds of (baseline, arm), so that
drift on a shared machine hits both alike; the ratio is the arm's median over the baseline's median of the same
rounds. Also recorded: the eval-mode R on the prompt (``chunk_stats["r"]``) and the token count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def _pair(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=EXPORT_DIR, got {text!r}")
    return name, path


def prompt_ids(export: str, n_tokens: int):
    """[1, n_tokens] token ids of the fixed prompt (see the module docstring)."""
    import torch

    from data_pipelines.local_text import load_local_text_corpus
    from data_pipelines.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(export)
    text = "\n\n".join(load_local_text_corpus()["eval"])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    while len(ids) < n_tokens:  # a corpus shorter than the prompt: repeated
        ids = ids + ids
    return torch.tensor([ids[:n_tokens]]), len(tokenizer)


def _timed(model, ids) -> tuple[float, dict]:
    import torch

    mask = torch.ones_like(ids)
    with torch.no_grad():
        start = time.perf_counter()
        out = model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - start, out.chunk_stats or {}


def measure(baseline: tuple[str, str], arms: list[tuple[str, str]], n_tokens: int, repeats: int) -> dict:
    """Prefill ms and ratio to the baseline per arm (see the module docstring)."""
    import torch

    from vlm.model import ConceptMoEVLM

    torch.set_num_threads(1)
    ids, vocab = prompt_ids(baseline[1], n_tokens)
    models = {}
    for name, path in [baseline, *arms]:
        model = ConceptMoEVLM.from_pretrained(path).eval()
        if model.config.text_config.vocab_size < vocab:
            raise SystemExit(f"prefill: {name} ({path}) has a smaller vocabulary than the baseline's tokenizer")
        models[name] = model
    base_name = baseline[0]
    out = {
        "tokens": int(ids.shape[1]),
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "baseline": base_name,
        "exports": dict([baseline, *arms]),
        "arms": {},
    }
    for name, _ in [baseline, *arms]:
        base_t, arm_t, stats = [], [], {}
        _timed(models[base_name], ids)
        _timed(models[name], ids)
        for _ in range(repeats):
            base_t.append(_timed(models[base_name], ids)[0])
            t, stats = _timed(models[name], ids)
            arm_t.append(t)
        base_ms, arm_ms = 1e3 * statistics.median(base_t), 1e3 * statistics.median(arm_t)
        out["arms"][name] = {
            "ms": arm_ms,
            "baseline_ms": base_ms,
            "ratio": arm_ms / base_ms,
            "eval_r": stats.get("r"),
            "tokens": stats.get("tokens"),
        }
        print(
            f"prefill {name}: {arm_ms:.0f} ms vs {base_name} {base_ms:.0f} ms (x{arm_ms / base_ms:.3f}), "
            f"R {stats.get('r', 1.0):.2f}",
            flush=True,
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--baseline", required=True, type=_pair, metavar="NAME=EXPORT_DIR")
    parser.add_argument("--arm", action="append", default=[], type=_pair, metavar="NAME=EXPORT_DIR")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    result = measure(args.baseline, args.arm, args.tokens, args.repeats)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{args.out}.tmp{os.getpid()}"
    Path(tmp).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
