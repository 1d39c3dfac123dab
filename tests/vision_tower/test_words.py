"""WordHead and word_embeddings: image tokens carrying the text embeddings of the words their patches detect."""

# Shape suffixes: B images, L patches per image, T merged tokens, l patches per token, K words, V vocabulary, E width.

import pytest
import torch
from safetensors.torch import save_file

from vision_tower import VisionTower
from vision_tower.words import WordHead, word_embeddings

SIZES = dict(embed_dim=32, depth=1, num_heads=2, patch_size=8, stem="conv")


def test_word_embeddings_is_the_loop_definition():
    """Token t gets sum_k (max over its patches l of p[t, l, k]) * E[ids[k]]."""
    torch.manual_seed(0)
    probs_TlK, embedding_VE = torch.rand(5, 4, 3), torch.randn(11, 6)
    ids_K = torch.tensor([7, 2, 9])
    expected_TE = torch.zeros(5, 6)
    for t in range(5):
        for k in range(3):
            expected_TE[t] += max(probs_TlK[t, :, k].tolist()) * embedding_VE[ids_K[k]]
    torch.testing.assert_close(word_embeddings(probs_TlK, ids_K, embedding_VE), expected_TE)
    with pytest.raises(ValueError, match="outside the language model's 8 embeddings"):
        word_embeddings(probs_TlK, ids_K, embedding_VE[:8])


def test_word_head_refuses_an_empty_or_negative_vocabulary():
    for ids in ([], [3, -1]):
        with pytest.raises(ValueError, match="non-empty list of token ids"):
            WordHead(8, ids)


def test_word_head_travels_with_the_tower_file_and_is_silent_on_padding(tmp_path):
    torch.manual_seed(0)
    source = VisionTower(**SIZES, summary=True)
    source.add_word_head([5, 17, 40])
    path = tmp_path / "tower.safetensors"
    state = {k: v.contiguous() for k, v in source.state_dict().items()}  # model.*, summary_pool.*, word_head.*
    save_file(state, str(path))
    loaded = VisionTower(**SIZES, summary=True, words=True, weights=path)  # the count read from the file
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert loaded.word_head.ids_K.tolist() == [5, 17, 40]
    assert VisionTower(**SIZES, weights=path).word_head is None  # a tower without words ignores the head
    assert VisionTower(**SIZES, words=3).word_head.num_words == 3  # built to size, for a saved VLM to fill
    patches = torch.rand(2, 4, 8 * 8 * 3)
    coord = torch.tensor([[0, 0], [0, 1], [1, 0], [1, 1]]).expand(2, 4, 2)
    valid = torch.tensor([[True] * 4, [True, True, False, False]])
    probs_BLK = loaded.word_probs(loaded(patches, coord, valid))
    assert probs_BLK.shape == (2, 4, 3) and (probs_BLK[1, 2:] == 0).all() and (probs_BLK[valid] > 0).all()
    save_file({k: v for k, v in state.items() if not k.startswith("word_head.")}, str(path))
    with pytest.raises(ValueError, match="needs a word count, or a weights file with word_head"):
        VisionTower(**SIZES, words=True, weights=path)
    with pytest.raises(ValueError, match="needs the word head's weights"):
        VisionTower(**SIZES, words=3, weights=path)
    with pytest.raises(ValueError, match="build it with words=True"):
        VisionTower(**SIZES).word_probs(None)
