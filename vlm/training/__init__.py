"""Training with DeepSpeed: ``scripts/train_vlm.py`` (ZeRO 1/2 JSONs in ``scripts/configs/``), exact resume, logging,
HF export.

    python scripts/make_shards.py --synthetic scenes,text --out data/tiny --num-samples 256 --seed 0
    deepspeed --num_gpus 2 scripts/train_vlm.py --config scripts/configs/tiny.yaml \\
        --deepspeed scripts/configs/zero2.json --out runs/tiny [--set train.max_steps=100] [--resume auto]
    python -m vlm.training.export runs/tiny --out runs/tiny/hf-latest

- ``config``: YAML + ``--set`` overrides, defaults, validation (``ConfigError`` names the field).
- ``build``: the model and processor a config describes (a preset with overrides, or ``model.init_from`` a saved
  folder).
- ``step``: what every run shares: the learning-rate schedule, one optimiser step, the held-out evaluation.
- ``loop``: the DeepSpeed loop; ``metrics``: exact R aggregation (total / text / image, docs/paper.md §11) and
  the rank-0 writers (``metrics.jsonl``, TensorBoard when installed, progress line); ``checkpoint``:
  complete-only checkpoints, ``--resume``.
- ``export`` (``python -m vlm.training.export RUN_DIR --out DIR``): gathered fp32 weights -> ``save_pretrained``
  folder (model + processor).
- ``single_process``: training in one process without DeepSpeed (``LocalEngine``, same step and evaluation as
  the DeepSpeed loop), for the CPU demos (``make demo-backbone``, ``scripts/demo_backbone.py``), benchmarks and
  convergence tests.
"""
