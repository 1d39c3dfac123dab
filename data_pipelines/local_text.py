"""A real text corpus that needs no network: the docstrings of the running interpreter's standard library.

The backbone demo and the language-modelling tests need English-like text with real structure (prose,
code samples, doctests) but the machines have no hub access. Every Python install ships ~700 modules of
documented source, so the corpus is built from it on the fly:

    stdlib *.py (test folders skipped) -> ast -> module / class / function docstrings (cleandoc)
    -> drop short ones -> exact dedup on whitespace-normalised text -> fixed order -> hash split

The result depends only on the Python version (same interpreter, same corpus, any machine, any
PYTHONHASHSEED). With CPython 3.11 and ``min_chars=200`` it is about 2,400 documents, 1.3 MB; loading it
takes ~2 s (parsing), and is cached in-process after the first call.

Also here: :class:`ByteTokenizer` (bytes as ids plus three specials) and :func:`packed_batches`, which packs
documents back to back into fixed-length rows for causal-LM training.
"""

# Shape suffixes (docs/paper.md §0): B batch rows, N tokens per row.

from __future__ import annotations

import ast
import contextlib
import functools
import gc
import hashlib
import logging
import os
import sysconfig
from collections.abc import Iterator, Sequence

import torch

logger = logging.getLogger(__name__)

# Folder names never descended into: test suites (mostly fixtures and noise), installed third-party
# packages, vendored wheels, and demos.
SKIP_DIRS = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "site-packages",
        "dist-packages",
        "__pycache__",
        "_bundled",
        "turtledemo",
    }
)

_DEFINITIONS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_STATEMENT_LISTS = ("body", "orelse", "finalbody", "handlers", "cases")


def _normalize(text: str) -> str:
    """Whitespace-collapsed text: what dedup and the split hash look at."""
    return " ".join(text.split())


def _definitions(statements: list[ast.AST]) -> Iterator[ast.AST]:
    """Class and function definitions at any depth, visiting statements only (ast.walk also visits every
    expression node, which costs more than the parse itself)."""
    for node in statements:
        if isinstance(node, _DEFINITIONS):
            yield node
        for field in _STATEMENT_LISTS:
            child = getattr(node, field, None)
            if isinstance(child, list):
                yield from _definitions(child)


def _digest(text: str) -> bytes:
    return hashlib.sha256(_normalize(text).encode("utf-8")).digest()


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC: parsing allocates millions of AST nodes (no cycles, refcounting frees them), and
    the collections they trigger over everything already loaded (torch, ...) would double the load time."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@functools.lru_cache(maxsize=4)
@_gc_paused()
def _collect_docstrings(root: str) -> tuple[tuple[str, int, str], ...]:
    """All non-empty docstrings under ``root`` as (relative path, line, cleaned text), in path/line order."""
    found: list[tuple[str, int, str]] = []
    n_files = n_failed = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)  # sorted: walk order is fixed
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            try:
                with open(path, "rb") as f:
                    tree = ast.parse(f.read())  # bytes: ast honours the file's coding cookie
            except (SyntaxError, ValueError, OSError):
                n_failed += 1
                continue
            n_files += 1
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            for node in [tree, *_definitions(tree.body)]:
                doc = ast.get_docstring(node, clean=True)  # clean=True is inspect.cleandoc
                if doc and doc.strip():
                    found.append((rel, getattr(node, "lineno", 0), doc.strip()))
    found.sort(key=lambda item: (item[0], item[1]))
    logger.info("collected %d docstrings from %d files under %s (%d unparsable)", len(found), n_files, root, n_failed)
    return tuple(found)


def load_local_text_corpus(
    min_chars: int = 200,
    eval_fraction: float = 0.02,
    max_docs: int | None = None,
    *,
    stdlib_dir: str | None = None,
) -> dict[str, list[str]]:
    """Standard-library docstrings as a train / eval corpus: ``{"train": [...], "eval": [...]}``.

    Args:
        min_chars: drop docstrings shorter than this (after cleandoc); one-line docstrings carry little.
        eval_fraction: share of documents in "eval". The split is by a hash of each document's
            normalised text, so a document keeps its side whatever ``min_chars`` / ``max_docs`` are.
        max_docs: keep at most this many documents in total, a fixed pseudo-random sample (by hash,
            independent of the split), before splitting.
        stdlib_dir: folder to read instead of the interpreter's standard library (tests).

    Documents are deduplicated exactly (on whitespace-normalised text, first occurrence kept) and
    listed in source order (module path, then line).
    """
    if min_chars < 1:
        raise ValueError(f"min_chars must be >= 1, got {min_chars}")
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if max_docs is not None and max_docs < 1:
        raise ValueError(f"max_docs must be None or >= 1, got {max_docs}")
    root = stdlib_dir if stdlib_dir is not None else sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(root):
        raise FileNotFoundError(f"stdlib_dir {root!r} is not a directory")

    seen: set[bytes] = set()
    docs: list[tuple[bytes, str]] = []
    for _, _, text in _collect_docstrings(os.path.abspath(root)):
        if len(text) < min_chars:
            continue
        digest = _digest(text)
        if digest in seen:
            continue
        seen.add(digest)
        docs.append((digest, text))

    if max_docs is not None and len(docs) > max_docs:
        # Sample by digest bytes 8..16 (the split uses bytes 0..8), then restore source order.
        order = sorted(range(len(docs)), key=lambda i: docs[i][0][8:16])
        docs = [docs[i] for i in sorted(order[:max_docs])]

    threshold = int(eval_fraction * 2**64)
    corpus: dict[str, list[str]] = {"train": [], "eval": []}
    for digest, text in docs:
        corpus["eval" if int.from_bytes(digest[:8], "big") < threshold else "train"].append(text)
    if not corpus["train"]:
        raise ValueError(f"no training documents under {root!r} with min_chars={min_chars}")
    return corpus


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, plus ``bos_id=256``, ``eos_id=257``, ``pad_id=258``."""

    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Bytes back to text; special ids are dropped and broken UTF-8 becomes U+FFFD."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return self.vocab_size


def _row_batch(rows: list[list[int]], seq_len: int, eos_id: int, pad_id: int) -> dict[str, torch.Tensor]:
    input_ids_BN = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    attention_mask_BN = torch.zeros((len(rows), seq_len), dtype=torch.long)
    for b, row in enumerate(rows):
        input_ids_BN[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention_mask_BN[b, : len(row)] = 1
    # A new document starts right after each eos: doc id = number of eos strictly before the position.
    # Padding (only after a final eos) therefore forms one extra segment of its own.
    is_eos_BN = (input_ids_BN == eos_id).long()
    doc_ids_BN = torch.cumsum(is_eos_BN, dim=1) - is_eos_BN
    labels_BN = input_ids_BN.masked_fill(attention_mask_BN == 0, -100)
    return {
        "input_ids": input_ids_BN,
        "labels": labels_BN,
        "doc_ids": doc_ids_BN,
        "attention_mask": attention_mask_BN,
    }


def packed_batches(
    docs: Sequence[str],
    tokenizer: ByteTokenizer,
    seq_len: int,
    batch_size: int,
    seed: int,
    drop_last: bool = True,
    epochs: int | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """Pack documents back to back into ``[batch_size, seq_len]`` causal-LM batches.

    Each document contributes ``tokenizer.encode(text) + [eos]``; documents are shuffled once per epoch
    (``torch.randperm`` from a generator seeded with ``seed``) and streamed into rows, a document running
    on into the next row when it does not fit (the continuation attends within its new row only).

    Yields dicts of long tensors, all ``[B, N]``:
        input_ids: token ids;
        labels: ``input_ids`` with -100 on padding (HF convention: the model shifts internally);
        doc_ids: 0, 1, 2, ... within each row; the id steps up right after every eos token;
        attention_mask: 1 on real tokens, 0 on padding.

    ``epochs=None`` streams forever (the token stream runs on across epoch boundaries, so nothing is
    ever padded or dropped). With ``epochs=k`` the stream ends after k passes: ``drop_last=True`` drops
    the incomplete last row and batch; ``drop_last=False`` pads the last row at its end and yields the
    last, possibly smaller, batch.
    """
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be >= 1, got seq_len={seq_len}, batch_size={batch_size}")
    if epochs is not None and epochs < 1:
        raise ValueError(f"epochs must be None or >= 1, got {epochs}")
    if len(docs) == 0:
        raise ValueError("docs is empty")

    generator = torch.Generator().manual_seed(seed)
    eos_id, pad_id = tokenizer.eos_id, tokenizer.pad_id
    buffer: list[int] = []
    rows: list[list[int]] = []
    epoch = 0
    while epochs is None or epoch < epochs:
        for i in torch.randperm(len(docs), generator=generator).tolist():
            buffer.extend(tokenizer.encode(docs[i]))
            buffer.append(eos_id)
            while len(buffer) >= seq_len:
                rows.append(buffer[:seq_len])
                del buffer[:seq_len]
                if len(rows) == batch_size:
                    yield _row_batch(rows, seq_len, eos_id, pad_id)
                    rows = []
        epoch += 1
    if not drop_last:
        if buffer:
            rows.append(buffer)
        if rows:
            yield _row_batch(rows, seq_len, eos_id, pad_id)
