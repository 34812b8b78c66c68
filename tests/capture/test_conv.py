"""nn.Conv1d/2d/3d and nn.ConvTranspose1d/2d/3d against the torch.func reference."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from capturecases import TOLERANCE, assert_exact, assert_exact_under_autocast, cross_entropy
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from metastore_plugins.core.capture import CaptureSession
from metastore_plugins.testing import max_relative_error, reference_per_sample_gradients


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


# -- every convolution module, on a grid at least as wide as Opacus' ------------------------


@dataclass(frozen=True)
class GridCase:
    """``nn.Conv{dims}d`` (or ``nn.ConvTranspose{dims}d``) on a batch of ``(C_in, *size)`` inputs."""

    transposed: bool
    batch: int
    size: tuple[int, ...]
    channels: tuple[int, int]  # (C_in, C_out)
    options: dict[str, Any]

    def module(self) -> nn.Module:
        prefix = "ConvTranspose" if self.transposed else "Conv"
        return getattr(nn, f"{prefix}{len(self.size)}d")(*self.channels, **self.options)


def _per_dim(draw: st.DrawFn, dims: int, values: st.SearchStrategy[int]) -> tuple[int, ...]:
    """One value for every dimension, or the same for all (as an int would give)."""
    if draw(st.booleans()):
        return (draw(values),) * dims
    return tuple(draw(values) for _ in range(dims))


def _output_sizes(case: GridCase) -> list[int]:
    o = case.options
    k, s, d = o["kernel_size"], o["stride"], o["dilation"]
    if case.transposed:
        p, op = o["padding"], o["output_padding"]
        return [(n - 1) * s[i] - 2 * p[i] + d[i] * (k[i] - 1) + op[i] + 1 for i, n in enumerate(case.size)]
    pad = [0] * len(k) if o["padding"] == "valid" else None if o["padding"] == "same" else o["padding"]
    if pad is None:
        return list(case.size)
    return [(n + 2 * pad[i] - d[i] * (k[i] - 1) - 1) // s[i] + 1 for i, n in enumerate(case.size)]


@st.composite
def conv_grid(draw: st.DrawFn, transposed: bool) -> GridCase:
    """Opacus' conv1d/2d/3d tests: N 1-4, C in (1, 3, 32), C_out = C or 2C, H/W 6-10 (D 3-6), kernel 1-3
    (per dimension too), stride 1-2 (3 for transposed), padding 0-2 / per dimension / 'same' / 'valid',
    dilation 1-2, groups 1 or C, bias; here also padding modes and output_padding."""
    dims = draw(st.integers(1, 3))
    size = tuple(draw(st.integers(3, 6) if dims == 3 and i == 0 else st.integers(6, 10)) for i in range(dims))
    c_in = draw(st.sampled_from([1, 3, 32] if not transposed else [1, 3, 8]))
    c_out = c_in * draw(st.sampled_from([1, 2]))
    kernel, dilation = _per_dim(draw, dims, st.integers(1, 3)), _per_dim(draw, dims, st.integers(1, 2))
    stride = _per_dim(draw, dims, st.integers(1, 3 if transposed else 2))
    options: dict[str, Any] = {"kernel_size": kernel, "stride": stride, "dilation": dilation}
    options |= {"groups": draw(st.sampled_from([1, c_in])), "bias": draw(st.booleans())}
    if transposed:
        size = tuple(max(1, n // 3) for n in size)  # transposed convolutions grow their input
        options["padding"] = _per_dim(draw, dims, st.integers(0, 2))
        options["output_padding"] = tuple(draw(st.integers(0, max(s, d) - 1)) for s, d in zip(stride, dilation))
    else:
        padding = draw(st.sampled_from(["per-dim", "same", "valid"]))
        options["padding"] = _per_dim(draw, dims, st.integers(0, 2)) if padding == "per-dim" else padding
        options["padding_mode"] = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
    case = GridCase(transposed, draw(st.integers(1, 4)), size, (c_in, c_out), options)
    assume(min(_output_sizes(case)) >= 1)
    if not transposed:
        assume(options["padding"] != "same" or set(stride) == {1})
        pads = [d * (k - 1) for k, d in zip(kernel, dilation)] if options["padding"] == "same" else options["padding"]
        wraps = options["padding_mode"] in ("reflect", "circular")  # these pad from the input itself
        assume(not wraps or options["padding"] == "valid" or max(pads) < min(size))
    return case


def tanh_weighted(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """Mean over samples of ``sum(tanh(model(x)) * target)``: a per-sample loss nonlinear in the output."""
    x, target = batch
    return (model(x).tanh() * target).flatten(1).sum(1).mean()


def _grid_batch(case: GridCase, module: nn.Module) -> tuple[Tensor, Tensor]:
    x = torch.randn(case.batch, case.channels[0], *case.size)
    with torch.no_grad():
        return x, torch.randn_like(module(x))


@settings(max_examples=120, deadline=None)
@given(case=conv_grid(transposed=False), seed=st.integers(0, 2**16))
def test_conv1d_2d_3d_grid(case: GridCase, seed: int) -> None:
    torch.manual_seed(seed)
    module = case.module()
    assert_exact(module, tanh_weighted, _grid_batch(case, module))


@settings(max_examples=120, deadline=None)
@given(case=conv_grid(transposed=True), seed=st.integers(0, 2**16))
def test_conv_transpose_1d_2d_3d_grid(case: GridCase, seed: int) -> None:
    torch.manual_seed(seed)
    module = case.module()
    assert_exact(module, tanh_weighted, _grid_batch(case, module))


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize(("size", "kind"), [(1, "outer"), (6, "dense")])
def test_conv_transpose_records_factored_and_dense(dims: int, size: int, kind: str) -> None:
    """One input position (a generator's first layer) keeps factors; many keep the dense gradient.

    The weight record has ``D = x`` and ``A = unfold(grad)``; the bias is a dense record ``<path>.bias``.
    """
    torch.manual_seed(dims * 10 + size)
    module = getattr(nn, f"ConvTranspose{dims}d")(8, 6, 3, stride=2, groups=2)
    model = nn.Sequential(module, nn.Tanh())
    x = torch.randn(3, 8, *([size] * dims))
    session = assert_exact(model, tanh_weighted, (x, torch.randn_like(model(x))))
    records = {r.layer: r for r in session.factors()}
    assert set(records) == {"0", "0.bias"}
    assert records["0"].kind == kind and records["0.bias"].kind == "dense"
    assert records["0"].restore()["0.weight"].shape == (3, *module.weight.shape)
    if kind == "outer":  # (R, G, C_out/G * k) patches of the gradient, (R, G, C_in/G) inputs
        assert records["0"].tensors["prefix"].shape[1:] == (2, 3 * 3**dims)
        assert records["0"].tensors["suffix"].shape[1:] == (2, 4)


def test_conv_transpose_output_size_argument() -> None:
    """``forward(x, output_size=...)`` picks the output padding at call time."""
    torch.manual_seed(4)
    deconv = nn.ConvTranspose2d(3, 2, 3, stride=3, padding=1)

    def loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        return (model(batch[0], output_size=(12, 11)).tanh() * batch[1]).flatten(1).sum(1).mean()

    assert_exact(deconv, loss, (torch.randn(2, 3, 4, 4), torch.randn(2, 2, 12, 11)))


@pytest.mark.parametrize(
    "make",
    [lambda: nn.LazyConv3d(4, 2), lambda: nn.LazyConvTranspose1d(4, 3, stride=2), lambda: nn.LazyConvTranspose3d(2, 2)],
    ids=["lazy-conv3d", "lazy-conv-transpose1d", "lazy-conv-transpose3d"],
)
def test_lazy_convolutions_attached_before_their_first_forward(make: Callable[[], nn.Module]) -> None:
    torch.manual_seed(5)
    module = make()
    dims = 1 if "1d" in type(module).__name__ else 3
    x = torch.randn(2, 3, *([4] * dims))
    with CaptureSession(module, unsupported="error") as session:
        target = torch.randn_like(module(x).detach())
        session.reset()
        tanh_weighted(module, (x, target)).backward()
    assert session.uncaptured_parameters() == []
    expected = reference_per_sample_gradients(module, tanh_weighted, (x, target))
    assert max_relative_error(session.per_sample_gradients(), expected) <= TOLERANCE


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    ("make", "size"),
    [
        (lambda: nn.Conv3d(2, 4, 3, padding="same", padding_mode="replicate"), (4, 4, 4)),
        (lambda: nn.ConvTranspose2d(4, 4, 3, stride=2, groups=2, output_padding=1), (4, 4)),
        (lambda: nn.ConvTranspose3d(8, 4, 2, stride=2), (1, 1, 1)),
    ],
    ids=["conv3d", "conv-transpose2d-dense", "conv-transpose3d-factored"],
)
def test_new_convolutions_under_autocast(
    make: Callable[[], nn.Module], size: tuple[int, ...], dtype: torch.dtype
) -> None:
    torch.manual_seed(6)
    conv = make()
    x = torch.randn(
        3, conv.weight.shape[1] * conv.groups if isinstance(conv, nn.Conv3d) else conv.weight.shape[0], *size
    )
    assert_exact_under_autocast(conv, tanh_weighted, (x, torch.randn_like(conv(x).detach())), dtype)


@pytest.mark.parametrize(
    "norm",
    [
        lambda: nn.InstanceNorm3d(4, affine=True),
        lambda: nn.BatchNorm3d(4).eval(),
        lambda: nn.LazyInstanceNorm3d(affine=True, track_running_stats=False),
        lambda: nn.LazyBatchNorm3d().eval(),
    ],
    ids=["instancenorm3d", "batchnorm3d-eval", "lazy-instancenorm3d", "lazy-batchnorm3d-eval"],
)
def test_conv3d_stacks_with_3d_norms(norm: Callable[[], nn.Module]) -> None:
    """Volumes: a Conv3d, then a 3-D norm from the per-sample norms table (not the generic fallback)."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Conv3d(2, 4, 2, bias=False), norm(), nn.GELU(), nn.Flatten(), nn.LazyLinear(3))
    x = torch.randn(3, 2, 3, 4, 4)
    model(x)  # materialize the lazy modules
    with torch.no_grad():  # non-trivial affine parameters and statistics
        for tensor in [*model[1].parameters(), *model[1].buffers()]:
            if tensor.is_floating_point():  # not num_batches_tracked
                tensor.add_(torch.rand_like(tensor) * 0.3)
    session = assert_exact(model, cross_entropy, (x, torch.randint(0, 3, (3,))))
    assert session.generic_parameters() == []
