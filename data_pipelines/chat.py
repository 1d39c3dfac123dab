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

from data_pipelines.schema import Turn
from data_pipelines.tokenizer import CHAT_TOKENS, END_OF_TURN, IMAGE_TOKEN, ROLE_TOKENS

__all__ = ["CHAT_TEMPLATE", "CHAT_TOKENS", "END_OF_TURN", "ROLE_TOKENS", "render", "turn_text"]

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
