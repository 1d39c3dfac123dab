"""The compute-matched study of ConceptMoE (arXiv 2601.21420) in a VLM: every arm trained through
scripts/train_vlm.py and evaluated through lmms-eval, one table, plots and a verdict per claim (docs/study.md).

    python scripts/study.py [--config scripts/configs/study.yaml] [--out runs/study] [--budget-minutes M]
        [--arms a,b,...] [--seeds N] [--jobs 2] [--quick] [--report-only] [--doc PATH] [--set key=value ...]

The arms, claims and settings are in scripts/configs/study.yaml; the machinery in eval/study/ (eval/study/cli.py
describes the steps). `--quick` (2 arms, 1 seed, a few steps, under OUT) is what tests/eval/test_study.py runs.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eval.study.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
