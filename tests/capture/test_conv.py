"""nn.Conv1d and nn.Conv2d against the torch.func reference."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from capturecases import assert_exact, cross_entropy
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn


@dataclass(frozen=True)
class ConvCase:
    id: str
    dims: int  # 1 or 2
    channels: tuple[int, int]
    size: int
    options: dict[str, Any] = field(default_factory=dict)


CASES = [
    ConvCase("2d-plain", 2, (3, 4), 6, {"kernel_size": 3}),
    ConvCase("2d-same", 2, (2, 3), 5, {"kernel_size": 3, "padding": "same"}),
    ConvCase("2d-valid-no-bias", 2, (2, 3), 5, {"kernel_size": 2, "padding": "valid", "bias": False}),
    ConvCase("2d-stride-dilation", 2, (2, 4), 9, {"kernel_size": 3, "stride": 2, "dilation": 2, "padding": 1}),
    ConvCase("2d-groups", 2, (4, 6), 6, {"kernel_size": (3, 2), "groups": 2, "padding": (1, 0)}),
    ConvCase("2d-depthwise", 2, (3, 3), 5, {"kernel_size": 3, "groups": 3, "padding": 1}),
    ConvCase("2d-reflect", 2, (2, 2), 6, {"kernel_size": 3, "padding": 1, "padding_mode": "reflect"}),
    ConvCase("2d-circular-same", 2, (2, 3), 5, {"kernel_size": 4, "padding": "same", "padding_mode": "circular"}),
    ConvCase("1d-plain", 1, (3, 5), 8, {"kernel_size": 3}),
    ConvCase("1d-same-dilated", 1, (2, 4), 9, {"kernel_size": 3, "padding": "same", "dilation": 2}),
    ConvCase("1d-groups-stride", 1, (4, 4), 10, {"kernel_size": 2, "stride": 3, "groups": 4}),
]


def _classifier(case: ConvCase) -> nn.Module:
    conv_type = nn.Conv2d if case.dims == 2 else nn.Conv1d
    return nn.Sequential(
        conv_type(case.channels[0], case.channels[1], **case.options), nn.Tanh(), nn.Flatten(), nn.LazyLinear(3)
    )


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_conv_is_exact(case: ConvCase) -> None:
    model = _classifier(case)
    x = torch.randn(4, case.channels[0], *([case.size] * case.dims))
    model(x)
    assert_exact(model, cross_entropy, (x, torch.randint(0, 3, (4,))))


@settings(max_examples=12, deadline=None)
@given(
    batch=st.integers(1, 3),
    groups=st.sampled_from([1, 2]),
    kernel=st.integers(1, 3),
    stride=st.integers(1, 2),
    padding=st.integers(0, 2),
    dilation=st.integers(1, 2),
    size=st.integers(5, 8),
)
def test_conv2d_shapes(
    batch: int, groups: int, kernel: int, stride: int, padding: int, dilation: int, size: int
) -> None:
    torch.manual_seed(kernel * 100 + stride * 10 + padding)
    conv = nn.Conv2d(2 * groups, 2 * groups, kernel, stride=stride, padding=padding, dilation=dilation, groups=groups)
    model = nn.Sequential(conv, nn.Flatten(), nn.LazyLinear(2))
    x = torch.randn(batch, 2 * groups, size, size)
    model(x)
    assert_exact(model, cross_entropy, (x, torch.randint(0, 2, (batch,))))


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize(("size", "kind"), [(5, "outer"), (16, "dense")])
def test_factored_and_direct_dense_convolution_records_are_both_exact(groups: int, size: int, kind: str) -> None:
    """A 5x5 kernel over a 5x5 image has one position (factors are smaller); over 16x16, 144 (dense is)."""
    torch.manual_seed(size + groups)
    model = nn.Sequential(
        nn.Conv2d(2 * groups, 2 * groups, 5, groups=groups), nn.Tanh(), nn.Flatten(), nn.LazyLinear(3)
    )
    x = torch.randn(3, 2 * groups, size, size)
    model(x)
    session = assert_exact(model, cross_entropy, (x, torch.randint(0, 3, (3,))))
    assert [r.kind for r in session.factors() if r.layer == "0"] == [kind]


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize(
    ("kernel", "stride", "padding", "dilation"), [(1, 1, 0, 1), (3, 2, 1, 2), (2, 1, 2, 1), (3, 3, 0, 1)]
)
def test_strided_patches_equal_f_unfold(
    kernel: int, stride: int, padding: int, dilation: int, channels_last: bool
) -> None:
    import torch.nn.functional as F

    from metastore_plugins.core.capture.layers.conv import unfold_patches

    conv2 = nn.Conv2d(3, 4, kernel, stride=stride, padding=padding, dilation=dilation)
    x = torch.randn(2, 3, 9, 7)[:, :, 1:, :]  # a view with a storage offset
    x = x.contiguous(memory_format=torch.channels_last) if channels_last else x
    padded = F.pad(x, [padding] * 4)
    assert torch.equal(unfold_patches(conv2, x), F.unfold(padded, kernel, dilation=dilation, stride=stride))
    conv1 = nn.Conv1d(3, 4, kernel, stride=stride, padding=padding, dilation=dilation)
    x1 = torch.randn(2, 3, 10)
    expected = F.unfold(F.pad(x1, [padding] * 2).unsqueeze(2), (1, kernel), dilation=(1, dilation), stride=(1, stride))
    assert torch.equal(unfold_patches(conv1, x1), expected)
