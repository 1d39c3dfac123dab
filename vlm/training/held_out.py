"""Held-out loss of saved exports on any shards: which stage of a recipe learned, or forgot, what.

A staged recipe exports an HF folder after every stage (``stage0_text/hf``, ``stage1_colour/hf``, ...), and each
stage's own ``metrics.jsonl`` scores it on that stage's eval split only. Whether a later stage kept what an earlier
one taught (the text stage's copying, say) needs the later exports scored on the earlier stage's data.
:func:`held_out_loss` does that for one export: the shards are read by the training loader itself
(``vlm.training.loop.make_loader``: the same encoding, chat template, loss mask, packing and image budget, no
shuffling, so every export sees the same batches) and scored by the training loop's own ``evaluate``
(``vlm.training.step``): loss in nats per predicted token, bits per token, and eval-mode R total / text / image.

    python scripts/eval_shards.py runs/x/stage0_text/hf runs/x/stage1_colour/hf --shards data/demo/copying/eval

(``docs/seeing.md``, "Copying and binding in one recipe": the copy the text stage learned, at loss 1.2, is at 9.7
after stage 1a's 40 steps.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from vlm import ConceptMoEVLM, VLMProcessor
from vlm.training.loop import make_loader
from vlm.training.step import evaluate


@dataclass
class HeldOut:
    """One export on one set of shards."""

    pretrained: str
    loss: float  # nats per predicted (loss-masked) token
    bits_per_token: float
    tokens: int  # predicted tokens scored
    r: float | None  # eval-mode R over the scored rows: total, text, image (None: no token of that modality)
    r_text: float | None
    r_image: float | None

    def as_dict(self) -> dict:
        return asdict(self)


def held_out_loss(
    pretrained: str | Path,
    shards: list[str],
    seq_len: int,
    batch_size: int,
    batches: int = 8,
    max_patches: int | None = None,
    seed: int = 0,
) -> HeldOut:
    """Score the export in ``pretrained`` on the first ``batches`` batches of ``shards`` (rows of ``seq_len``;
    images at ``max_patches``, default the export's own budget)."""
    folder = Path(pretrained)
    if not (folder / "config.json").is_file():
        raise ValueError(f"held_out_loss: {folder} holds no saved model (config.json)")
    if batches < 1 or batch_size < 1 or seq_len < 2:
        raise ValueError(
            f"held_out_loss: need batches, batch_size >= 1 and seq_len >= 2, got {batches}, {batch_size}, {seq_len}"
        )
    model = ConceptMoEVLM.from_pretrained(str(folder)).eval()
    processor = VLMProcessor.from_pretrained(str(folder))
    budget = max_patches or processor.image_processor.max_patches
    data = {"shards": list(shards), "seq_len": seq_len, "batch_size": batch_size, "num_workers": 0}
    config = {"data": {**data, "max_patches": budget, "loss_on": "auto"}, "train": {"seed": seed}}
    loader = make_loader(config, processor, list(shards), rank=0, world_size=1, shuffle=False)
    with torch.no_grad():
        out = evaluate(model, iter(loader), batches)
    if not out["eval_tokens"]:
        raise ValueError(f"held_out_loss: no scored token in the first {batches} batches of {list(shards)}")
    return HeldOut(
        pretrained=str(folder),
        loss=out["eval_loss"],
        bits_per_token=out["eval_bits_per_token"],
        tokens=out["eval_tokens"],
        r=out["eval_r"],
        r_text=out["eval_r_text"],
        r_image=out["eval_r_image"],
    )


def markdown(rows: list[HeldOut]) -> str:
    """The rows as a markdown table."""

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    lines = ["| export | loss | bits / token | tokens | eval R total / text / image |", "|---|---|---|---|---|"]
    for h in rows:
        lines.append(
            f"| `{h.pretrained}` | {h.loss:.3f} | {h.bits_per_token:.3f} | {h.tokens} "
            f"| {fmt(h.r)} / {fmt(h.r_text)} / {fmt(h.r_image)} |"
        )
    return "\n".join(lines) + "\n"
