"""``train.expert_parallel: 2`` through the real launcher: 2 DeepSpeed processes (gloo, ZeRO-2), the tiny VLM with
chunking on. The losses of 20 steps equal the data-parallel run (``expert_parallel: 1``) step by step; a resume at
EP 2 repeats the uninterrupted run; the export gathers every rank's experts into one ordinary HF model; a checkpoint
does not resume at another EP; one-line refusals of settings that cannot split."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file
from train_kit import run_train, step_records

from vlm.model import ConceptMoEVLM
from vlm.training.checkpoint import CheckpointError, check_same_expert_parallel
from vlm.training.config import ConfigError
from vlm.training.expert_parallel import (
    SHARD_FILE,
    check_expert_parallel,
    gather_expert_shards,
    saved_expert_parallel,
    split_expert_state,
)

STEPS = 20
EIGHT_EXPERTS = {"model.overrides.concept_num_experts": 8}  # tiny's concept model has 7: not divisible by 2


def ep_run(run_dir, shards, ep: int, **train):
    args = dict(launcher="deepspeed", zero=2, max_steps=STEPS, save_every=10, eval_every=10, export="false")
    args["expert_parallel"] = ep
    sets = [f"--set={k}={v}" for k, v in EIGHT_EXPERTS.items()]
    return run_train(run_dir, shards, flags=sets, **{**args, **train})


@pytest.fixture(scope="module")
def runs(shards, tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    return {ep: (root / f"ep{ep}", ep_run(root / f"ep{ep}", shards, ep)) for ep in (1, 2)}


def test_expert_parallel_losses_equal_data_parallel(runs):
    one, two = step_records(runs[1][0]), step_records(runs[2][0])
    assert sorted(two) == list(range(1, STEPS + 1))
    for step in one:
        for key in ("loss", "lm_loss", "balance_loss", "ratio_loss"):
            assert two[step][key] == pytest.approx(one[step][key], abs=1e-5), (step, key)
        assert two[step]["concepts"] == one[step]["concepts"]
    evals = [
        {
            r["step"]: r
            for r in map(json.loads, (runs[ep][0] / "metrics.jsonl").read_text().splitlines())
            if r.get("split") == "eval"
        }
        for ep in (1, 2)
    ]
    assert sorted(evals[1]) == [10, 20]  # the held-out eval runs its forwards on every rank, exchanges included
    for step in (10, 20):
        assert evals[1][step]["eval_loss"] == pytest.approx(evals[0][step]["eval_loss"], abs=1e-5)
    log = runs[2][1].stdout + runs[2][1].stderr
    held, total = map(int, re.search(r"holds (\d+) of the (\d+) expert parameters", log).groups())
    assert 2 * held == total  # rank 0 keeps exactly half of every layer's experts


def test_checkpoint_holds_each_ranks_experts_and_export_gathers_them(runs, tmp_path):
    folder = runs[2][0] / "checkpoints" / "step_00000020"
    assert saved_expert_parallel(folder) == 2 and saved_expert_parallel(runs[1][0] / "checkpoints/step_00000020") == 1
    shards = [load_file(folder / SHARD_FILE.format(rank=r)) for r in range(2)]
    from vlm.training.export import export_checkpoint, full_state_dict

    state = full_state_dict(str(runs[2][0] / "checkpoints"), "step_00000020")
    for key in shards[0]:
        assert state[key].shape[0] == 8
        torch.testing.assert_close(state[key], torch.cat([shards[0][key], shards[1][key]]), rtol=0, atol=0)
    # EP 1 -> 2 -> 1 conversion of the weights is exact
    again = gather_expert_shards({**state}, folder)
    split = split_expert_state(again, 2)
    assert all(torch.equal(split[r][k], shards[r][k]) for r in range(2) for k in shards[r])

    out = export_checkpoint(str(runs[2][0]), out_dir=str(tmp_path / "hf2"))
    reference = export_checkpoint(str(runs[1][0]), out_dir=str(tmp_path / "hf1"))
    model, base = ConceptMoEVLM.from_pretrained(out).eval(), ConceptMoEVLM.from_pretrained(reference).eval()
    ids = torch.randint(0, 400, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, base(input_ids=ids).logits, rtol=0, atol=1e-3)


def test_resume_at_ep2_repeats_the_uninterrupted_run(runs, shards, tmp_path):
    run = tmp_path / "resumed"
    shutil.copytree(runs[2][0], run)
    ep_run(run, shards, 2, resume=str(run / "checkpoints" / "step_00000010"))
    resumed, straight = step_records(run), step_records(runs[2][0])
    for step in range(11, STEPS + 1):
        assert resumed[step]["loss"] == pytest.approx(straight[step]["loss"], abs=1e-6), step


def test_a_checkpoint_does_not_resume_at_another_expert_parallel(runs):
    model = ConceptMoEVLM.from_preset("tiny", concept_num_experts=8)  # experts not split: EP 1
    with pytest.raises(CheckpointError, match=r"expert_parallel=2; this run has 1"):
        check_same_expert_parallel(str(runs[2][0] / "checkpoints" / "step_00000020"), model)
    check_same_expert_parallel(str(runs[1][0] / "checkpoints" / "step_00000020"), model)  # EP 1 on both sides


@pytest.mark.parametrize(
    "size, world, overrides, stage, why",
    [
        (2, 2, {}, 2, r"divide every layer's num_experts \(here \[7, 8\]\)"),
        (2, 3, EIGHT_EXPERTS, 2, "divide the number of processes"),
        (2, 2, EIGHT_EXPERTS, 3, "stages 0-2"),
        (2, 2, {"ffn": "dense"}, 2, "needs MoE layers"),
    ],
)
def test_settings_that_cannot_split_are_one_line_errors(size, world, overrides, stage, why):
    fields = {k.rsplit(".", 1)[-1]: v for k, v in overrides.items()}
    model = ConceptMoEVLM.from_preset("tiny", **fields)
    with pytest.raises(ConfigError, match=why) as err:
        check_expert_parallel(model, size, world, stage)
    assert "\n" not in str(err.value)
