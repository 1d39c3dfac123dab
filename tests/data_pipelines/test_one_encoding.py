"""Training and inference encode a conversation the same way.

Training: conversations written to webdataset shards (``writer.write_shards``) and read back through the training
loader (``loader.make_dataloader``: decode -> ``packing.encode_conversation`` -> pack -> collate). Inference: the
same turns as HF chat messages, rendered with ``VLMProcessor.apply_chat_template`` and tokenised with the images by
``VLMProcessor.__call__``. Both must give the same ids, modality ids, image slots and patches, up to what the
training document adds around the conversation (``TokenEncoder.closing``: eos).
"""

import io
import random

import pytest
import torch
from PIL import Image

from data_pipelines.chat import render
from data_pipelines.loader import make_dataloader
from data_pipelines.packing import TokenEncoder, encode_sample_tokens
from data_pipelines.schema import Modality, Sample, Segment, Turn, image_bytes
from data_pipelines.synthetic import generate
from data_pipelines.synthetic_images import captioned_image
from data_pipelines.tokenizer import load_tokenizer
from data_pipelines.writer import write_shards
from vision_tower import ImageProcessor
from vlm.processor import VLMProcessor

KINDS = {"scenes_chat": 8, "documents_chat": 6, "needles_chat": 6}  # conversations drawn per synthetic kind
SEQ_LEN = 8192  # rows wide enough that no conversation is too_long (the test checks nothing was skipped)


def picture(rng: random.Random, ext: str = "png", mode: str = "RGB") -> Segment:
    img, _ = captioned_image(rng)
    return Segment(image=image_bytes(img.convert(mode), ext), image_ext=ext)


def hand_made() -> list[Sample]:
    """Several turns, a system turn, images in later turns, mid-text, last in a turn, JPEG, RGBA and grey pictures,
    a text split over two segments."""
    rng = random.Random(7)
    return [
        Sample(
            "hand-0",
            [],
            turns=[
                Turn("system", [Segment(text="You are terse. Answer in one word.")]),
                Turn("user", [picture(rng), Segment(text="\nWhat colour is the shape?")]),
                Turn("assistant", [Segment(text="red")]),
                Turn("user", [Segment(text="And this one? "), picture(rng, "jpg")]),
                Turn("assistant", [Segment(text="It is blue.")]),
            ],
        ),
        Sample(
            "hand-1",
            [],
            turns=[
                Turn("system", [Segment(text="Describe pictures.\nBe exact — units in cm, ümlauts kept.")]),
                Turn("user", [Segment(text="Hello!")]),
                Turn("assistant", [Segment(text="Hi. Send a picture.")]),
                Turn(
                    "user",
                    [
                        Segment(text="Left: "),
                        picture(rng, mode="RGBA"),
                        Segment(text="\nright: "),
                        picture(rng, "jpg"),
                        Segment(text="\nWhich is larger?"),
                    ],
                ),
                Turn("assistant", [Segment(text="  The left one, by 3 cm.\n")]),
            ],
        ),
        Sample(
            "hand-2",
            [],
            turns=[
                Turn("user", [picture(rng), Segment(text="\n"), picture(rng, mode="L"), Segment(text="\nSame?")]),
                Turn("assistant", [Segment(text="No")]),
                Turn("user", [Segment(text="Hel"), Segment(text="lo again. Why not?")]),  # one text, cut mid-word
                Turn("assistant", [Segment(text="Different shapes: {square, circle}.")]),
            ],
        ),
    ]


def conversations() -> list[Sample]:
    samples = [s for kind, n in KINDS.items() for s in generate(kind, n, seed=3, split="train")]
    return samples + hand_made()


def messages(sample: Sample) -> list[dict]:
    """The turns as HF chat messages: one ``{"type": "image"}`` part per image, text parts as they are."""
    parts = lambda turn: [
        {"type": "image"} if seg.image is not None else {"type": "text", "text": seg.text} for seg in turn.segments
    ]
    return [{"role": turn.role, "content": parts(turn)} for turn in sample.turns]


def image_spans(modality: list[int], num_tokens: list[int]) -> list[tuple[int, int]]:
    """(first slot, slots) of each image, in order; every image's slots must be contiguous."""
    slots = [i for i, m in enumerate(modality) if m == Modality.IMAGE]
    spans, k = [], 0
    for n in num_tokens:
        assert slots[k : k + n] == list(range(slots[k], slots[k] + n)), "an image's slots are not contiguous"
        spans.append((slots[k], n))
        k += n
    assert k == len(slots), "image slots that belong to no image"
    return spans


def loader_documents(batches, images_per_doc: list[int]) -> list[dict]:
    """Each packed document back out of the batches (rows cut at ``doc_ids``), with its images' pixel tensors."""
    docs, counts = [], iter(images_per_doc)
    for batch in batches:
        image = 0
        for r in range(batch["input_ids"].shape[0]):
            n = int(batch["attention_mask"][r].sum())
            doc_ids = batch["doc_ids"][r, :n].tolist()
            for d in sorted(set(doc_ids)):
                where = [i for i, x in enumerate(doc_ids) if x == d]
                k = next(counts)
                pick = slice(image, image + k)
                image += k
                docs.append(
                    {
                        "input_ids": batch["input_ids"][r, where].tolist(),
                        "modality_ids": batch["modality_ids"][r, where].tolist(),
                        **{key: batch[key][pick] for key in ("patches", "patch_coord", "patch_valid", "grid_hw")},
                    }
                )
        assert image == batch["grid_hw"].shape[0]
    return docs


@pytest.fixture(scope="module")
def processor():
    return VLMProcessor(load_tokenizer(), ImageProcessor(patch_size=16, max_patches=64))


def test_loader_and_processor_encode_every_conversation_alike(processor, tmp_path):
    samples = conversations()
    assert len(samples) >= 20 and all(s.is_conversation and s.num_images for s in samples)
    manifest = write_shards(samples, tmp_path, "train", max_count=10)
    shards = [str(tmp_path / "train" / name) for name in manifest["shards"]]
    tok = processor.tokenizer
    loader = make_dataloader(
        shards,
        tok,
        processor.image_processor,
        seq_len=SEQ_LEN,
        batch_size=1,
        epochs=1,
        shuffle=False,
        image_token_id=processor.image_token_id,
    )
    docs = loader_documents(list(loader), [s.num_images for s in samples])
    assert len(docs) == len(samples) and not any(loader.stats()["skipped"].values())

    # What a training document adds around the conversation: the tokenizer's own prefix (VLMProcessor adds it too,
    # add_special_tokens=True), then ``closing()`` = its suffix (the processor adds that too) + eos. The shipped
    # tokenizer has no prefix or suffix, so a training document is exactly the processor's ids + [eos].
    enc = TokenEncoder(tok)
    tail = enc.closing()[len(enc.suffix) :]
    assert (enc.prefix, enc.suffix, tail) == ([], [], [tok.eos_token_id])
    kinds = set()
    for sample, doc in zip(samples, docs):
        text = processor.apply_chat_template(messages(sample))
        assert text == render(sample.turns), sample.key  # the HF messages say what the turns say
        pictures = [Image.open(io.BytesIO(seg.image)) for seg in sample.all_segments if seg.image is not None]
        inputs = processor(text=text, images=[pictures])
        ids, modality = inputs["input_ids"][0].tolist(), inputs["modality_ids"][0].tolist()
        assert doc["input_ids"] == ids + tail, sample.key
        assert doc["modality_ids"] == modality + [Modality.TEXT] * len(tail), sample.key
        num_tokens = inputs["num_tokens"].tolist()
        assert (doc["grid_hw"].prod(-1) // processor.image_processor.pixel_shuffle**2).tolist() == num_tokens
        assert image_spans(doc["modality_ids"], num_tokens) == image_spans(modality, num_tokens), sample.key
        assert torch.equal(doc["grid_hw"], inputs["grid_hw"])
        for i in range(len(pictures)):
            k = int(inputs["patch_valid"][i].sum())
            assert int(doc["patch_valid"][i].sum()) == k > 0
            assert torch.equal(doc["patches"][i, :k], inputs["patches"][i, :k]), (sample.key, i)
            assert torch.equal(doc["patch_coord"][i, :k], inputs["patch_coord"][i, :k]), (sample.key, i)
        # both paths could drop or reorder a turn the same way: the ids, each image's slots as one marker, decode
        # to the rendered conversation itself
        starts = {start for start, _ in image_spans(modality, num_tokens)}
        one_marker = [t for i, t in enumerate(ids) if modality[i] == Modality.TEXT or i in starts]
        assert tok.decode(one_marker) == text, sample.key
        kinds.add(sample.meta.get("kind", "hand-made"))
    assert kinds == {*KINDS, "hand-made"}


def test_encode_sample_tokens_matches_the_processor_image_slots(processor):
    """The in-memory path (no shards): ``EncodedDoc.image_starts`` / ``num_tokens`` are the processor's slots."""
    tok = processor.tokenizer
    for sample in hand_made():
        doc = encode_sample_tokens(sample, tok, processor.image_processor, processor.image_token_id)
        pictures = [Image.open(io.BytesIO(seg.image)) for seg in sample.all_segments if seg.image is not None]
        inputs = processor(text=processor.apply_chat_template(messages(sample)), images=[pictures])
        modality = inputs["modality_ids"][0].tolist()
        assert doc.input_ids == inputs["input_ids"][0].tolist() + [tok.eos_token_id]
        assert list(zip(doc.image_starts, doc.num_tokens)) == image_spans(modality, inputs["num_tokens"].tolist())
