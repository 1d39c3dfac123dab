"""Layouts and masks: documents, padding, positions."""

# Shape suffixes (docs/paper.md §0): B batch rows, N tokens per row, 1 a singleton axis.

import torch

from vlm.backbone.layers import attention_mask, make_layout, positions_in_document


def test_positions_restart_at_every_document():
    doc = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2]])
    assert positions_in_document(doc).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]


def test_attention_mask_is_causal_and_block_diagonal():
    mask = attention_mask(torch.tensor([[0, 0, 1, 1, 1]]))[0, 0].int()
    expected = [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    assert mask.tolist() == expected


def test_layout_marks_padding_starts_and_segments():
    doc = torch.tensor([[7, 7, 3, 3, 7, 7, 0, 0]])  # id 7 reused: two different documents
    valid = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])
    layout = make_layout(doc, valid, (1, 8), torch.device("cpu"))
    assert layout.start_BN.int().tolist() == [[1, 0, 1, 0, 1, 0, 0, 0]]
    assert layout.pos_BN[0, :6].tolist() == [0, 1, 0, 1, 0, 1]
    real_docs = layout.doc_BN[0, :6].tolist()
    assert len(set(real_docs)) == 3 and (layout.doc_BN[0, 6:] == -1).all()
    # the layout keeps no N x N mask (issue #16); its dense reference, from the layout's segment ids:
    assert not attention_mask(layout.doc_BN)[0, 0, 4, :4].any(), "the second use of id 7 must not see the first"
    runs = [[(0, 2, True), (2, 4, True), (4, 6, True), (6, 8, False)]]  # (start, end, is_document)
    assert layout.docs is not None and layout.docs.segments == runs
    assert make_layout(None, None, (2, 5), torch.device("cpu")).docs is None  # plain causal fast path
