"""How image and text get compressed under one global R: with and without modality boundaries (and per-modality R).

    python scripts/bench_vlm_chunking.py [--steps 150] [--seed 0]

Trains the ``tiny`` VLM (random-init NaFlexViT + ConceptMoE backbone, R = 2) on synthetic captioned shapes
(`data_pipelines.synthetic_images`), once per variant, same seed and data, and prints the held-out LM loss on
caption tokens and R total / text / image, measured in eval mode on the same held-out batches.
"""

from __future__ import annotations

import argparse
import random

import torch

from data_pipelines.bpe import train_bpe_tokenizer
from data_pipelines.synthetic_images import captioned_image
from vision_tower import ImageProcessor
from vlm import ConceptMoEVLM, VLMProcessor
from vlm.training.single_process import TrainConfig, evaluate, train

VARIANTS = {
    "global R=2 (paper)": {},
    "global R=2 + modality boundaries": {"modality_boundaries": True},
    "per-modality R (text 1.5, image 4)": {"target_r_by_modality": {0: 1.5, 1: 4.0}},
}


def caption_batches(processor: VLMProcessor, seed: int, batch_size: int = 8):
    rng = random.Random(seed)
    while True:
        pairs = [captioned_image(rng) for _ in range(batch_size)]
        batch = processor(text=[f"<image> {caption}" for _, caption in pairs], images=[[img] for img, _ in pairs])
        yield {**batch, "labels": batch["input_ids"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    tokenizer = train_bpe_tokenizer([captioned_image(rng)[1] for _ in range(500)], vocab_size=320)
    processor = VLMProcessor(tokenizer, ImageProcessor(max_patches=64))
    print("| variant | held-out caption loss | R | R text | R image |")
    print("|---|---|---|---|---|")
    for name, overrides in VARIANTS.items():
        torch.manual_seed(args.seed)
        model = ConceptMoEVLM.from_preset("tiny", image_token_id=processor.image_token_id, max_patches=64, **overrides)
        train(
            model,
            caption_batches(processor, args.seed),
            TrainConfig(max_steps=args.steps, save_every=args.steps, seed=args.seed, warmup=20),
        )
        res = evaluate(model, caption_batches(processor, seed=args.seed + 1000), n_batches=8)
        print(
            f"| {name} | {res['eval_loss']:.3f} | {res['eval_r']:.2f} | {res['eval_r_text']:.2f} "
            f"| {res['eval_r_image']:.2f} |"
        )


if __name__ == "__main__":
    main()
