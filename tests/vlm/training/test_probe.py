"""The seeing probe (``vlm.training.probe``): a tiny VLM must learn to read a small object's colour.

This is the convergence test that keeps a later change from silently blinding the toolkit's models (issue #25):
every model the toolkit trained before it answered one constant per question type.
"""

import math

from vlm.training.probe import ProbeConfig, SeeingProbe, Stage


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1))


def test_a_tiny_vlm_reads_a_small_objects_colour_after_a_size_curriculum():
    """Colour questions about one small object (12-42% of the short side, the generator's own sizes), held out;
    training sees large objects, then medium ones (the curriculum of docs/seeing.md). A blind model scores the
    best constant answer ("chance"): the score must beat it by a margin a binomial test at 1e-4 calls significant."""
    cfg = ProbeConfig(
        types=("colour",),
        stages=[Stage(0, 1, (0.6, 0.95)), Stage(60, 1, (0.3, 0.6))],
        steps=120,
        eval_every=120,
        eval_n=96,
        seed=0,
    )
    (score,) = SeeingProbe(cfg).run()
    n = cfg.eval_n
    right = round(score.accuracy["colour"] * n)
    assert score.chance["colour"] < 0.25 and score.distinct["colour"] > 3, score  # 8 colours, none dominant
    assert binomial_tail(right, n, score.chance["colour"]) < 1e-4, score
    assert score.r["image"] == 1.0 and score.r["text"] == 1.0  # tiny-moe: no chunking, every token its own concept
