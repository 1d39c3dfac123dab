"""Does the model read its image? Train a tiny VLM on scene questions in one process and score held-out answers.

    python scripts/probe_seeing.py --types colour --stage 0:1:0.6-0.95 --stage 60:1:0.3-0.6 --steps 120
    python scripts/probe_seeing.py --types colour,shape,position --stage 0:1:0.6-0.95 --stage 150:1:0.3-0.6 \\
        --stage 300:1 --steps 600 --out runs/probe/csp.jsonl

``--stage START:MAX_OBJECTS[:LOW-HIGH][:TYPES]`` is one curriculum stage (from step START on, scenes of
1..MAX_OBJECTS shapes whose side is LOW..HIGH of the canvas's short side; no range: the generator's own sizes;
TYPES, comma-separated: the question types trained in that stage, default all of ``--types``; all are scored).
Prints one JSON line per evaluation (accuracy and chance per question type, eval-mode R per modality) and, with
``--out``, appends them there. ``--types box`` asks cmoe_refloc's box questions (scored on the greedy answer: a
hit at IoU >= 0.5, chance the mean box's hit rate; ``vlm.training.probe_boxes``). ``--copy-steps N`` first trains
the language model alone on N steps of copy rows
(``vlm.training.copy_probe``; printed as ``{"copy": ...}`` lines), what a needle answer needs. ``--scene-input``
``true_words`` gives the image tokens their objects' true words (a perfect word head), ``text`` writes the scene
out in place of its image: the same question on perfect tokens, or as reading comprehension. The rows of
docs/seeing.md come from this command; the logic is ``vlm.training.probe``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from vlm.training.probe import ProbeConfig, SeeingProbe, Stage, parse_overrides


def parse_stage(text: str) -> Stage:
    """``START:MAX_OBJECTS[:LOW-HIGH][:TYPES]``; TYPES (comma-separated) are the question types this stage trains."""
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3, 4):
            raise ValueError
        types = tuple(parts.pop().split(",")) if len(parts) > 2 and parts[-1][:1].isalpha() else None
        if len(parts) > 3:
            raise ValueError
        size = None if len(parts) == 2 else tuple(float(v) for v in parts[2].split("-"))
        if size is not None and len(size) != 2:
            raise ValueError
        return Stage(int(parts[0]), int(parts[1]), size, types)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--stage {text!r}: expected START:MAX_OBJECTS[:LOW-HIGH][:TYPES]") from None


def parse_range(cast, example: str):
    """An argparse type: ``LOW-HIGH`` as a pair of ``cast`` values (a malformed one: a one-line usage error)."""

    def parse(text: str) -> tuple:
        low, _, high = text.partition("-")
        try:
            return cast(low), cast(high)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected LOW-HIGH, e.g. {example}") from None

    return parse


def main(argv=None) -> int:
    defaults = ProbeConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default=defaults.preset, help="tiny-moe (no chunking) or tiny (ConceptMoE)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=JSON", help="a model override")
    parser.add_argument("--types", default="colour", help="question types: colour,shape,position,count,box,needle")
    parser.add_argument("--stage", action="append", type=parse_stage, help="a curriculum stage (repeatable)")
    ints = ("steps", "rows", "seq_len", "warmup", "max_patches", "eval_every", "eval_n", "eval_objects", "seed")
    ints += ("copy_steps",)  # copy rows for the language model alone first (content-addressed copying, needles)
    for name in (*ints, "eval_min_objects"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--caption-share", type=float, default=0.0, help="share of captioned scenes in training")
    parser.add_argument(
        "--eval-size",
        type=parse_range(float, "0.12-0.42"),
        help="held-out shapes' side LOW-HIGH (default: generator's)",
    )
    parser.add_argument(
        "--needle-units",
        type=parse_range(int, "1-3"),
        default=defaults.needle_units,
        help="needle type: haystack units LOW-HIGH (default 1-3)",
    )
    parser.add_argument("--needle-modalities", default="text", help="needle type: text, image or text,image")
    parser.add_argument("--needle-answer", default=defaults.needle_answer, help="needle type: 'value' or 'sentence'")
    parser.add_argument(
        "--turns", default=defaults.turns, help="training: 'one' question per conversation, or 'all' of a scene's"
    )
    parser.add_argument(
        "--scene-input",
        default=defaults.scene_input,
        help="what a scene question shows: 'image', 'true_words' (the image, its tokens' words the ground truth; "
        "needs --set vision_words=true) or 'text' (its objects written out in place of the image)",
    )
    parser.add_argument("--out", type=Path, help="append the JSON lines to this file")
    args = parser.parse_args(argv)
    try:
        overrides = parse_overrides(args.set)
    except ValueError as err:
        parser.error(str(err))
    stages = args.stage or [Stage()]
    if stages[0].start != 0:
        parser.error("the first --stage must start at step 0")
    cfg = ProbeConfig(
        preset=args.preset,
        overrides=overrides,
        types=tuple(t.strip() for t in args.types.split(",") if t.strip()),
        stages=stages,
        **{k: getattr(args, k) for k in ("steps", "rows", "seq_len", "warmup", "max_patches", "lr", "seed")},
        copy_steps=args.copy_steps,
        caption_share=args.caption_share,
        turns=args.turns,
        scene_input=args.scene_input,
        needle_units=args.needle_units,
        needle_modalities=tuple(m.strip() for m in args.needle_modalities.split(",") if m.strip()),
        needle_answer=args.needle_answer,
        **{k: getattr(args, k) for k in ("eval_every", "eval_n", "eval_objects", "eval_min_objects", "eval_size")},
    )
    try:
        probe = SeeingProbe(cfg)
    except ValueError as err:
        parser.error(str(err))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)

    def report(score) -> None:
        line = json.dumps({"config": asdict(cfg), **asdict(score)} if args.out else asdict(score))
        print(json.dumps(asdict(score)), flush=True)
        if args.out:
            with args.out.open("a") as f:
                f.write(line + "\n")

    try:
        probe.pretrain_copying(lambda score: print(json.dumps({"copy": asdict(score)}), flush=True))
        probe.run(report)
    except ValueError as err:  # e.g. rows too short for the conversations: one line, not a traceback
        parser.error(str(err))
    return 0


if __name__ == "__main__":
    sys.exit(main())
