"""Build the default tokenizer (byte-level BPE on the local stdlib-docstring corpus) and save it.

    python scripts/build_tokenizer.py [--out DIR] [--vocab-size 8192]

The default ``--out`` is ``data_pipelines/assets/tokenizer`` relative to the current directory: run from the
repository root, that is the copy shipped in the package; from anywhere else it is a new folder under the current
directory (never the installed package's files). A rebuild with the Python version recorded in its
``BUILD_INFO.json`` reproduces ``tokenizer.json`` byte for byte.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from data_pipelines.tokenizer import DEFAULT_VOCAB_SIZE, save_default_tokenizer

DEFAULT_OUT = Path("data_pipelines") / "assets" / "tokenizer"  # relative to the current directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out",
        default=str(DEFAULT_OUT),
        help="output folder, relative to the current directory (default: %(default)s)",
    )
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="default: %(default)s")
    args = parser.parse_args()
    start = time.perf_counter()
    tokenizer, info = save_default_tokenizer(args.out, args.vocab_size)
    seconds = time.perf_counter() - start
    corpus = info["corpus"]
    print(f"tokenizer: vocab {len(tokenizer)}, special {info['special_tokens']}")
    print(
        f"corpus: {corpus['train_docs']} train docs, {corpus['train_bytes']:,} bytes, sha256 {corpus['train_sha256']}"
    )
    print(f"python {info['python']}, tokenizers {info['tokenizers']}, transformers {info['transformers']}")
    print(f"eval bytes/token: {info['eval_bytes_per_token']:.3f}; built in {seconds:.1f} s -> {args.out}")


if __name__ == "__main__":
    main()
