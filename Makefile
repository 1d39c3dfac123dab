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

.PHONY: venv test demo instruct-long demo-backbone bench lint format clean study spatial

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

# The main job, end to end on CPU: synthetic shards -> stage 1 (everything trains on questions about one large object:
# learn to look, docs/seeing.md) ->
# stage 2 (everything, conversations in the eval tasks' language + captions + text; loss on the answers) with
# 2-process DeepSpeed -> HF exports -> per-modality R report -> lmms-eval on the four local tasks through the
# conceptmoe plugin (chat template) -> per-task R report -> score table (score, chance, R per modality) -> the
# concepts of one held-out sample (scripts/show_concepts.py: runs/demo/concepts.png, .html).
# `make instruct-long` is the same recipe with a longer stage 2 (scripts/configs/stage2_long.yaml, ~60 min).
DEMO_DATA := data/demo
DEMO_RUN := runs/demo
STAGE2 := scripts/configs/stage2.yaml
INSTRUCT_SAMPLES := 1500
EVAL_LIMIT := 24
EVAL_TASKS := cmoe_sceneqa,cmoe_refloc,cmoe_niah,cmoe_longdoc
# The task definitions plus their generated data (data/ is git-ignored), relative to the repository root.
EVAL_DIR := eval/tasks
# The launcher's rendezvous port: a second run on this host needs another one (`make demo MASTER_PORT=29611`).
MASTER_PORT ?= 29500
DS := $(BIN)/deepspeed --num_gpus 2 --master_port $(MASTER_PORT) scripts/train_vlm.py \
	--deepspeed scripts/configs/zero2.json
demo: venv
	test -f $(DEMO_DATA)/see/train/manifest.json || $(BIN)/python scripts/make_shards.py --synthetic scenes_chat \
		--option max_objects=1 --option object_size=0.45,0.95 --out $(DEMO_DATA)/see --num-samples 8000 --seed 0
	test -f $(DEMO_DATA)/instruct/train/manifest.json || $(BIN)/python scripts/make_shards.py \
		--synthetic scenes_chat,documents_chat,needles_chat,scenes,text --out $(DEMO_DATA)/instruct \
		--num-samples $(INSTRUCT_SAMPLES) --seed 0
	rm -rf $(DEMO_RUN)
	$(DS) --config scripts/configs/stage1.yaml --out $(DEMO_RUN)/stage1
	$(DS) --config $(STAGE2) --out $(DEMO_RUN)/stage2 --set model.init_from=$(DEMO_RUN)/stage1/hf
	$(BIN)/python scripts/r_report.py $(DEMO_RUN)/stage2
	test -f $(EVAL_DIR)/cmoe_sceneqa/data/test.jsonl || $(BIN)/python scripts/make_eval_data.py --out $(EVAL_DIR) \
		--longdoc-pages 1,4 --longdoc-per-bucket 4 --niah-lengths short --refloc-n 32 --sceneqa-n 40
	$(BIN)/python -m lmms_eval --model conceptmoe --model_args pretrained=$(DEMO_RUN)/stage2/hf \
		--tasks $(EVAL_TASKS) --include_path $(EVAL_DIR) --batch_size 8 --limit $(EVAL_LIMIT) \
		--output_path $(DEMO_RUN)/eval --log_samples --verbosity DEBUG
	$(BIN)/python scripts/r_report.py $(DEMO_RUN)/eval
	$(BIN)/python scripts/score_table.py $(DEMO_RUN)/eval --tasks-dir $(EVAL_DIR)
	$(BIN)/python scripts/show_concepts.py --model $(DEMO_RUN)/stage2/hf --shards '$(DEMO_DATA)/instruct/eval/*.tar' \
		--index 0 --out $(DEMO_RUN)/concepts.png --html
	@echo "shards:        $(DEMO_DATA)/{see,instruct}/{train,eval} (manifest.json in each)"
	@echo "metrics:       $(DEMO_RUN)/stage{1,2}/metrics.jsonl (TensorBoard: tb/ beside them)"
	@echo "HF exports:    $(DEMO_RUN)/stage{1,2}/hf (AutoProcessor / AutoModelForImageTextToText, pipeline)"
	@echo "R report:      $(DEMO_RUN)/stage2/r_report.json, .png"
	@echo "lmms-eval:     $(DEMO_RUN)/eval (results, samples, R per task: r_report.json / .png)"
	@echo "scores:        $(DEMO_RUN)/eval/score_table.md (score, chance, eval-mode R total / text / image)"
	@echo "concepts:      $(DEMO_RUN)/concepts.png, .html (what the chunker merged in one held-out sample)"

instruct-long: venv
	test -f $(DEMO_DATA)/scenes_chat/train/manifest.json || $(BIN)/python scripts/make_shards.py \
		--synthetic scenes_chat --out $(DEMO_DATA)/scenes_chat --num-samples 8000 --eval-samples 200 --seed 1
	$(MAKE) demo DEMO_RUN=runs/instruct-long STAGE2=scripts/configs/stage2_long.yaml EVAL_LIMIT=100

# The compute-matched study (scripts/configs/study.yaml): every arm trained and evaluated as above, one table, plots
# and a verdict per claim in docs/study.md (~75 min on 2 CPU cores: the YAML's budget_minutes; resumes;
# e.g. `make study STUDY_ARGS="--budget-minutes 30"`).
STUDY_ARGS ?=
study: venv
	$(BIN)/python scripts/study.py --config scripts/configs/study.yaml $(STUDY_ARGS)

# Spatially aware image chunking (scripts/configs/spatial.yaml): raster against rows / snake / zorder / router2d at
# R = 2, 3 seeds each, in docs/spatial.md with concept pictures (~75 min on 2 CPU cores; resumes like `make study`).
spatial: venv
	$(BIN)/python scripts/study.py --config scripts/configs/spatial.yaml $(STUDY_ARGS)

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
