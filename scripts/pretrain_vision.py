"""Pretrain the vision tower contrastively (SigLIP's sigmoid loss) on image-caption shards; write its weights.

    python scripts/make_shards.py --synthetic scenes --option max_objects=1 --out data/vision --num-samples 8000
    python scripts/pretrain_vision.py --shards data/vision/train --eval-shards data/vision/eval \\
        --preset tiny --max-patches 64 --steps 600 --out runs/vision/tower.safetensors

Any webdataset shards whose samples hold an image and text work (this toolkit's caption samples, img2dataset's
image + caption pairs). The tower is the VLM preset's (``--preset``; ``--set FIELD=JSON`` for ``vision_embed_dim``,
``vision_depth``, ``vision_heads``, ``vision_model``, ``patch_size``, ``vision_pos_embed``) and sees images exactly
as the VLM's processor cuts them (``--max-patches``, ``--pixel-shuffle``). The output is the tower's timm state dict
(``.safetensors``) with a ``.json`` record beside it (settings, skips, held-out loss and retrieval); train the VLM
from it with ``--set model.overrides.vision_weights=PATH`` or the run YAML's ``model.overrides``. With
``--region-labels`` or ``--patch-labels`` the file also holds the tower's patch word detectors (``word_head.*``),
which ``vision_words: true`` turns into word embeddings on every image token. An existing
``--out`` is refused before training unless ``--overwrite``; the file is written whole or not at all. The logic is
``vlm.training.vision_pretraining``; docs/seeing.md measures what it buys.

On several CPU cores, run one single-threaded process per core (data parallel, the same batches as one process):

    torchrun --standalone --nproc_per_node 2 scripts/pretrain_vision.py --threads 1 ...
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from vlm.training.vision_pretraining import OBJECTIVES, TOWER_FIELDS, VisionPretrainConfig, pretrain_vision


def main(argv=None) -> int:
    d = VisionPretrainConfig(shards=[], out="")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", nargs="+", required=True, help="image-caption shards (files, globs, folders)")
    p.add_argument("--eval-shards", nargs="+", default=[], help="held-out shards: loss and retrieval accuracy")
    p.add_argument("--out", required=True, help="the tower's weights, a .safetensors path")
    p.add_argument("--preset", default=d.preset, help="the VLM preset whose tower is trained (tiny, small)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=JSON", help="a tower field (repeatable)")
    for name in ("max_patches", "pixel_shuffle", "steps", "batch_size", "warmup", "eval_every", "log_every", "seed"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    p.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default=d.objective,
        help="siglip: sigmoid contrastive loss against a caption encoder; superclass: the caption's words as the "
        "image's class labels, softmax (no text encoder); multilabel: the same labels, one sigmoid per word",
    )
    labels = (  # extra labels beside the caption's words: (field, type, metavar, help)
        (
            "label_pairs",
            int,
            "WINDOW",
            "multilabel: pairs of caption words up to WINDOW informative tokens apart are labels too (binding)",
        ),
        (
            "patch_labels",
            float,
            "WEIGHT",
            "superclass / multilabel: word detectors on every patch (noisy-OR over the patches), this weight",
        ),
        (
            "region_labels",
            float,
            "WEIGHT",
            "superclass / multilabel: each patch inside a boxed region (meta regions, "
            "or the scenes' objects) learns that region's words, this weight",
        ),
    )
    for name, kind, metavar, help_text in labels:
        p.add_argument(
            f"--{name.replace('_', '-')}", type=kind, default=getattr(d, name), metavar=metavar, help=help_text
        )
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    args = p.parse_args(argv)
    tower = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or name not in TOWER_FIELDS:
            p.error(f"--set {item!r}: expected FIELD=JSON with FIELD one of {', '.join(TOWER_FIELDS)}")
        try:
            tower[name] = json.loads(value)
        except json.JSONDecodeError:
            tower[name] = value  # a bare string: a model name
    if args.threads:
        torch.set_num_threads(args.threads)
    fields = {k: v for k, v in vars(args).items() if k not in ("set", "threads")}
    cfg = VisionPretrainConfig(**fields, tower=tower)
    try:
        cfg.check()
    except ValueError as err:
        p.error(str(err))
    try:
        pretrain_vision(cfg, log=lambda line: print(line, flush=True))
    except (ValueError, FileNotFoundError) as err:
        print(f"pretrain_vision: {err}", file=sys.stderr)
        return 2
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
