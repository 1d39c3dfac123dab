# Everything runs from the project's own virtual environment, created on first use.
# `make demo` and `make test` are all a new user needs; see README.md.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Exact pins: a range (or torchvision unpinned) pulls a newer multi-GB CUDA torch (docs/environment.md).
TORCH_PINS := torch==2.14.1 torchvision==0.29.1

# No network at run time: nothing may reach for the hub.
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: venv test demo demo-backbone bench lint format clean

venv: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Re-installs whenever pyproject.toml changes.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -U pip
	$(BIN)/python -m pip install $(TORCH_PINS)
	$(BIN)/python -m pip install -e '.[test]'
	touch $@

# Style, then the import layers (pyproject.toml [tool.importlinter]; the graph builds in under a second, so no cache).
LINT := $(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/lint-imports --no-cache --no-logo

test: venv
	$(LINT) && $(BIN)/python -m pytest -q tests

# The main job, end to end on CPU (~8 min on 2 cores): synthetic shards -> 2-process DeepSpeed training of the
# `small` VLM -> HF export -> per-modality R report -> lmms-eval on the three local tasks (a few docs each, through
# the conceptmoe plugin and the cached generate()) -> per-task R report.
DEMO_DATA := data/demo
DEMO_RUN := runs/demo
EVAL_TASKS := cmoe_longdoc,cmoe_niah,cmoe_refloc
# The task definitions plus their generated data (data/ is git-ignored), relative to the repository root.
EVAL_DIR := eval/tasks
demo: venv
	test -f $(DEMO_DATA)/train/manifest.json || $(BIN)/python scripts/make_shards.py \
		--synthetic scenes,documents,needles,text --out $(DEMO_DATA) --num-samples 400 --seed 0
	rm -rf $(DEMO_RUN)
	$(BIN)/deepspeed --num_gpus 2 scripts/train_vlm.py --config scripts/configs/small.yaml \
		--deepspeed scripts/configs/zero2.json --out $(DEMO_RUN)
	$(BIN)/python scripts/r_report.py $(DEMO_RUN)
	test -f $(EVAL_DIR)/cmoe_refloc/data/test.jsonl || $(BIN)/python scripts/make_eval_data.py --out $(EVAL_DIR) \
		--longdoc-pages 1,4 --longdoc-per-bucket 4 --niah-lengths short --refloc-n 32
	$(BIN)/python -m lmms_eval --model conceptmoe --model_args pretrained=$(DEMO_RUN)/hf --tasks $(EVAL_TASKS) \
		--include_path $(EVAL_DIR) --batch_size 4 --limit 8 --output_path $(DEMO_RUN)/eval --log_samples \
		--verbosity DEBUG
	$(BIN)/python scripts/r_report.py $(DEMO_RUN)/eval
	@echo "shards:        $(DEMO_DATA)/{train,eval} (manifest.json in each)"
	@echo "metrics:       $(DEMO_RUN)/metrics.jsonl (TensorBoard: $(DEMO_RUN)/tb)"
	@echo "checkpoints:   $(DEMO_RUN)/checkpoints (resume: add --resume auto)"
	@echo "HF export:     $(DEMO_RUN)/hf (AutoModelForImageTextToText / VLMProcessor.from_pretrained)"
	@echo "R report:      $(DEMO_RUN)/r_report.json, $(DEMO_RUN)/r_report.png"
	@echo "lmms-eval:     $(DEMO_RUN)/eval (results, samples, r_stats_<task>.jsonl; R per task: r_report.json / .png)"

# The backbone alone: ConceptMoE vs its matched MoE on local text (~2 min).
demo-backbone: venv
	$(BIN)/python scripts/demo_backbone.py

bench: venv
	$(BIN)/python scripts/bench_model.py

lint: venv
	$(LINT)

format: venv
	$(BIN)/ruff check --fix . && $(BIN)/ruff format .

# Keeps .venv (delete it by hand to reinstall from scratch) and runs/ (experiment outputs).
clean:
	rm -rf build .pytest_cache .ruff_cache *.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
