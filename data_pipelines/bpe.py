"""Train a byte-level BPE tokenizer with HF ``tokenizers`` and wrap it as a ``PreTrainedTokenizerFast``."""

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 320,
    special_tokens=("<pad>", "<eos>", "<unk>"),
    show_progress: bool = True,
) -> PreTrainedTokenizerFast:
    """Byte-level BPE (every byte is in the base alphabet, so nothing is ever unknown); the first three
    special tokens become pad, eos and unk. Special tokens take ids 0, 1, ... in the order given."""
    tok = Tokenizer(models.BPE(unk_token=special_tokens[2]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer)
    pad, eos, unk = special_tokens[:3]
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, eos_token=eos, unk_token=unk)
