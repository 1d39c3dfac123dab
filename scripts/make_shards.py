"""Write webdataset shards (train / eval + manifests) from the synthetic generators or local sources.

    python scripts/make_shards.py --synthetic scenes,documents,needles,text --out data/syn --num-samples 1000 --seed 0
    python scripts/make_shards.py --from-jsonl docs.jsonl --out data/docs --eval-fraction 0.05
    python scripts/make_shards.py --from-dir img2dataset_out/ --out data/pairs
    python scripts/make_shards.py --from-text notes/*.txt --text-unit paragraph --out data/notes
    python scripts/make_shards.py --from-llava llava.json --image-root llava_images/ --out data/sft
    python scripts/make_shards.py --from-messages chats.jsonl --out data/chats

OUT is replaced only by a run that succeeded and wrote samples (else it stays as it was; an empty run over an
existing OUT exits 2). All options: ``--help``; the logic lives in :mod:`data_pipelines.make_shards`.
"""

import sys

from data_pipelines.make_shards import main

if __name__ == "__main__":
    sys.exit(main())
