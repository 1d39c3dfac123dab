"""Shared fixtures: a small real HF fast tokenizer (byte-level BPE trained here, offline)."""

import random

import pytest

from data_pipelines.bpe import train_bpe_tokenizer
from data_pipelines.synthetic_images import captioned_image


@pytest.fixture(scope="session")
def hf_tokenizer():
    rng = random.Random(0)
    texts = [captioned_image(rng)[1] for _ in range(200)] + ["What colour is the square? Where is the circle?"] * 5
    return train_bpe_tokenizer(texts, vocab_size=320)
