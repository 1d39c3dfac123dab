import random

import pytest
import torch
from PIL import Image
from shard_kit import with_image_token
from tokenizers import processors

from data_pipelines.bpe import train_bpe_tokenizer
from data_pipelines.packing import IGNORE, EncodedDoc, Packer, TokenEncoder, collate_rows, encode_sample_tokens
from data_pipelines.schema import Sample, Segment, SkipSample, image_bytes
from vision_tower import ImageProcessor

PROC = ImageProcessor(patch_size=8, max_patches=64)  # an image is 1..16 slots


@pytest.fixture(scope="module")
def tok(hf_tokenizer):
    return with_image_token(hf_tokenizer)


def random_doc(rng: random.Random, key: str, image_token_id: int = 99) -> EncodedDoc:
    """Text runs and image spans in random order, with recognisable ids (text ids never equal image_token_id)."""
    ids, modality, images, counts, starts = [], [], [], [], []
    for _ in range(rng.randint(1, 5)):
        if rng.random() < 0.5:
            n = rng.randint(1, 12)
            ids += [rng.randint(1, 50) for _ in range(n)]
            modality += [0] * n
        else:
            w, h = 8 * 2 * rng.randint(1, 4), 8 * 2 * rng.randint(1, 4)
            images.append(Image.new("RGB", (w, h), (rng.randint(0, 255), 0, 0)))
            counts.append(PROC.num_tokens_for(images[-1]))
            starts.append(len(ids))
            ids += [image_token_id] * counts[-1]
            modality += [1] * counts[-1]
    return EncodedDoc(key, ids + [2], modality + [0], images, counts, starts)


def pack_all(docs, seq_len, split_documents):
    packer, rows, placed = Packer(seq_len, split_documents), [], []
    for i, doc in enumerate(docs):
        if packer.fits(doc):
            placed.append(doc)
            rows += list(packer.add(doc, i))
    return packer, rows + [r for r in [packer.flush()] if r is not None], placed


@pytest.mark.parametrize("split_documents", [False, True])
def test_rows_reassemble_the_documents_and_never_split_an_image(split_documents):
    rng = random.Random(0)
    docs = [random_doc(rng, f"d{i}") for i in range(200)]
    packer, rows, placed = pack_all(docs, 24, split_documents)
    assert all(0 < len(r) <= 24 for r in rows)
    stream, images = [], []
    for row in rows:
        slots = [m for m in row.modality_ids]
        covered = sum(row.num_tokens)
        assert sum(slots) == covered  # every slot of the row belongs to an image held whole by the row
        stream += row.input_ids
        images += row.images
    assert stream == [t for d in placed for t in d.input_ids]  # order kept, nothing lost or duplicated
    assert [id(i) for i in images] == [id(i) for d in placed for i in d.images]
    if not split_documents:
        assert len(placed) == sum(r.pieces for r in rows)  # whole documents only
        assert all(len(d) <= 24 for d in placed) and any(len(d) > 24 for d in docs)
    else:
        assert len(placed) == sum(1 for d in docs if max(d.num_tokens, default=0) <= 24)
        assert sum(r.pieces for r in rows) > len(placed)  # some documents ran on into the next row
    assert packer.efficiency == sum(len(r) for r in rows) / (len(rows) * 24)


def test_doc_ids_positions_and_labels():
    rng = random.Random(1)
    docs = [random_doc(rng, f"d{i}") for i in range(60)]
    _, rows, _ = pack_all(docs, 32, split_documents=True)
    batch = collate_rows(rows, 32, pad_id=0, image_processor=PROC)
    ids, mask, labels = batch["input_ids"], batch["attention_mask"].bool(), batch["labels"]
    doc, pos, modality = batch["doc_ids"], batch["position_ids"], batch["modality_ids"]
    for b, row in enumerate(rows):
        n = len(row)
        # one id per document piece, each a single run, padding a segment of its own
        runs = torch.unique_consecutive(doc[b, :n]).tolist()
        assert runs == list(range(row.pieces)) and (n == 32 or int(doc[b, n]) == row.pieces)
        starts = torch.ones(n, dtype=torch.bool)
        starts[1:] = doc[b, 1:n] != doc[b, : n - 1]
        run_lengths = torch.unique_consecutive(doc[b, :n], return_counts=True)[1]
        expected_pos = torch.cat([torch.arange(int(c)) for c in run_lengths])
        assert torch.equal(pos[b, :n], expected_pos)  # positions restart at every document
        # labels: the ids, except image slots, padding and each document's first token
        ignore = (modality[b] == 1) | ~mask[b]
        ignore[:n] |= starts
        assert torch.equal(labels[b], torch.where(ignore, torch.full_like(ids[b], IGNORE), ids[b]))
    assert int(modality.sum()) == int(batch["grid_hw"].prod(-1).div(4).sum())
    assert batch["patches"].shape[0] == sum(len(r.images) for r in rows)


def test_too_long_rules():
    big_image = EncodedDoc("img", [9] * 30 + [2], [1] * 30 + [0], [None], [30], [0])
    long_text = EncodedDoc("txt", [5] * 50, [0] * 50, [], [], [])
    whole, split = Packer(24), Packer(24, split_documents=True)
    assert not whole.fits(big_image) and not split.fits(big_image)
    assert not whole.fits(long_text) and split.fits(long_text)
    with pytest.raises(SkipSample) as err:
        list(whole.add(long_text))
    assert err.value.kind == "too_long"
    rows = list(split.add(long_text, "t"))
    assert [len(r) for r in rows] == [24, 24] and rows[-1].resume == ("t", 48) and len(split.row) == 2


def test_encode_uses_the_tokenizers_own_specials_and_keeps_image_text_as_text(tok):
    specials = ("<pad>", "<eos>", "<unk>", "<s>")
    bos_tok = train_bpe_tokenizer(["hello world"] * 20, vocab_size=280, special_tokens=specials)
    bos_tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A <eos>", special_tokens=[("<s>", 3), ("<eos>", 1)]
    )
    img = Image.new("RGB", (32, 16))
    sample = Sample("k", [Segment(text="hello <image> world"), Segment(image=image_bytes(img)), Segment(text="x")])
    doc = encode_sample_tokens(sample, bos_tok, PROC, image_token_id=279)
    assert doc.input_ids[0] == 3 and doc.input_ids[-1] == 1 and doc.input_ids.count(1) == 1  # suffix eos: no second
    assert doc.num_tokens == [PROC.num_tokens_for(img)] and doc.input_ids.count(279) == doc.num_tokens[0]
    image_id = tok.convert_tokens_to_ids("<image>")
    doc = encode_sample_tokens(sample, TokenEncoder(tok), PROC, image_token_id=image_id)
    assert doc.input_ids.count(image_id) == sum(doc.modality_ids) == doc.num_tokens[0]  # literal "<image>" is text
    assert doc.input_ids[-1] == tok.eos_token_id and doc.modality_ids[doc.image_starts[0]] == 1


def test_bad_image_in_a_document_skips_it(tok):
    sample = Sample("k", [Segment(text="a"), Segment(image=b"\x00\x01garbage")])
    with pytest.raises(SkipSample) as err:
        encode_sample_tokens(sample, tok, PROC, image_token_id=0)
    assert err.value.kind == "bad_image"
