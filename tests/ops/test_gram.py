"""``gram`` (the Kronecker sums' ``X^T X`` by column blocks) against the plain float64 product."""

from __future__ import annotations

import pytest
import torch

from metastore_plugins.core.ops.curvature import GRAM_BLOCK, gram


@pytest.mark.parametrize("width", [1, 7, GRAM_BLOCK, GRAM_BLOCK + 1, GRAM_BLOCK + 200, 2 * GRAM_BLOCK + 1, 1537])
@pytest.mark.parametrize("groups", [1, 3])
def test_gram_is_the_product_of_the_rows_with_themselves(width: int, groups: int) -> None:
    rows = torch.randn(groups, 50, width, generator=torch.Generator().manual_seed(width + groups))  # (G, R, d)
    want = rows.double().transpose(1, 2) @ rows.double()  # (G, d, d)
    got = gram(rows)
    assert got.shape == (groups, width, width) and got.dtype == rows.dtype
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_gram_keeps_float64() -> None:
    rows = torch.randn(2, 30, 2 * GRAM_BLOCK + 10, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = rows.transpose(1, 2) @ rows
    assert (gram(rows) - want).abs().max() <= 1e-12 * want.abs().max()
