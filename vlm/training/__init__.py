"""Training with DeepSpeed: ``scripts/train_vlm.py`` (ZeRO 1/2 JSONs in ``scripts/configs/``), exact resume, logging,
HF export.

    python scripts/make_shards.py --synthetic scenes,text --out data/tiny --num-samples 256 --seed 0
    deepspeed --num_gpus 2 scripts/train_vlm.py --config scripts/configs/tiny.yaml \\
        --deepspeed scripts/configs/zero2.json --out runs/tiny [--set train.max_steps=100] [--resume auto]
    python -m vlm.training.export runs/tiny --out runs/tiny/hf-latest

- ``config``: YAML + ``--set`` overrides, defaults, validation (``ConfigError`` names the field).
- ``loop``: the DeepSpeed loop; ``metrics``: exact R aggregation and the rank-0 writers (``metrics.jsonl``,
  TensorBoard when installed, progress line); ``checkpoint``: complete-only checkpoints, ``--resume``;
  ``export``: gathered fp32 weights -> ``save_pretrained`` folder (model + processor).
"""
