"""Text-only perplexity / bits per token / bits per byte of a checkpoint on the held-out local text corpus.

The corpus is the ``eval`` side of :func:`data_pipelines.local_text.load_local_text_corpus` (standard-library
docstrings, never seen by training, which reads the ``train`` side). Each document is ``[EOS] + tokens``, cut into
disjoint windows of ``seq_len`` predicted tokens (the context restarts at each window), so every token is predicted
exactly once. Also reports the compression ratio R of those forwards (text only).

    from eval.ppl import evaluate_ppl
    evaluate_ppl("runs/demo/hf", seq_len=1024)   # {"bits_per_token": ..., "bits_per_byte": ..., "ppl": ..., "r": ...}
"""

from __future__ import annotations

import math

import torch
from tqdm import tqdm

from eval.lmms_generation import capture_boundaries, row_stats


def windows(ids: list[int], start_id: int, seq_len: int) -> list[list[int]]:
    """``[start_id] + ids`` cut into overlapping-by-one windows: window k predicts tokens k*seq_len .. of ``ids``."""
    seq = [start_id, *ids]
    return [seq[k : k + seq_len + 1] for k in range(0, len(ids), seq_len)]


@torch.no_grad()
def score_windows(model, rows: list[list[int]], pad_id: int, device) -> tuple[float, int, int, int]:
    """(sum NLL in nats, predicted tokens, tokens, concepts) of one batch of windows (right-padded)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    ids, mask = ids.to(device), mask.to(device)
    modality = torch.zeros_like(ids)
    with capture_boundaries(model) as seen:
        logits = model(input_ids=ids, attention_mask=mask, modality_ids=modality).logits.float()
    logprobs = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    keep = mask[:, 1:].bool()
    stats = row_stats(seen[0] if seen else None, mask, modality)
    return (
        float(-(logprobs * keep).sum()),
        int(keep.sum()),
        sum(s["tokens"] for s in stats),
        sum(s["concepts"] for s in stats),
    )


def evaluate_ppl(
    pretrained: str,
    seq_len: int = 1024,
    batch_size: int = 4,
    max_docs: int | None = None,
    device: str = "cpu",
    texts: list[str] | None = None,
    show_progress: bool = False,
) -> dict:
    """Bits per token / byte and perplexity of the checkpoint folder ``pretrained`` (model + processor);
    ``show_progress``: a tqdm bar of the batches on stderr when it is a terminal."""
    from data_pipelines.local_text import load_local_text_corpus
    from vlm import ConceptMoEVLM, VLMProcessor

    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
    processor = VLMProcessor.from_pretrained(pretrained)
    model = ConceptMoEVLM.from_pretrained(pretrained).to(device).eval()
    tok = processor.tokenizer
    texts = list(load_local_text_corpus()["eval"] if texts is None else texts)[:max_docs]
    if not texts:
        raise ValueError("no text to evaluate")
    start_id = tok.eos_token_id if tok.eos_token_id is not None else processor.pad_token_id
    rows = []
    for text in texts:
        rows += windows(tok(text, add_special_tokens=False)["input_ids"], start_id, seq_len)
    nll = predicted = tokens = concepts = 0
    starts = range(0, len(rows), batch_size)
    for b in tqdm(starts, desc="ppl", unit=" batches", disable=None if show_progress else True):
        n, p, t, c = score_windows(model, rows[b : b + batch_size], processor.pad_token_id, device)
        nll, predicted, tokens, concepts = nll + n, predicted + p, tokens + t, concepts + c
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    return {
        "pretrained": str(pretrained),
        "docs": len(texts),
        "windows": len(rows),
        "seq_len": seq_len,
        "predicted_tokens": predicted,
        "bytes": n_bytes,
        "nll_per_token": nll / predicted,
        "bits_per_token": nll / predicted / math.log(2),
        "bits_per_byte": nll / n_bytes / math.log(2),
        "ppl": math.exp(nll / predicted),
        "r": tokens / max(concepts, 1),
    }
