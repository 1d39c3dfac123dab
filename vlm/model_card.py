"""The model card of an export: ``README.md`` in the Hugging Face model-card format (YAML metadata, then Markdown).

``write_card`` renders it from the model's config (architecture, sizes, ConceptMoE settings) and, for a training
export (``vlm.training.export``), what the run did: data, steps, schedule, the last training and held-out R per
modality. Its evaluation section sits between two markers; ``set_scores`` replaces that section with a score table
(``scripts/score_table.py`` does so for the exported folder it scored), so the card always shows the latest scores
with their chance levels and eval-mode R.
"""

from __future__ import annotations

from pathlib import Path

from vlm.accounting.flops import count

CARD = "README.md"
SCORES_START = "<!-- conceptmoe-vlm:scores:start -->"
SCORES_END = "<!-- conceptmoe-vlm:scores:end -->"
NO_SCORES = "No evaluation has run on this export yet (`scripts/score_table.py` fills this section after lmms-eval)."


def _table(rows: list[tuple[str, object]]) -> str:
    return "| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows if v is not None)


def _ids(ids: list[int] | None, shown: int = 8) -> str | None:
    """Token ids for the card: all of them, or the first few and the count."""
    if not ids:
        return None
    head = ", ".join(str(i) for i in ids[:shown])
    return head if len(ids) <= shown else f"{head}, ... ({len(ids)} ids)"


def _millions(n: int) -> str:
    return f"{n / 1e6:.2f} M"


def architecture(config, n_params: int) -> str:
    """The model's shape and its ConceptMoE settings, as a table."""
    text = config.text_config
    counted = count(text)
    routed = f"{text.num_experts} routed experts, top {text.num_experts_per_tok}" if text.ffn == "moe" else "dense"
    stem = "3 convolutions per patch" if config.vision_stem == "conv" else "linear patch embedding"
    rows = [
        (
            "parameters",
            f"{_millions(n_params)} (backbone {_millions(counted['params_total'])}, "
            f"{_millions(counted['params_active'])} active per token)",
        ),
        (
            "backbone",
            f"d_model {text.d_model}, layers encoder / concept / decoder {text.encoder_layers} / "
            f"{text.concept_layers} / {text.decoder_layers}, {text.n_heads} heads, {routed}, "
            f"vocabulary {text.vocab_size}",
        ),
        ("chunking", text.chunking),
        ("target R (tokens per concept)", text.target_r if text.chunking == "dynamic" else None),
        ("target R by modality", text.target_r_by_modality),
        ("boundary forced on token ids", _ids(text.boundary_token_ids)),
        ("boundary router", f"{text.boundary_router} (init {text.boundary_router_init})"),
        (
            "concept model",
            f"d_model {text.concept_d_model}, {text.concept_num_experts} experts, "
            f"top {text.concept_top_k}, loop x{text.concept_loop}",
        ),
        ("joint decoding layers", text.joint_layers),
        ("image chunking", config.image_chunking),
        (
            "vision tower",
            f"timm `{config.vision_model}`, width {config.vision_embed_dim}, depth "
            f"{config.vision_depth}, {config.vision_heads} heads, {stem}",
        ),
        (
            "image tokens",
            f"{config.patch_size}-px patches, at most {config.max_patches} per image, "
            f"{config.pixel_shuffle}x{config.pixel_shuffle} pixel shuffle",
        ),
    ]
    return _table(rows)


def training_section(training: dict) -> str:
    """What a training run did (``vlm.training.export.training_summary``'s dict)."""
    rows = [
        ("initialised from", training.get("init_from") or "random init"),
        ("steps", training.get("steps")),
        ("training shards", ", ".join(f"`{s}`" for s in training.get("shards", [])) or None),
        ("held-out shards", ", ".join(f"`{s}`" for s in training.get("eval_shards", [])) or None),
        ("rows per step", training.get("rows_per_step")),
        ("sequence length", training.get("seq_len")),
        ("learning rate", training.get("lr")),
        ("loss on", training.get("loss_on")),
    ]
    for name, r in (("last training step", training.get("train_r")), ("last held-out eval", training.get("eval_r"))):
        if r:
            values = " / ".join(_r(r.get(k)) for k in ("total", "text", "image"))
            rows.append((f"R total / text / image, {name}", values))
    if training.get("eval_loss") is not None:
        rows.append(("held-out loss", f"{training['eval_loss']:.4f}"))
    return _table(rows)


def _r(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def render(config, n_params: int, name: str, training: dict | None = None) -> str:
    """The whole card."""
    meta = (
        "---\nlibrary_name: transformers\npipeline_tag: image-text-to-text\n"
        "tags:\n- conceptmoe\n- mixture-of-experts\n- vision-language\n- custom_code\n---\n\n"
    )
    body = (
        f"# {name}\n\nA vision-language model with a ConceptMoE backbone (Huang et al. 2026, arXiv 2601.21420), "
        "trained with ConceptMoE-VLM: tokens (text and image patches alike) are merged into concepts where adjacent "
        "states stop being similar, a Mixture-of-Experts concept model runs on the concepts, and a decoder hands "
        "them back to the tokens. R is tokens per concept.\n\n## Architecture\n\n" + architecture(config, n_params)
    )
    if training:
        body += "\n## Training\n\n" + training_section(training)
    body += f"\n## Evaluation\n\n{SCORES_START}\n{NO_SCORES}\n{SCORES_END}\n"
    body += (
        "\n## How to load\n\nThe folder carries its own code (`auto_map`), so `torch`, `transformers`, `timm` and "
        "`pillow` are all it needs:\n\n```python\nfrom PIL import Image\n"
        "from transformers import AutoModelForImageTextToText, AutoProcessor\n\n"
        'model = AutoModelForImageTextToText.from_pretrained("PATH", trust_remote_code=True)\n'
        'processor = AutoProcessor.from_pretrained("PATH", trust_remote_code=True)\n'
        'messages = [{"role": "user", "content": [{"type": "image", "image": Image.open("scene.png")},\n'
        '                                         {"type": "text", "text": "What colour is the square?"}]}]\n'
        "inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,\n"
        '                                       return_dict=True, return_tensors="pt")\n'
        "answer = model.generate(**inputs, max_new_tokens=16)[0, inputs['input_ids'].shape[1]:]\n"
        "print(processor.decode(answer, skip_special_tokens=True))\n```\n"
    )
    return meta + body


def write_card(folder: str | Path, config, n_params: int, name: str, training: dict | None = None) -> Path:
    """Writes ``folder/README.md`` titled ``name``."""
    path = Path(folder) / CARD
    path.write_text(render(config, n_params, name, training))
    return path


def set_scores(folder: str | Path, markdown: str) -> bool:
    """Replaces the evaluation section of ``folder``'s card with ``markdown``; False when the folder has no card
    written by this toolkit (nothing is written then)."""
    path = Path(folder) / CARD
    if not path.is_file():
        return False
    text = path.read_text()
    start, end = text.find(SCORES_START), text.find(SCORES_END)
    if start < 0 or end < start:
        return False
    path.write_text(text[: start + len(SCORES_START)] + "\n" + markdown.strip() + "\n" + text[end:])
    return True
