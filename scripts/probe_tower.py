"""What does a vision tower carry? Linear probes of colour, shape and position of one small object.

    python scripts/probe_tower.py runs/demo/tower/tower.safetensors [--train 2000] [--test 500] [--json out.json]

The tower's architecture is read from the ``.json`` record ``scripts/pretrain_vision.py`` writes beside its weights
(``--set FIELD=JSON`` overrides it, e.g. for a file without one). Prints one line per feature set (the summary pool,
and the mean / max of the patch features) with held-out accuracy and chance per attribute (``eval/tower_probe.py``).
``--binding`` adds ``colour_of_shape``: the colour of a named shape among 2-3 objects, next to what a reader of the
scene's colours that cannot tell which object wears which gets (``unbound``). ``--objects`` adds each object's
colour and shape among 2-3 objects from its own patches (``object``) and from the one image token at its centre
(``token``): what a question about one object can read. ``--words`` asks the tower's word head (a tower trained with
``--region-labels`` or ``--patch-labels``) object by object among 2-3 objects: the share of objects whose own colour /
shape some patch in their box names, and of those on which another object's is named (``probe_word_head``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from data_pipelines.synthetic.scenes import COLOURS, SHAPES
from data_pipelines.tokenizer import load_tokenizer
from eval.tower_probe import load_tower, probe_binding, probe_objects, probe_tower, probe_word_head, scores_json
from vlm.training.vision_pretraining import TOWER_FIELDS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("weights", help="a tower's .safetensors (scripts/pretrain_vision.py --out)")
    p.add_argument("--preset", default="tiny", help="the VLM preset the tower's unrecorded fields come from")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=JSON", help="a tower field (repeatable)")
    p.add_argument("--train", type=int, default=2000, help="scenes the probes are fitted on")
    p.add_argument("--test", type=int, default=500, help="held-out scenes they are scored on")
    p.add_argument("--seed", type=int, default=0, help="scene seed (train: seed, test: seed + 1)")
    p.add_argument("--max-patches", type=int, default=64, help="the image budget the VLM reads the tower at")
    p.add_argument("--binding", action="store_true", help="also probe colour_of_shape among 2-3 objects")
    p.add_argument("--objects", action="store_true", help="also probe each object's colour and shape, per token")
    p.add_argument("--words", action="store_true", help="also ask the word head, object by object (2-3 objects)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--json", help="also write the scores here")
    args = p.parse_args(argv)
    overrides = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or name not in TOWER_FIELDS:
            p.error(f"--set {item!r}: expected FIELD=JSON with FIELD one of {', '.join(TOWER_FIELDS)}")
        overrides[name] = json.loads(value)
    if args.train < 2 or args.test < 1:
        p.error("--train must be >= 2 and --test >= 1")
    if not Path(args.weights).is_file():
        print(f"probe_tower: no such file {args.weights!r}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    try:
        if args.words:  # the head's size is read from the file
            overrides.update(vision_words=True, vision_weights=str(args.weights))
        tower = load_tower(args.weights, args.preset, **overrides)
    except (ValueError, RuntimeError) as err:
        print(f"probe_tower: {args.weights}: {err}", file=sys.stderr)
        return 2
    scores = probe_tower(tower, args.train, args.test, args.seed, args.max_patches)
    if args.binding:
        scores += probe_binding(tower, seed=args.seed + 10, max_patches=args.max_patches)
    if args.objects:
        scores += probe_objects(tower, seed=args.seed + 10, max_patches=args.max_patches)
    for features in dict.fromkeys(s.features for s in scores):
        row = [
            f"{s.attribute} {s.accuracy:.3f} (chance {s.chance:.3f}"
            + ("" if s.unbound is None else f", unbound {s.unbound:.3f}")
            + ")"
            for s in scores
            if s.features == features
        ]
        print(f"{features}: " + ", ".join(row))
    heads = []
    if args.words:
        tokenizer = load_tokenizer()
        word_ids = {w: tokenizer(" " + w)["input_ids"] for w in (*COLOURS, *SHAPES)}
        heads = probe_word_head(tower, word_ids, seed=args.seed + 10, max_patches=args.max_patches)
        print(
            "word head: "
            + ", ".join(f"{h.attribute} named {h.named:.3f} (another object's {h.foreign:.3f})" for h in heads)
            + f" on {heads[0].objects} objects"
        )
    print(f"probe_tower: {args.train} + {args.test} scenes, {time.time() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(scores_json([*scores, *heads]), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
