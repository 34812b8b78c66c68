"""LayerNorm, GroupNorm, InstanceNorm, RMSNorm and BatchNorm (eval) against the torch.func reference."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from capturecases import assert_exact, cross_entropy
from torch import nn


@dataclass(frozen=True)
class NormCase:
    id: str
    make: Callable[[], nn.Module]
    input_shape: tuple[int, ...]


CASES = [
    NormCase("layernorm-vector", lambda: nn.LayerNorm(6), (4, 6)),
    NormCase("layernorm-sequence", lambda: nn.LayerNorm(6), (3, 5, 6)),
    NormCase("layernorm-2d-shape", lambda: nn.LayerNorm((4, 6)), (3, 4, 6)),
    NormCase("layernorm-no-bias", lambda: nn.LayerNorm(6, bias=False), (3, 5, 6)),
    NormCase("groupnorm", lambda: nn.GroupNorm(2, 4), (3, 4, 5, 5)),
    NormCase("instancenorm-affine", lambda: nn.InstanceNorm2d(4, affine=True), (3, 4, 5, 5)),
    NormCase("rmsnorm", lambda: nn.RMSNorm(6), (3, 5, 6)),
    NormCase("batchnorm-eval", lambda: nn.BatchNorm2d(4).eval(), (3, 4, 5, 5)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_norm_is_exact(case: NormCase) -> None:
    norm = case.make()
    with torch.no_grad():  # non-trivial affine parameters
        for param in norm.parameters():
            param.add_(torch.randn_like(param) * 0.3)
    model = nn.Sequential(norm, nn.Flatten(), nn.LazyLinear(3))
    x = torch.randn(case.input_shape)
    model(x)
    session = assert_exact(model, cross_entropy, (x, torch.randint(0, 3, (case.input_shape[0],))))
    norm_records = [r for r in session.factors() if r.layer == "0"]
    assert [r.kind for r in norm_records] == ["dense"]


# BatchNorm in training mode (its own weight and bias, and the layers below it): test_batchnorm_mixing.py
