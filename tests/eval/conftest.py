"""Session fixtures of the evaluation tests: a tiny exported checkpoint and small generated eval sets."""

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``ConceptMoEVLM.from_preset("tiny")`` + the shipped tokenizer, saved as vlm/training/export.py does."""
    from data_pipelines.tokenizer import load_tokenizer
    from vision_tower import ImageProcessor
    from vlm import ConceptMoEVLM, VLMProcessor

    torch.manual_seed(0)
    processor = VLMProcessor(load_tokenizer(), ImageProcessor(max_patches=64))
    model = ConceptMoEVLM.from_preset(
        "tiny", image_token_id=processor.image_token_id, vocab_size=len(processor.tokenizer), max_patches=64
    )
    out = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


SMALL_SETS = dict(
    longdoc_per_bucket=1,
    longdoc_pages=(1, 2),
    niah_per_bucket=2,
    niah_lengths=("short",),
    refloc_n=3,
    sceneqa_n=3,
    sceneqa_one_n=3,
)


@pytest.fixture(scope="session")
def small_sets():
    """The sizes of the session's eval sets (1-2 page documents, 2 short haystacks, 3 scenes for refloc, 3 for
    sceneqa, 3 one-object scenes for sceneqa_one)."""
    return dict(SMALL_SETS)


@pytest.fixture(scope="session")
def eval_tasks_dir(tmp_path_factory):
    """The five tasks (YAML, utils.py, data) in a temporary include path, small sizes, seed 0."""
    from eval.eval_data import write_eval_sets

    out = tmp_path_factory.mktemp("tasks")
    write_eval_sets(out, seed=0, **SMALL_SETS)
    return out
