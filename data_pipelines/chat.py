"""The chat template: how a conversation becomes one token sequence, for training and for inference alike.

Every turn is its role's header token, its content (text, and one ``<image>`` marker per image), then ``<|end|>``:

    <|system|>You are terse.<|end|><|user|><image>
    What colour is the square?<|end|><|assistant|>red<|end|>

``add_generation_prompt`` appends ``<|assistant|>``, so the model answers and stops by emitting ``<|end|>``. The four
tokens are special tokens (``CHAT_TOKENS``): the tokenizer never merges them with their neighbours, so tokenising a
rendered conversation as one string (what ``VLMProcessor(text=processor.apply_chat_template(...))`` does) gives the
same ids as encoding it turn by turn (what training does, :func:`data_pipelines.packing.encode_conversation`), and
the labels of a training conversation cover exactly the assistant turns' content and their ``<|end|>``.

``CHAT_TEMPLATE`` is the same rule as a Jinja string (HF's ``apply_chat_template`` format: ``messages`` with
``content`` a string or a list of ``{"type": "text", "text": ...}`` / ``{"type": "image"}`` parts); it is saved
with the processor and can be edited there. A content string is taken as it is. In a list of parts, an image part
followed by another part gets a newline after its ``<image>`` unless that part is text starting with one: the
training prompts (``data_pipelines.prompts``: ``<image>\nQUESTION...``, one ``<image>\n`` per page) put a newline
after every image, so ``[{"type": "image"}, {"type": "text", "text": QUESTION}]`` renders to the same string, and
ids, as the training conversation. Turn segments already hold that newline in their text (``prompts.segments``), so
:func:`render` joins them as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from data_pipelines.schema import Modality, Turn
from data_pipelines.tokenizer import CHAT_TOKENS, END_OF_TURN, IMAGE_TOKEN, ROLE_TOKENS

__all__ = ["CHAT_TEMPLATE", "CHAT_TOKENS", "END_OF_TURN", "ROLE_TOKENS", "interleave_ids", "render", "turn_text"]

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '" + IMAGE_TOKEN + "' -}}"
    # the training prompts' newline after an image (data_pipelines.prompts), unless the next part brings its own
    "{%- if loop.nextitem is defined and (loop.nextitem['type'] != 'text' or loop.nextitem['text'][:1] != '\\n')"
    " -%}{{- '\\n' -}}{%- endif -%}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '" + END_OF_TURN + "' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '" + ROLE_TOKENS["assistant"] + "' -}}{%- endif -%}"
)


def turn_text(turn: Turn) -> str:
    """A turn's content as template text: its text segments, ``<image>`` for each image."""
    return "".join(IMAGE_TOKEN if seg.image is not None else seg.text for seg in turn.segments)


def render(turns: list[Turn], add_generation_prompt: bool = False) -> str:
    """The template applied in Python (the Jinja ``CHAT_TEMPLATE`` renders the same string; a test checks it)."""
    text = "".join(ROLE_TOKENS[t.role] + turn_text(t) + END_OF_TURN for t in turns)
    return text + (ROLE_TOKENS["assistant"] if add_generation_prompt else "")


def interleave_ids(
    pieces: Sequence[str | int], text_ids: Callable[[str], list[int]], image_token_id: int
) -> tuple[list[int], list[int], list[int]]:
    """Text and images -> ``(ids, modality_ids, image_starts)``: the one encoding rule of training and inference.

    ``pieces`` are text (``str``) and images (``int``: the image's slot count) in order. Each run of consecutive
    text pieces is tokenised as one string by ``text_ids`` (the chat template renders it as one, so BPE merges
    across the seam); each image becomes that many ``image_token_id`` slots (modality 1). The packer
    (``data_pipelines.packing``) and ``vlm.processor.VLMProcessor`` both call it."""
    ids: list[int] = []
    modality: list[int] = []
    starts: list[int] = []
    run: list[str] = []
    for piece in [*pieces, None]:  # None flushes the last text run
        if isinstance(piece, str):
            run.append(piece)
            continue
        text, run = "".join(run), []
        if text:
            tokens = text_ids(text)
            ids += tokens
            modality += [Modality.TEXT] * len(tokens)
        if piece is not None:
            starts.append(len(ids))
            ids += [image_token_id] * piece
            modality += [Modality.IMAGE] * piece
    return ids, modality, starts
