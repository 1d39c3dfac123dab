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

.PHONY: venv test demo demo-shards demo-tower demo-eval demo-eval-data instruct-long instruct-bind instruct-copy-bind needles demo-backbone bench lint format clean study study-staged spatial spatial-staged

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

# The main job, end to end on CPU: synthetic shards -> stage 0 (the vision tower alone learns the words of the
# captions of scenes of 1-3 objects as labels: scripts/pretrain_vision.py --objective multilabel, conv stem, 128 wide;
# with --region-labels 10 each patch inside an object's box learns that object's words, and the tower's word head
# names every object) -> stage 1a (the language model, tower frozen, on the colour of one large object: colour first,
# docs/seeing.md; each image token is the embeddings of its patches' words alone: vision_words, no projector) -> stage
# 1b (from 1a's export: colour / shape / position questions about one object, large or small: learn to look; count
# questions on 1-5 objects) -> stage 2 (all but the tower, at a lower lr: the eval tasks' conversations, one-object
# scenes of every size and question type, more colour / shape / position questions on small single objects and
# count questions on 1-5 objects, loss on the answers) with 2-process
# DeepSpeed -> HF exports -> per-modality R report -> lmms-eval on the five local tasks through the conceptmoe plugin
# (chat template) -> per-task R report -> score table (score, chance, R per modality) -> the concepts of one held-out
# sample (scripts/show_concepts.py: runs/demo/concepts.png, .html).
# `make instruct-long` is the same recipe with a text stage before stage 1a (TEXT_STAGE=1: it learns to copy) and a
# longer stage 2 with text needles (scripts/configs/stage2_long.yaml; 55 min in all), on caption words alone and
# projector tokens (its text stage's model).
DEMO_DATA := data/demo
DEMO_RUN := runs/demo
STAGE2 := scripts/configs/stage2.yaml
# The stages train on the shards made under $(DEMO_DATA) (the YAMLs' own shard lists name data/demo): stage 1b's and
# stage 2's, each with count questions on scenes of 1-5 objects (count_multi; docs/seeing.md, "Counting").
LOOK_SHARDS = $(DEMO_DATA)/look/train,$(DEMO_DATA)/look_small/train
TASK_SHARDS = $(DEMO_DATA)/tasks/train,$(DEMO_DATA)/one/train,$(DEMO_DATA)/look_small/train
STAGE1_SHARDS = $(LOOK_SHARDS),$(DEMO_DATA)/count_multi/train
STAGE2_SHARDS = $(TASK_SHARDS),$(DEMO_DATA)/count_multi/train
# Extra `--set` overrides for stage 1a, which builds the model, and stage 2 (stages 1b and 2 inherit the model from
# the export before them), e.g. make demo STAGE2_SET="--set train.max_steps=550"; a second seed: make demo SEED=1
STAGE1_SET ?=
STAGE2_SET ?=
# Stage 0: the tower learns every attribute a caption names (scripts/pretrain_vision.py --objective multilabel, two
# single-threaded processes under torchrun: faster on 2 cores than one process with two threads);
# its steps. SEED seeds every stage (stage 0's --seed, train.seed of the others; TOWER_SEED: stage 0's alone).
SEED ?= 0
TOWER_STEPS ?= 2400
# The tower's architecture (stage 1a must build the same: stage1_colour.yaml's model.overrides, or STAGE1_SET), e.g.
# the preset's narrower tower of docs/seeing.md: make demo TOWER_SET="--set 'vision_stem=\"conv\"'"
# STAGE1_SET="--set model.overrides.vision_embed_dim=64 --set model.overrides.vision_heads=2"
# REGION_LABELS: stage 0's --region-labels 10, every patch in an object's box names that object at 10 times the
# caption's weight: the tower's word head then names every object of a scene (shape on 0.88 of them, against 0.56 at
# weight 1), and from stage 1a on each image token is the embeddings of its patches' words alone
# (stage1_colour.yaml: vision_words, no projector; docs/seeing.md, "Initialisation"). Empty: caption words alone
# (then stage 1a needs STAGE1_SET="--set model.overrides.vision_words=false ..." and a projector).
TOWER_SET ?= --set 'vision_stem="conv"' --set vision_embed_dim=128 --set vision_heads=4
REGION_LABELS ?= --region-labels 10
TOWER_SEED ?= $(SEED)
# Its captioned scenes: one object of 12-95% of the short side, and as many scenes of 1-3 objects, whose region
# labels teach the word head to name each object of a scene apart (docs/seeing.md, "Binding", "Initialisation").
TOWER_SHARDS ?= $(DEMO_DATA)/vision/train $(DEMO_DATA)/vision_multi/train
# TEXT_STAGE=1: a text stage between stage 0 and stage 1a (scripts/configs/stage0_text.yaml, TEXT_STEPS steps on the
# copying_chat shards: the language model learns to copy, with tied embeddings, the stage-0 tower loaded and frozen);
# stage 1a then starts from its export. `make instruct-long` sets it, so that its stage 2 learns the needles;
# `make demo` has no minutes for it (docs/seeing.md, "Copying a needle").
TEXT_STAGE ?=
TEXT_STEPS ?= 3000
# BIND_STAGE=1: a binding stage between stage 1b and stage 2 (scripts/configs/stage_bind.yaml, BIND_STEPS steps of
# colour / shape / position questions about a named object among 1-5 objects, and count questions); stage 2 then
# starts from its export. `make instruct-bind` sets it (docs/seeing.md, "Binding in the recipe").
BIND_STAGE ?=
BIND_STEPS ?= 3600
# Shards added to the binding stage's mix (a leading comma; `make instruct-copy-bind`: some of the copy requests).
BIND_EXTRA ?=
BIND_SHARDS = test -f $(DEMO_DATA)/bind/train/manifest.json || $(BIN)/python scripts/make_shards.py \
	--synthetic scenes_chat --option types=colour,shape,position --out $(DEMO_DATA)/bind --num-samples 40000 \
	--seed 13 --max-count 250
BIND_CMD = $(DS) --config scripts/configs/stage_bind.yaml --out $(DEMO_RUN)/stage_bind \
	--set model.init_from=$(DEMO_RUN)/stage1/hf \
	--set 'data.shards=[$(DEMO_DATA)/bind/train,$(DEMO_DATA)/count_multi/train$(BIND_EXTRA)]' \
	--set 'data.eval_shards=[$(DEMO_DATA)/bind/eval]' --set train.max_steps=$(BIND_STEPS) --set train.seed=$(SEED)
# ... and stage 2 keeps asking them: 24 of the binding shards (6,000 conversations; 24 of its 84 shards). Without
# them stage 2's 300 steps on the task mix lower shape of the named colour from 0.82 to 0.76 and position from 0.59 to
# 0.48 (docs/seeing.md, "Binding in the recipe").
BIND_KEEP = ,"$(DEMO_DATA)/bind/train/train-{000000..000023}.tar"
# cmoe_sceneqa's scenes (one question per type each): the demo's 60 (213 questions), 300 for `make instruct-bind`
# (1,073 questions, of which lmms-eval's --limit scores the first 800: its binding rows need more than the demo's 42
# colour questions).
SCENEQA_N ?= 60
# Extra `--set` overrides for the text stage, which then builds the model; WORDS_SET: the words-alone image tokens.
TEXT_SET ?=
WORDS_SET := --set model.overrides.vision_words=true --set model.overrides.vision_projector=false \
	--set model.overrides.vision_summary=false
TEXT_CMD = $(DS) --config scripts/configs/stage0_text.yaml --out $(DEMO_RUN)/stage0_text \
	--set 'data.shards=[$(DEMO_DATA)/copying/train]' --set 'data.eval_shards=[$(DEMO_DATA)/copying/eval]' \
	--set model.overrides.vision_weights=$(DEMO_RUN)/tower/tower.safetensors --set train.max_steps=$(TEXT_STEPS) \
	--set train.seed=$(SEED) $(TEXT_SET)
FROM_TEXT = --set model.init_from=$(DEMO_RUN)/stage0_text/hf \
	--set 'model.overrides={"freeze_vision": true, "freeze_backbone": false}'
COPYING_SHARDS = test -f $(DEMO_DATA)/copying/train/manifest.json || $(BIN)/python scripts/make_shards.py \
	--synthetic copying_chat --out $(DEMO_DATA)/copying --num-samples 50000 --eval-samples 500 --seed 0
# Text-needle haystacks of 4-9 units (the cmoe_niah short bucket has 8), answers restating the needle: make needles'
# 4,000, instruct-long's 1,000 (needles_long, another seed).
TEXT_NEEDLES = $(BIN)/python scripts/make_shards.py --synthetic needles_chat --option min_units=4 --option max_units=9 \
	--option modalities=text --max-count 250
NEEDLE_SHARDS = test -f $(DEMO_DATA)/needles_text/train/manifest.json || $(TEXT_NEEDLES) \
	--out $(DEMO_DATA)/needles_text --num-samples 4000 --eval-samples 200 --seed 7
TASK_SAMPLES := 1000
# Every doc of every task (the largest, cmoe_sceneqa_one, has 800).
EVAL_LIMIT := 800
EVAL_TASKS := cmoe_sceneqa_one,cmoe_sceneqa,cmoe_refloc,cmoe_niah,cmoe_longdoc
# The task definitions plus their generated data (data/ is git-ignored), relative to the repository root.
EVAL_DIR := eval/tasks
# The launcher's rendezvous port: a second run on this host needs another one (`make demo MASTER_PORT=29611`).
MASTER_PORT ?= 29500
DS := $(BIN)/deepspeed --num_gpus 2 --master_port $(MASTER_PORT) scripts/train_vlm.py \
	--deepspeed scripts/configs/zero2.json
# One-object scene questions (scenes_chat with the generator's options): LOOK = colour / shape / position only.
ONE := $(BIN)/python scripts/make_shards.py --synthetic scenes_chat --option max_objects=1
LOOK := --option types=colour,shape,position
# The shards every stage trains on, stage 0's captioned scenes too (the question shards made beside stage 0 instead,
# on 2 cores, the demo took 6 s longer).
demo-shards: venv
	test -f $(DEMO_DATA)/look_colour/train/manifest.json || $(ONE) --option types=colour \
		--option object_size=0.45,0.95 --out $(DEMO_DATA)/look_colour --num-samples 4000 --seed 4
	test -f $(DEMO_DATA)/look/train/manifest.json || $(ONE) $(LOOK) --option object_size=0.45,0.95 \
		--out $(DEMO_DATA)/look --num-samples 12000 --seed 0
	test -f $(DEMO_DATA)/look_small/train/manifest.json || $(ONE) $(LOOK) \
		--out $(DEMO_DATA)/look_small --num-samples 6000 --seed 2 --max-count 250
	test -f $(DEMO_DATA)/one/train/manifest.json || $(ONE) \
		--out $(DEMO_DATA)/one --num-samples 3000 --seed 1 --max-count 250
	test -f $(DEMO_DATA)/tasks/train/manifest.json || $(BIN)/python scripts/make_shards.py \
		--synthetic scenes_chat,documents_chat,needles_chat --option min_units=4 --option max_units=9 \
		--out $(DEMO_DATA)/tasks --num-samples $(TASK_SAMPLES) --seed 0 --max-count 250
	test -f $(DEMO_DATA)/count_multi/train/manifest.json || $(BIN)/python scripts/make_shards.py --synthetic scenes_chat \
		--option types=count --out $(DEMO_DATA)/count_multi --num-samples 3000 --seed 11 --max-count 250
	test -f $(DEMO_DATA)/vision/train/manifest.json || $(BIN)/python scripts/make_shards.py --synthetic scenes \
		--option max_objects=1 --option object_size=0.12,0.95 --out $(DEMO_DATA)/vision --num-samples 6000 --seed 3
	test -f $(DEMO_DATA)/vision_multi/train/manifest.json || $(BIN)/python scripts/make_shards.py \
		--synthetic scenes --option max_objects=3 --out $(DEMO_DATA)/vision_multi --num-samples 6000 --seed 5
# Stage 0 alone, when $(DEMO_RUN)/tower/tower.safetensors is missing, and the linear probes of what it carries: the
# one command the demo and the staged studies (scripts/configs/study_staged.yaml, spatial_staged.yaml) run for it.
demo-tower: venv demo-shards
	test -f $(DEMO_RUN)/tower/tower.safetensors || $(BIN)/torchrun --standalone --nproc_per_node 2 \
		scripts/pretrain_vision.py --objective multilabel \
		--shards $(TOWER_SHARDS) --eval-shards $(DEMO_DATA)/vision/eval --steps $(TOWER_STEPS) \
		--batch-size 32 --eval-every $(TOWER_STEPS) --log-every 100 $(TOWER_SET) $(REGION_LABELS) --threads 1 \
		--seed $(TOWER_SEED) --out $(DEMO_RUN)/tower/tower.safetensors
	test -f $(DEMO_RUN)/tower/probe.json || $(BIN)/python scripts/probe_tower.py $(DEMO_RUN)/tower/tower.safetensors \
		--threads 2 --binding $(if $(strip $(REGION_LABELS)),--words) --json $(DEMO_RUN)/tower/probe.json
demo: venv demo-shards
	rm -rf $(DEMO_RUN)
	$(MAKE) demo-tower DEMO_RUN=$(DEMO_RUN)
	$(if $(TEXT_STAGE),$(COPYING_SHARDS) && $(TEXT_CMD))
	$(DS) --config scripts/configs/stage1_colour.yaml --out $(DEMO_RUN)/stage1_colour \
		--set 'data.shards=[$(DEMO_DATA)/look_colour/train]' \
		--set model.overrides.vision_weights=$(DEMO_RUN)/tower/tower.safetensors --set train.seed=$(SEED) $(STAGE1_SET) \
		$(if $(TEXT_STAGE),$(FROM_TEXT))
	$(DS) --config scripts/configs/stage1.yaml --out $(DEMO_RUN)/stage1 \
		--set model.init_from=$(DEMO_RUN)/stage1_colour/hf \
		--set 'data.shards=[$(STAGE1_SHARDS)]' \
		--set train.seed=$(SEED)
	$(if $(BIND_STAGE),$(BIND_SHARDS) && $(BIND_CMD))
	$(DS) --config $(STAGE2) --out $(DEMO_RUN)/stage2 \
		--set model.init_from=$(DEMO_RUN)/$(if $(BIND_STAGE),stage_bind,stage1)/hf \
		--set 'data.shards=[$(STAGE2_SHARDS)$(if $(BIND_STAGE),$(BIND_KEEP))]' \
		--set 'data.eval_shards=[$(DEMO_DATA)/tasks/eval]' \
		--set train.seed=$(SEED) $(STAGE2_SET)
	$(BIN)/python scripts/r_report.py $(DEMO_RUN)/stage2
	$(MAKE) demo-eval DEMO_RUN=$(DEMO_RUN)
	$(BIN)/python scripts/show_concepts.py --model $(DEMO_RUN)/stage2/hf --shards '$(DEMO_DATA)/tasks/eval/*.tar' \
		--index 0 --out $(DEMO_RUN)/concepts.png --html
	@echo "shards:        $(DEMO_DATA)/{vision,vision_multi,look_colour,look,look_small,one,tasks,count_multi}/{train,eval} (manifest.json in each)"
	@echo "tower:         $(DEMO_RUN)/tower/tower.safetensors (stage 0; .json: settings, held-out R-precision;"
	@echo "               probe.json: what it carries, linear probes of colour / shape / position / binding)"
	@echo "metrics:       $(DEMO_RUN)/stage{1_colour,1,2}/metrics.jsonl (TensorBoard: tb/ beside them)"
	@echo "HF exports:    $(DEMO_RUN)/stage{1_colour,1,2}/hf (AutoProcessor / AutoModelForImageTextToText, pipeline)"
	@echo "R report:      $(DEMO_RUN)/stage2/r_report.json, .png"
	@echo "lmms-eval:     $(DEMO_RUN)/eval (results, samples, R per task: r_report.json / .png)"
	@echo "scores:        $(DEMO_RUN)/eval/score_table.md (score, chance, eval-mode R total / text / image)"
	@echo "concepts:      $(DEMO_RUN)/concepts.png, .html (what the chunker merged in one held-out sample)"

# The demo's evaluation alone, of the export $(DEMO_RUN)/stage2/hf (e.g. make demo-eval DEMO_RUN=runs/demo_s1 after a
# change to the tasks or the plugin): the tasks' data (rebuilt only when missing or built with other sizes), lmms-eval
# on all of it (200 one-object scenes, each asked colour / shape / position / count: 200 items per question type),
# the R report per task and the score table.
demo-eval: venv demo-eval-data
	$(BIN)/python -m lmms_eval --model conceptmoe --model_args pretrained=$(DEMO_RUN)/stage2/hf \
		--tasks $(EVAL_TASKS) --include_path $(EVAL_DIR) --batch_size 8 --limit $(EVAL_LIMIT) \
		--output_path $(DEMO_RUN)/eval --log_samples --verbosity DEBUG
	$(BIN)/python scripts/r_report.py $(DEMO_RUN)/eval
	$(BIN)/python scripts/score_table.py $(DEMO_RUN)/eval --tasks-dir $(EVAL_DIR)

# The tasks' data the demo is scored on (a task already built with these options is kept): the one command the demo
# and the staged studies (their eval.command) run for it.
demo-eval-data: venv
	$(BIN)/python scripts/make_eval_data.py --keep --out $(EVAL_DIR) --longdoc-pages 1,4 --longdoc-per-bucket 50 \
		--niah-lengths short --niah-per-bucket 100 --refloc-n 200 --sceneqa-n $(SCENEQA_N) --sceneqa-one-n 200

# Its stage 2 also reads 1,000 text-needle haystacks, like those `make needles` trains on. Its stage 0 keeps the
# caption words alone (REGION_LABELS empty) and its model is the text stage's (stage0_text.yaml: projector tokens
# with the image's summary, initialisation std 0.02, at which tied embeddings learn to copy), as measured in
# docs/benchmarks.md; stages 1b and 2 keep the shards they were measured with (no count_multi). With `make demo`'s
# words-alone tokens (TEXT_SET="$(WORDS_SET)", REGION_LABELS="--region-labels 10") the words bind after the copy
# steps in the probe, but in the one run so far its text stage did not learn the copy in 2,500 steps
# (docs/seeing.md, "Copying, then binding").
instruct-long: venv
	test -f $(DEMO_DATA)/scenes_chat/train/manifest.json || $(BIN)/python scripts/make_shards.py \
		--synthetic scenes_chat --out $(DEMO_DATA)/scenes_chat --num-samples 8000 --eval-samples 200 --seed 1
	test -f $(DEMO_DATA)/needles_long/train/manifest.json || $(TEXT_NEEDLES) \
		--out $(DEMO_DATA)/needles_long --num-samples 1000 --eval-samples 100 --seed 8
	$(MAKE) demo DEMO_RUN=runs/instruct-long STAGE2=scripts/configs/stage2_long.yaml TEXT_STAGE=1 TEXT_STEPS=2500 \
		REGION_LABELS= STAGE1_SHARDS=$(LOOK_SHARDS) \
		STAGE2_SHARDS=$(TASK_SHARDS),$(DEMO_DATA)/scenes_chat/train,$(DEMO_DATA)/needles_long/train

# Binding among several objects: `make demo`'s stages (the same stage-0 tower, words-alone image tokens) with each
# modality held at R = 2 by its own ratio objective (target_r_by_modality: the image tokens are no longer merged
# into one or two concepts) and the concept norm starting at gain 0.1 (concept_norm_init), then a binding stage
# (BIND_STAGE=1, stage_bind.yaml) before stage 2, whose mix keeps some of its shards (BIND_KEEP) for twice the demo's
# steps (BIND_STAGE2_SET), scored on 800 of 1,073 scene questions (docs/seeing.md, "Binding in the recipe"). 39 min
# on 2 cores from a fresh clone.
BIND_MODEL_SET := --set 'model.overrides.target_r_by_modality={0: 2.0, 1: 2.0}' \
	--set model.overrides.concept_norm_init=0.1
BIND_STAGE2_SET := --set train.max_steps=600 --set train.save_every=300 --set train.eval_every=300
instruct-bind: venv
	$(MAKE) demo DEMO_RUN=runs/instruct-bind BIND_STAGE=1 SCENEQA_N=300 STAGE1_SET="$(BIND_MODEL_SET) $(STAGE1_SET)" \
		STAGE2_SET="$(BIND_STAGE2_SET) $(STAGE2_SET)"

# Copying and binding in one recipe: `make instruct-bind` with the text stage first (TEXT_STAGE=1, 2,500 steps: the
# language model learns to copy; it builds the model with the words-alone tokens and instruct-bind's model settings),
# 5 of its 50 shards of copy requests kept in the binding stage's and stage 2's mixes (COPY_KEEP: without them the
# copy is gone after stage 1a's 40 steps, held-out copy loss 1.2 -> 9.7), and stage 2's rows long enough for the
# needle haystacks (1,280 tokens) with 1,000 text-needle haystacks in its mix (docs/seeing.md, "Copying and binding
# in one recipe": seed 0 finds 0.818 of the text needles, seed 1 0.055). 60 min on 2 cores from a fresh clone.
COPY_KEEP = ,"$(DEMO_DATA)/copying/train/train-{000000..000004}.tar"
COPY_BIND_TEXT_SET := $(WORDS_SET) $(BIND_MODEL_SET)
COPY_BIND_STAGE2_SET := $(BIND_STAGE2_SET) --set data.seq_len=1280 --set data.batch_size=2
instruct-copy-bind: venv
	test -f $(DEMO_DATA)/needles_long/train/manifest.json || $(TEXT_NEEDLES) \
		--out $(DEMO_DATA)/needles_long --num-samples 1000 --eval-samples 100 --seed 8
	$(MAKE) demo DEMO_RUN=runs/instruct-copy-bind TEXT_STAGE=1 TEXT_STEPS=2500 BIND_STAGE=1 SCENEQA_N=300 \
		TEXT_SET="$(COPY_BIND_TEXT_SET) $(TEXT_SET)" STAGE2_SET="$(COPY_BIND_STAGE2_SET) $(STAGE2_SET)" \
		BIND_EXTRA='$(COPY_KEEP)' STAGE2_SHARDS='$(STAGE2_SHARDS),$(DEMO_DATA)/needles_long/train$(COPY_KEEP)'

# Needles in text: the language model learns to copy (scripts/configs/stage0_text.yaml: "repeat the line that starts
# with ...", tied input / output embeddings, 3,000 steps), then to find a needle and restate its sentence
# (scripts/configs/stage_needles.yaml: text needles in haystacks of 4-9 units, 800 steps), each with 2-process
# DeepSpeed -> HF export -> lmms-eval cmoe_niah (the short bucket) -> score table: acc_text is the text needles';
# acc_image those drawn inside images, which this recipe never learns to read (its tower is random and frozen).
# About 33 min on 2 cores (docs/seeing.md, "Copying a needle").
NEEDLES_RUN := runs/needles
needles: venv
	$(COPYING_SHARDS)
	$(NEEDLE_SHARDS)
	rm -rf $(NEEDLES_RUN)
	$(DS) --config scripts/configs/stage0_text.yaml --out $(NEEDLES_RUN)/stage0_text --set train.seed=$(SEED)
	$(DS) --config scripts/configs/stage_needles.yaml --out $(NEEDLES_RUN)/stage_needles \
		--set model.init_from=$(NEEDLES_RUN)/stage0_text/hf --set train.seed=$(SEED)
	$(BIN)/python scripts/make_eval_data.py --keep --out $(EVAL_DIR) --tasks cmoe_niah --niah-lengths short \
		--niah-per-bucket 100
	$(BIN)/python -m lmms_eval --model conceptmoe --model_args pretrained=$(NEEDLES_RUN)/stage_needles/hf \
		--tasks cmoe_niah --include_path $(EVAL_DIR) --batch_size 8 --limit $(EVAL_LIMIT) \
		--output_path $(NEEDLES_RUN)/eval --log_samples --verbosity DEBUG
	$(BIN)/python scripts/r_report.py $(NEEDLES_RUN)/eval
	$(BIN)/python scripts/score_table.py $(NEEDLES_RUN)/eval --tasks-dir $(EVAL_DIR)

# The compute-matched study (scripts/configs/study.yaml): every arm trained and evaluated as above, one table, plots
# and a verdict per claim in docs/study.md (~75 min on 2 CPU cores: the YAML's budget_minutes; resumes;
# e.g. `make study STUDY_ARGS="--budget-minutes 30"`).
STUDY_ARGS ?=
study: venv
	$(BIN)/python scripts/study.py --config scripts/configs/study.yaml $(STUDY_ARGS)

# The same study on `make demo`'s stages (scripts/configs/study_staged.yaml: stage 0's tower once, then every arm
# through stages 1a, 1b and 2, scored on one-object and 1-5-object scene questions) in docs/study_staged.md
# (~95 min on 2 CPU cores for 4 arms x 3 seeds, the tower and shards made when missing; resumes like `make study`).
study-staged: venv
	$(BIN)/python scripts/study.py --config scripts/configs/study_staged.yaml $(STUDY_ARGS)

# Spatially aware image chunking on `make demo`'s stages (scripts/configs/spatial_staged.yaml: raster against rows and
# router2d, scored on the position questions of one-object and 1-5-object scenes) in docs/spatial_staged.md (~40 min
# on 2 CPU cores beside study-staged, whose tower and moe / r2 runs it can reuse; see the YAML).
spatial-staged: venv
	$(BIN)/python scripts/study.py --config scripts/configs/spatial_staged.yaml $(STUDY_ARGS)

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
