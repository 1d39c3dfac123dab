"""Shared fixtures: a small real HF fast tokenizer (BPE trained here, offline) and synthetic captioned images."""

import random

import pytest
from PIL import Image, ImageDraw
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}
SHAPES = ("square", "circle")
SIZES = ((64, 64), (96, 48), (48, 96), (80, 64))


def captioned_image(rng: random.Random) -> tuple[Image.Image, str]:
    """A shape of some colour on the left or right of a canvas of some size, and its caption."""
    colour, shape, (w, h) = rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.choice(SIZES)
    side = rng.choice(("left", "right"))
    img = Image.new("RGB", (w, h), (255, 255, 255))
    x0 = 4 if side == "left" else w // 2 + 4
    box = (x0, h // 4, x0 + w // 2 - 8, 3 * h // 4)
    draw = ImageDraw.Draw(img)
    (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=COLOURS[colour])
    return img, f"a {colour} {shape} on the {side}."


@pytest.fixture(scope="session")
def hf_tokenizer():
    rng = random.Random(0)
    texts = [captioned_image(rng)[1] for _ in range(200)] + ["What colour is the square? Where is the circle?"] * 5
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<pad>", "<eos>", "<unk>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
