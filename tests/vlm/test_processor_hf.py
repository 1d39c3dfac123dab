"""VLMProcessor / ImageProcessor as transformers processors: files written at save, the Auto classes, folders of the
old processor, the chat template, and an exported model through AutoProcessor + AutoModelForImageTextToText,
``generate`` and ``pipeline("image-text-to-text")``."""

import io
import json

import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoProcessor, pipeline

from data_pipelines import prompts
from data_pipelines.chat import CHAT_TEMPLATE, END_OF_TURN, ROLE_TOKENS, render
from data_pipelines.packing import TokenEncoder, encode_conversation
from data_pipelines.schema import Segment, Turn
from data_pipelines.synthetic import conversations
from data_pipelines.tokenizer import load_tokenizer
from vision_tower import ImageProcessor
from vlm import ConceptMoEVLM, ConceptMoEVLMConfig
from vlm.processor import VLMProcessor

PROCESSOR_FILES = {"chat_template.jinja", "processor_config.json", "tokenizer.json", "tokenizer_config.json"}


@pytest.fixture(scope="module")
def processor():
    return VLMProcessor(load_tokenizer(), ImageProcessor(patch_size=16, max_patches=64))


def picture(colour=(200, 30, 30), size=(64, 48)):
    return Image.new("RGB", size, colour)


def conversation(images=None):
    """HF messages: a system turn, then two user / assistant exchanges with an image each (``images``: PIL images
    placed in the parts, else bare ``{"type": "image"}`` placeholders)."""
    first, second = ({"type": "image", "image": im} for im in images) if images else ({"type": "image"},) * 2
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [first, {"type": "text", "text": "\nWhat colour is the square?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
        {"role": "user", "content": [{"type": "text", "text": "And here? "}, second]},
    ]


def turns():
    """The same conversation as the data pipelines hold it."""
    return [
        Turn("system", [Segment(text="You are terse.")]),
        Turn("user", [Segment(image=b""), Segment(text="\nWhat colour is the square?")]),
        Turn("assistant", [Segment(text="red")]),
        Turn("user", [Segment(text="And here? "), Segment(image=b"")]),
    ]


def test_save_and_load_through_the_auto_classes(processor, tmp_path):
    processor.save_pretrained(tmp_path)
    assert {p.name for p in tmp_path.iterdir() if p.suffix != ".py"} == PROCESSOR_FILES
    assert {"vlm_processor.py", "vision_tower_image_processor.py"} <= {p.name for p in tmp_path.glob("*.py")}
    saved = json.loads((tmp_path / "processor_config.json").read_text())
    assert saved["processor_class"] == "VLMProcessor"
    auto_map = {"auto_map": {"AutoImageProcessor": "vision_tower_image_processor.ImageProcessor"}}  # vlm.hub_code
    assert saved["image_processor"] == processor.image_processor.to_dict() | auto_map  # transformers 5 nests it here
    assert (tmp_path / "chat_template.jinja").read_text() == CHAT_TEMPLATE

    loaded = AutoProcessor.from_pretrained(tmp_path)
    assert type(loaded) is VLMProcessor and loaded.chat_template == CHAT_TEMPLATE
    assert loaded.image_processor.to_dict() == processor.image_processor.to_dict()
    assert (loaded.image_token_id, loaded.end_of_turn_id) == (processor.image_token_id, processor.end_of_turn_id)
    image_processor = AutoImageProcessor.from_pretrained(tmp_path)
    assert type(image_processor) is ImageProcessor and image_processor.to_dict() == processor.image_processor.to_dict()
    text, images = ["<image> a red square", "no image here"], [[picture()], []]
    a, b = processor(text=text, images=images), loaded(text=text, images=images)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # the template is the processor's: edited, it is what is saved and loaded
    edited = VLMProcessor(load_tokenizer(), processor.image_processor, chat_template="{{ messages[0]['content'] }}")
    edited.save_pretrained(tmp_path / "edited")
    assert AutoProcessor.from_pretrained(tmp_path / "edited").chat_template == "{{ messages[0]['content'] }}"

    # an image processor saved on its own: preprocessor_config.json, read by AutoImageProcessor too
    path = ImageProcessor(14, 100, 1, upscale=True).save_pretrained(tmp_path / "ip")
    assert path.name == "preprocessor_config.json"
    assert (
        AutoImageProcessor.from_pretrained(tmp_path / "ip").to_dict()
        == ImageProcessor(14, 100, 1, upscale=True).to_dict()
    )


def test_a_folder_saved_by_the_old_processor_loads(tmp_path):
    """Before: ``vlm_processor_config.json`` + ``image_processor_config.json`` (its ``merge`` field the first name of
    ``pixel_shuffle``) + the tokenizer's files, next to the model's config.json."""
    load_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "vlm_processor_config.json").write_text(
        json.dumps({"processor_class": "VLMProcessor", "image_token": "<image>"})
    )
    old = {
        "image_processor_type": "ImageProcessor",
        "patch_size": 16,
        "max_patches": 100,
        "merge": 1,
        "mean": [0.5] * 3,
        "std": [0.5] * 3,
        "upscale": False,
    }
    (tmp_path / "image_processor_config.json").write_text(json.dumps(old))
    ConceptMoEVLMConfig.from_preset("tiny").save_pretrained(tmp_path)
    for loaded in (VLMProcessor.from_pretrained(tmp_path), AutoProcessor.from_pretrained(tmp_path)):
        assert type(loaded) is VLMProcessor and loaded.chat_template == CHAT_TEMPLATE
        assert (loaded.image_processor.max_patches, loaded.image_processor.pixel_shuffle) == (100, 1)
    assert ImageProcessor.from_pretrained(tmp_path).max_patches == 100
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="processor_config.json"):
        VLMProcessor.from_pretrained(tmp_path / "empty")


def test_apply_chat_template_is_render_and_its_tokens_are_special(processor):
    for add_generation_prompt in (True, False):
        text = processor.apply_chat_template(conversation(), add_generation_prompt=add_generation_prompt)
        assert text == render(turns(), add_generation_prompt=add_generation_prompt)
    text = processor.apply_chat_template(conversation(), add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|assistant|>") and text.count("<image>") == 2

    images = [picture(), picture((20, 200, 20), (40, 90))]
    batch = processor(text=text, images=images)
    tok, n_slots = processor.tokenizer, batch["num_tokens"].tolist()
    special = {t: tok.convert_tokens_to_ids(t) for t in (*ROLE_TOKENS.values(), END_OF_TURN)}
    assert len(set(special.values()) | {tok.unk_token_id, processor.image_token_id}) == 6  # tokens of their own
    words = lambda s: tok(s, add_special_tokens=False)["input_ids"]
    slots = lambda i: [processor.image_token_id] * n_slots[i]
    expected = [
        special["<|system|>"],
        *words("You are terse."),
        special["<|end|>"],
        special["<|user|>"],
        *slots(0),
        *words("\nWhat colour is the square?"),
        special["<|end|>"],
        special["<|assistant|>"],
        *words("red"),
        special["<|end|>"],
        special["<|user|>"],
        *words("And here? "),
        *slots(1),
        special["<|end|>"],
        special["<|assistant|>"],
    ]
    assert batch["input_ids"][0].tolist() == list(processor.prefix_ids) + expected + list(processor.suffix_ids)
    assert batch["modality_ids"][0].sum() == sum(n_slots)
    assert processor.decode(batch["input_ids"][0], skip_special_tokens=True) == (
        "You are terse.\nWhat colour is the square?redAnd here? "
    )
    # the images inside the messages, tokenized by apply_chat_template itself: the same inputs
    direct = processor.apply_chat_template(
        conversation(images), add_generation_prompt=True, tokenize=True, return_dict=True
    )
    assert all(torch.equal(direct[k], batch[k]) for k in batch)


def hf_parts(sample) -> list[dict]:
    """A training conversation's user turn as HF message parts, as a user writes them: one ``{"type": "image"}``
    per image, then the question and instruction, with no newline of their own."""
    meta, images = sample.meta, sum(seg.image is not None for seg in sample.turns[0].segments)
    question, instruction = {
        "sceneqa": (meta["question"], prompts.SCENEQA_INSTRUCTION),
        "refloc": (meta["question"], prompts.REFLOC_INSTRUCTION),
        "longdoc": (meta["question"], prompts.LONGDOC_INSTRUCTION),
    }[meta["task"]]
    return [{"type": "image"}] * images + [{"type": "text", "text": f"{question}\n{instruction}"}]


@pytest.mark.parametrize("kind", ["scenes_chat", "documents_chat"])
def test_hf_image_then_text_messages_give_the_training_conversations_ids(processor, kind):
    """``[{"type": "image"}, {"type": "text", "text": QUESTION}]`` renders ``<image>\\nQUESTION`` as the training
    prompts do (data_pipelines.prompts), so the prompt of a chat message is token for token the training
    conversation's (encode_conversation) up to the answer: sceneqa, refloc (one image), longdoc (one per page)."""
    seen = set()
    n, options = (8, {}) if kind == "scenes_chat" else (2, {"max_pages": 2})
    for sample in conversations.generate(kind, n, seed=0, split="eval", **options):
        images = [Image.open(io.BytesIO(seg.image)) for seg in sample.turns[0].segments if seg.image is not None]
        answer = sample.turns[1].segments[0].text
        messages = [{"role": "user", "content": hf_parts(sample)}, {"role": "assistant", "content": answer}]
        inputs = processor(text=processor.apply_chat_template(messages), images=images)
        enc = TokenEncoder(processor.tokenizer)
        doc = encode_conversation(sample, enc, processor.image_processor, processor.image_token_id)
        ids, n = inputs["input_ids"][0].tolist(), inputs["input_ids"].shape[1] - len(processor.suffix_ids)
        assert doc.input_ids == ids[:n] + enc.closing(), sample.meta  # a training document also ends with eos
        assert doc.modality_ids[:n] == inputs["modality_ids"][0].tolist()[:n]
        seen.add((sample.meta["task"], len(images)))
    assert seen >= ({("sceneqa", 1), ("refloc", 1)} if kind == "scenes_chat" else {("longdoc", 2)})
    # a part that brings its own newline gets none added; an image with nothing after it none either
    parts = [{"type": "text", "text": "A "}, {"type": "image"}, {"type": "text", "text": "\nB"}, {"type": "image"}]
    rendered = processor.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)
    assert rendered == f"{ROLE_TOKENS['user']}A <image>\nB<image>{END_OF_TURN}"


@pytest.fixture(scope="module")
def exported(processor, tmp_path_factory):
    """A random tiny ConceptMoEVLM and its processor saved as the training export does."""
    torch.manual_seed(0)
    model = ConceptMoEVLM.from_preset(
        "tiny", image_token_id=processor.image_token_id, vocab_size=len(processor.tokenizer), max_patches=64
    )
    model.set_special_token_ids(**processor.special_token_ids)
    out = tmp_path_factory.mktemp("export")
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def test_exported_model_loads_with_the_auto_classes_and_generation_stops_at_end_of_turn(exported):
    assert {"config.json", "generation_config.json", "model.safetensors"} | PROCESSOR_FILES <= {
        p.name for p in exported.iterdir()
    }
    processor = AutoProcessor.from_pretrained(exported)
    model = AutoModelForImageTextToText.from_pretrained(exported).eval()
    assert type(processor) is VLMProcessor and type(model) is ConceptMoEVLM
    tok, end = processor.tokenizer, processor.end_of_turn_id
    config = json.loads((exported / "config.json").read_text())
    generation = json.loads((exported / "generation_config.json").read_text())
    for saved in (config, generation):
        assert saved["eos_token_id"] == [end, tok.eos_token_id]
        assert (saved["bos_token_id"], saved["pad_token_id"]) == (tok.bos_token_id, tok.pad_token_id)
    assert end in model.generation_config.eos_token_id

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=text, images=[picture()])
    n = inputs["input_ids"].shape[1]
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        assert out.dtype == torch.long and n < out.shape[1] <= n + 4 and torch.equal(out[:, :n], inputs["input_ids"])
        # make <|end|> the first answer token (its logit the largest), and generate() stops right after it
        logits = model(**inputs).logits[0, -1]
        top = int(logits.argmax())
        head = model.get_output_embeddings().weight
        head[end] = head[top] * (2.0 if logits[top] > 0 else 0.5)
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == n + 1 and int(out[0, -1]) == end
    assert processor.decode(out[0, n:], skip_special_tokens=True) == ""


def test_image_text_to_text_pipeline_answers(exported):
    pipe = pipeline("image-text-to-text", model=str(exported))
    assert type(pipe.processor) is VLMProcessor
    chat = conversation([picture(), picture((20, 200, 20))])[:2]  # system + user with an image
    (answer,) = pipe(text=chat, max_new_tokens=3)
    assert answer["generated_text"][-1]["role"] == "assistant"
    assert isinstance(answer["generated_text"][-1]["content"], str)
    (plain,) = pipe(images=picture(), text="<image>What colour is it?", max_new_tokens=3, return_full_text=False)
    assert isinstance(plain["generated_text"], str)
