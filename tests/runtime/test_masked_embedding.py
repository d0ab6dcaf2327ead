"""A lookup in an embedding split by rows (autotp/local/collectives.py ``MaskedEmbedding``): each rank's
rows, the others' lookups zeros, summed over the ranks, give the whole embedding's output and gradient,
``padding_idx`` included (its lookups get no gradient in the model: only that global row's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autotp.local.collectives import MaskedEmbedding


@pytest.mark.parametrize("padding_idx", [None, 0, 5])
def test_row_pieces_sum_to_the_whole_lookup_and_its_gradient(padding_idx):
    weight = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[0, 4, 5, 7], [4, 1, 0, 5]])  # 4: the first row of the second rank's piece
    upstream = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(1))
    whole = weight.clone().requires_grad_()
    (F.embedding(ids, whole, padding_idx=padding_idx) * upstream).sum().backward()
    out, grads = 0, []
    for offset in (0, 4):
        piece = weight[offset:offset + 4].clone().requires_grad_()
        args = () if padding_idx is None else (padding_idx,)
        local = MaskedEmbedding(offset, 4)(piece, ids, *args)
        (local * upstream).sum().backward()
        out, grads = out + local.detach(), grads + [piece.grad]
    torch.testing.assert_close(out, F.embedding(ids, weight))
    torch.testing.assert_close(torch.cat(grads), whole.grad)
