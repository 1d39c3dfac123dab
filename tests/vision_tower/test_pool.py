"""AttentionPool (the tower's summary pool) and VisionTower(summary=True): what the summary may and may not read."""

# Shape suffixes: B images, L patches per image, D feature width.

import pytest
import torch
from safetensors.torch import save_file

from vision_tower import VisionTower
from vision_tower.pool import AttentionPool, pool_heads


def test_pool_reads_only_valid_patches_in_any_order():
    torch.manual_seed(0)
    pool = AttentionPool(12).eval()
    feats_BLD = torch.randn(2, 5, 12)
    valid_BL = torch.tensor([[True, True, True, False, False], [True] * 5])
    out_BD = pool(feats_BLD, valid_BL)
    noisy_BLD = feats_BLD.clone()
    noisy_BLD[0, 3:] = 1e3  # padding slots: whatever they hold, image 0's summary ignores them
    perm = torch.tensor([4, 2, 0, 3, 1])  # attention pooling has no order: image 1's patches shuffled
    shuffled_BLD = torch.stack([noisy_BLD[0], feats_BLD[1, perm]])
    torch.testing.assert_close(pool(shuffled_BLD, valid_BL), out_BD)
    assert not torch.allclose(out_BD[0], out_BD[1])
    empty = pool(torch.zeros(1, 3, 12), torch.zeros(1, 3, dtype=torch.bool))  # no valid patch: finite, not NaN
    assert torch.isfinite(empty).all() and pool_heads(12) == 6 and pool_heads(7) == 7


def test_tower_summary_pool_travels_with_its_weights_file(tmp_path):
    sizes = dict(embed_dim=32, depth=1, num_heads=2, patch_size=8, stem="conv")
    torch.manual_seed(0)
    source = VisionTower(**sizes, summary=True)
    path = tmp_path / "tower.safetensors"
    state = {k: v.contiguous() for k, v in source.state_dict().items()}  # model.* and summary_pool.* keys
    save_file(state, str(path))
    loaded = VisionTower(**sizes, summary=True, weights=path)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert VisionTower(**sizes, weights=path).summary_pool is None  # a tower without summary ignores the pool
    save_file({k: v for k, v in state.items() if k.startswith("model.")}, str(path))
    with pytest.raises(ValueError, match="needs the summary pool's weights"):
        VisionTower(**sizes, summary=True, weights=path)
    with pytest.raises(ValueError, match="build it with summary=True"):
        VisionTower(**sizes).summarize(None)
