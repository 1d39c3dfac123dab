"""Export a checkpoint to one HF folder: ``ConceptMoEVLM.save_pretrained`` + ``VLMProcessor.save_pretrained``
(``config.json``, ``generation_config.json``, ``model.safetensors``, the tokenizer's files, ``processor_config.json``,
``chat_template.jinja``), the model's own code (``vlm.hub_code``) and a model card (``README.md``,
``vlm.model_card``: architecture, ConceptMoE settings, what the run trained on, R per modality). It loads with
``AutoProcessor`` / ``AutoModelForImageTextToText`` or ``pipeline("image-text-to-text", model=DIR)``, anywhere with
``trust_remote_code=True``, and without it after ``import vlm``.

Works for every ZeRO stage: the full fp32 weights are gathered from the checkpoint files
(``deepspeed.utils.zero_to_fp32``), in one process, no launcher needed.

    python -m vlm.training.export RUN_DIR [--tag step_00000100] --out DIR
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from data_pipelines.jsonl import read_json_lines
from vlm.model_card import write_card
from vlm.training import checkpoint
from vlm.training.build import build_model
from vlm.training.checkpoint import CheckpointError
from vlm.training.config import ConfigError, load_config
from vlm.training.expert_parallel import gather_expert_shards, saved_expert_parallel
from vlm.training.manifest import verify
from vlm.training.resume import newest_verified
from vlm.training.safe_load import UnsafeCheckpointError, weights_only_loading

log = logging.getLogger(__name__)


def full_state_dict(root: str, tag: str) -> dict:
    """fp32 weights of a checkpoint: gathered from the ZeRO partitions, or the plain module state without ZeRO;
    every file is read with the restricted unpickler (``vlm.training.safe_load``)."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    plain = os.path.join(root, tag, "mp_rank_00_model_states.pt")  # stage 0-2 (stage 3 writes zero_pp_rank_*)
    with weights_only_loading():
        if os.path.isfile(plain):
            states = torch.load(plain, map_location="cpu")
            if states.get("param_shapes") is None or saved_expert_parallel(os.path.join(root, tag)) > 1:
                # stage 0, or experts split over ranks (the ZeRO files partition them by expert group, which
                # zero_to_fp32 does not read): the module's own weights, every rank's experts gathered
                return gather_expert_shards(states["module"], os.path.join(root, tag))
        return get_fp32_state_dict_from_zero_checkpoint(root, tag=tag)


R_KEYS = (("total", ""), ("text", "_text"), ("image", "_image"))  # a metrics record's R keys, by modality


def training_summary(run_dir: str, config: dict, tag: str) -> dict:
    """What the run did, for the model card: its data and schedule (``config``), the step of ``tag``, and the last
    training and held-out R per modality and held-out loss logged up to that step (``metrics.jsonl``)."""
    data, train = config["data"], config["train"]
    step = int(tag.rsplit("_", 1)[-1]) if tag.rsplit("_", 1)[-1].isdigit() else None
    summary = {
        "init_from": config["model"].get("init_from"),
        "steps": step,
        "shards": list(data["shards"]) if isinstance(data["shards"], list) else [data["shards"]],
        "eval_shards": data["eval_shards"] if isinstance(data["eval_shards"], list) else [],
        "seq_len": data["seq_len"],
        "lr": train["lr"],
        "loss_on": data["loss_on"],
    }
    ds_config = os.path.join(run_dir, "ds_config.json")
    if os.path.isfile(ds_config):
        with open(ds_config) as f:
            summary["rows_per_step"] = json.load(f).get("train_batch_size")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(metrics):
        bad = lambda lineno, why: log.warning("%s:%d: skipped malformed line (%s)", metrics, lineno, why)
        with open(metrics, encoding="utf-8", errors="replace") as f:
            for _, row in read_json_lines(f, bad):  # a line cut by a crash is skipped
                if step is not None and row.get("step", 0) > step:
                    continue
                if row.get("split") == "eval":
                    summary["eval_r"] = {k: row.get(f"eval_r{s}") for k, s in R_KEYS}
                    summary["eval_loss"] = row.get("eval_loss")
                elif "r" in row:
                    summary["train_r"] = {k: row.get(f"r{s}") for k, s in R_KEYS}
    return summary


def export_checkpoint(run_dir: str, out_dir: str, tag: str | None = None) -> str:
    """Writes the model and processor of ``run_dir``'s checkpoint ``tag`` (default: the newest that verifies) to
    ``out_dir``; raises ``CheckpointError`` (one line) when that checkpoint does not verify."""
    root = checkpoint.checkpoint_dir(run_dir)
    if tag is None:  # the newest that verifies
        tag, skipped = newest_verified(root, world_size=None)
        if tag is None:
            reasons = "".join(f"; {t}: {p}" for t, p in skipped.items())
            raise CheckpointError(f"{root}: no complete checkpoint to export{reasons}")
    elif (problem := verify(os.path.join(root, tag))) is not None:
        raise CheckpointError(f"checkpoint {os.path.join(root, tag)}: {problem}")
    # the run's config, checked as training checked it (the same load_config)
    config = load_config(os.path.join(run_dir, "config.yaml"))
    model, processor = build_model(config)
    state = full_state_dict(root, tag)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in getattr(model, "_tied_weights_keys", None) or {}]
    if unexpected or [k for k in missing if not k.endswith("lm_head.weight")]:
        raise RuntimeError(
            f"checkpoint {tag} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    # as HF's VLMs: config.json / generation_config.json carry the tokenizer's ids, so generate() stops at <|end|>
    model.set_special_token_ids(**processor.special_token_ids)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    n_params = sum(p.numel() for p in model.parameters())
    name = f"ConceptMoE-VLM `{config['model']['preset']}`, {os.path.normpath(run_dir)} at {tag}"
    write_card(out_dir, model.config, n_params, name, training_summary(run_dir, config, tag))
    log.info("exported %s/%s to %s", root, tag, out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the newest one that verifies)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(export_checkpoint(args.run_dir, args.out, args.tag))
    except (CheckpointError, ConfigError, UnsafeCheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
