"""Train a ConceptMoE VLM with DeepSpeed.

    deepspeed --num_gpus 2 scripts/train_vlm.py --config scripts/configs/tiny.yaml \\
        --deepspeed scripts/configs/zero2.json --out runs/tiny [--set train.max_steps=50 ...] [--resume auto]

Also runs under ``torchrun`` and as plain ``python`` (one process).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vlm.training.build import check_data  # noqa: E402
from vlm.training.checkpoint import CheckpointError  # noqa: E402
from vlm.training.config import ConfigError, check_paths, load_config, save_config  # noqa: E402
from vlm.training.ds_config import deepspeed_config  # noqa: E402
from vlm.training.resume import prepare_run_dir  # noqa: E402
from vlm.training.safe_load import UnsafeCheckpointError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument(
        "--deepspeed", default=None, help="DeepSpeed JSON (ZeRO stage, precision, optimiser, scheduler, monitors)"
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    parser.add_argument("--out", required=True, help="run folder")
    parser.add_argument(
        "--resume", default=None, help="'auto' (the newest checkpoint of --out that verifies) or a checkpoint folder"
    )
    parser.add_argument("--overwrite", action="store_true", help="start over in an --out that already holds a run")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    try:  # every check before the model is built; each failure is one line and exit code 2
        config = load_config(args.config, args.set)
        check_paths(config)
        check_data(config)
        ds_config = deepspeed_config(config, args.deepspeed, int(os.environ.get("WORLD_SIZE", "1")))
        prepare_run_dir(args.out, args.resume, args.overwrite, is_rank0=rank == 0)
        os.makedirs(args.out, exist_ok=True)
        if rank == 0:
            save_config(config, os.path.join(args.out, "config.yaml"))
        from vlm.training.loop import run

        run(config, args.out, ds_config, args.resume)
    except (ConfigError, CheckpointError, UnsafeCheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
