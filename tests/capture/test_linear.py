"""nn.Linear and transformers' Conv1D against the torch.func reference."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from capturecases import assert_exact, cross_entropy, squared_error
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn


@dataclass(frozen=True)
class LinearCase:
    id: str
    input_shape: tuple[int, ...]  # including the batch dimension
    d_out: int
    bias: bool = True
    reduction: str = "mean"


CASES = [
    LinearCase("vector", (4, 5), 3),
    LinearCase("vector-no-bias", (4, 5), 3, bias=False),
    LinearCase("sequence", (3, 7, 5), 4),
    LinearCase("image-as-tokens", (2, 3, 4, 6), 5),
    LinearCase("sum-reduction", (4, 6, 5), 2, reduction="sum"),
    LinearCase("batch-of-one", (1, 5, 5), 3),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_linear_is_exact(case: LinearCase) -> None:
    model = nn.Sequential(nn.Linear(case.input_shape[-1], 8, bias=case.bias), nn.Tanh(), nn.Linear(8, case.d_out))
    x = torch.randn(case.input_shape)
    y = torch.randn(*case.input_shape[:-1], case.d_out)
    assert_exact(model, squared_error, (x, y), loss_reduction=case.reduction)


@settings(max_examples=15, deadline=None)
@given(
    batch=st.integers(1, 5),
    tokens=st.integers(1, 6),
    d_in=st.integers(1, 9),
    d_out=st.integers(1, 9),
    bias=st.booleans(),
)
def test_linear_shapes(batch: int, tokens: int, d_in: int, d_out: int, bias: bool) -> None:
    torch.manual_seed(batch * 1000 + tokens * 100 + d_in * 10 + d_out)
    model = nn.Sequential(nn.Linear(d_in, d_out, bias=bias))
    x, y = torch.randn(batch, tokens, d_in), torch.randn(batch, tokens, d_out)
    assert_exact(model, squared_error, (x, y))


def test_lazy_linear_and_shared_weights_sum_over_calls() -> None:
    """A layer called twice (weight tying) sums its two records."""
    shared = nn.Linear(6, 6)
    model = nn.Sequential(nn.LazyLinear(6), shared, nn.ReLU(), shared, nn.Linear(6, 3))
    x = torch.randn(5, 4)
    model(x)  # materialize the lazy layer
    assert_exact(model, cross_entropy, (x, torch.randint(0, 3, (5,))))


def test_transformers_conv1d_is_exact() -> None:
    from transformers.pytorch_utils import Conv1D

    model = nn.Sequential(Conv1D(7, 5), nn.GELU(), Conv1D(3, 7))  # Conv1D(nf=d_out, nx=d_in)
    x, y = torch.randn(3, 4, 5), torch.randn(3, 4, 3)
    assert_exact(model, squared_error, (x, y))
