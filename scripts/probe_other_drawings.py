"""Does an exported VLM read images it was never trained on? One object drawn by code other than the generator's.

    python scripts/probe_other_drawings.py runs/demo/stage2/hf [--n 100] [--seed 123]

Each picture holds one shape (square, circle, triangle, diamond, star) drawn here with PIL's own primitives, not
with the training generator's masks: other canvas sizes, the named colours shifted by up to +/-20 per channel, other
background colours, a side of 25-60% of the short side. The model is loaded the way any HF user loads it
(``AutoProcessor`` / ``AutoModelForImageTextToText``), the question goes through ``apply_chat_template`` in the
tasks' wording (``data_pipelines.prompts.sceneqa``), and greedy answers are scored by exact match. Prints one JSON
line: accuracy per question (colour, shape), chance (the best constant answer on the same pictures) and the most
common answers.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections import Counter

import torch
from PIL import Image, ImageDraw
from transformers import AutoModelForImageTextToText, AutoProcessor

import vlm  # noqa: F401  (registers the Auto classes)
from data_pipelines.prompts import sceneqa
from data_pipelines.synthetic.scenes import COLOURS, SHAPES
from data_pipelines.tokenizer import IMAGE_TOKEN

CANVASES = ((150, 110), (96, 96), (280, 200), (200, 280), (176, 132), (240, 240))
BACKGROUNDS = ((245, 245, 240), (220, 225, 230), (255, 250, 240), (235, 240, 235))


def draw(rng: random.Random) -> tuple[Image.Image, str, str]:
    """One picture and its (colour, shape)."""
    w, h = rng.choice(CANVASES)
    img = Image.new("RGB", (w, h), rng.choice(BACKGROUNDS))
    pen = ImageDraw.Draw(img)
    colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
    fill = tuple(max(0, min(255, v + rng.randint(-20, 20))) for v in COLOURS[colour])
    s = round(min(w, h) * rng.uniform(0.25, 0.6))
    x0, y0 = rng.randint(0, w - s), rng.randint(0, h - s)
    x1, y1, cx, cy, r = x0 + s - 1, y0 + s - 1, x0 + s / 2, y0 + s / 2, s / 2
    if shape == "square":
        pen.rectangle([x0, y0, x1, y1], fill=fill)
    elif shape == "circle":
        pen.ellipse([x0, y0, x1, y1], fill=fill)
    elif shape == "triangle":
        pen.polygon([(cx, y0), (x1, y1), (x0, y1)], fill=fill)
    elif shape == "diamond":
        pen.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=fill)
    else:  # a five-pointed star: outer and inner radius alternate
        radii = [r if k % 2 == 0 else 0.45 * r for k in range(10)]
        points = [(cx + q * math.sin(k * math.pi / 5), cy - q * math.cos(k * math.pi / 5)) for k, q in enumerate(radii)]
        pen.polygon(points, fill=fill)
    return img, colour, shape


def answer(model, processor, image: Image.Image, question: str) -> str:
    text_after_image = sceneqa(question).removeprefix(IMAGE_TOKEN)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text_after_image}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=prompt, images=[image], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    reply = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    return reply.strip().lower().rstrip(".")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="an exported model folder (save_pretrained: model + processor)")
    p.add_argument("--n", type=int, default=100, help="pictures (each asked its colour and its shape)")
    p.add_argument("--seed", type=int, default=123)
    args = p.parse_args(argv)
    processor = AutoProcessor.from_pretrained(args.model)
    model = AutoModelForImageTextToText.from_pretrained(args.model).eval()
    rng = random.Random(args.seed)
    truths, replies = {"colour": [], "shape": []}, {"colour": [], "shape": []}
    for _ in range(args.n):
        image, colour, shape = draw(rng)
        for qtype, question, truth in (
            ("colour", f"What colour is the {shape}?", colour),
            ("shape", f"What shape is the {colour} object?", shape),
        ):
            truths[qtype].append(truth)
            replies[qtype].append(answer(model, processor, image, question))
    report = {"n": args.n, "accuracy": {}, "chance": {}, "most_common_answers": {}}
    for qtype in truths:
        pairs = list(zip(replies[qtype], truths[qtype]))
        report["accuracy"][qtype] = sum(a == t for a, t in pairs) / args.n
        report["chance"][qtype] = Counter(truths[qtype]).most_common(1)[0][1] / args.n
        report["most_common_answers"][qtype] = Counter(replies[qtype]).most_common(3)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
    sys.exit(0)
