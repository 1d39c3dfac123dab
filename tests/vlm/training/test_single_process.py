"""A short CPU training of the `tiny` preset on real local text: the loss falls and R settles at the target."""

import pytest
import torch

from data_pipelines.local_text import ByteTokenizer, load_local_text_corpus, packed_batches
from vlm import ConceptMoEConfig, ConceptMoEForCausalLM
from vlm.training.single_process import LocalEngine, TrainConfig, evaluate, train
from vlm.training.step import set_lr


def test_tiny_training_loss_falls_and_r_reaches_target():
    torch.manual_seed(0)
    corpus, tok = load_local_text_corpus(), ByteTokenizer()
    config = ConceptMoEConfig.from_preset("tiny", vocab_size=tok.vocab_size)
    assert config.target_r == 2.0 and config.ratio_loss_weight == 0.3
    model = ConceptMoEForCausalLM(config)
    history = train(
        model,
        packed_batches(corpus["train"], tok, 256, 8, seed=0),
        TrainConfig(max_steps=200, save_every=200, seed=0, warmup=20),
    )

    first = sum(h["lm_loss"] for h in history[:10]) / 10
    last = sum(h["lm_loss"] for h in history[-20:]) / 20
    assert last < first - 1.5, (first, last)
    train_r = sum(h["r"] for h in history[-50:]) / 50
    assert abs(train_r - 2.0) <= 0.2, train_r
    held_out = evaluate(model, packed_batches(corpus["eval"], tok, 256, 8, seed=0), n_batches=4)
    assert abs(held_out["eval_r"] - 2.0) <= 0.2, held_out
    assert held_out["eval_bits_per_token"] < 4.5  # a uniform guess over bytes is 8 bits
    assert held_out["eval_r_text"] == held_out["eval_r"] and held_out["eval_r_image"] is None  # text only
    assert model.training  # evaluate puts the model back in the mode it found it in


def test_the_boundary_router_trains_at_its_own_lr_scale():
    """``optimizer_groups`` puts exactly the chunk module's router in its own group; ``set_lr`` gives it
    ``lr * router_lr_scale`` (the DeepSpeed path: tests/vlm/training/test_ds_config.py)."""

    model = ConceptMoEForCausalLM(ConceptMoEConfig.from_preset("tiny"))
    engine = LocalEngine(model, lr=1e-2, router_lr_scale=0.1)
    main, router = engine.optimizer.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in router["params"]) == sorted(n for n in names.values() if ".chunker." in n)
    assert len(main["params"]) + len(router["params"]) == len(names)
    assert set_lr(engine.optimizer, 4e-3) == 4e-3 and (main["lr"], router["lr"]) == pytest.approx((4e-3, 4e-4))
    plain = LocalEngine(ConceptMoEForCausalLM(ConceptMoEConfig.from_preset("tiny-moe")), lr=1e-2)
    assert len(plain.optimizer.param_groups) == 1  # no chunking, no router group
