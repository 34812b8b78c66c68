"""CPU autocast in bf16 and fp16: every rule is exact up to the rounding autocast itself does.

The convention (``capture.build.as_computed``): each rule reads the layer input as the layer's kernel
read it, rounded to the dtype the layer ran in (the dtype of its output gradient), and upcasts
every factor to fp32 before any product. ``u`` below is the dtype's unit roundoff (2^-8 for
bf16, 2^-11 for fp16). Statements, from strongest to weakest:

1. per-sample gradients agree, entry by entry, with per-sample autograd of the same autocast
   forward (``autocast_reference_per_sample_gradients``) within ``2u`` of the entry, plus
   1e-5 of the parameter's largest entry for the fp32 accumulation: autograd rounds each
   weight gradient of a low-precision matmul to the autocast dtype once (at most ``u``;
   at most 0.96u observed), capture does not;
2. the stored prefix of a layer autocast ran in low precision is exactly representable in
   that dtype, and restored in fp64 and summed over the batch it gives ``.grad`` within ``2u``
   per entry (``.grad`` is the same product, rounded once);
3. against the fp32 ``torch.func`` reference, per-sample gradients are within ``8u`` of each
   parameter's largest entry (bf16 3.1e-2, fp16 3.9e-3): that is the error of running these
   small models in low precision at all (at most 2.1u observed for bf16, 3.3u for fp16), not
   capture's, and it grows with depth.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from capturecases import cross_entropy, max_model_relative_error, squared_error
from torch import Tensor, nn

from metastore_plugins.core.capture import CaptureSession, LayerRecord
from metastore_plugins.testing import autocast_reference_per_sample_gradients, reference_per_sample_gradients

pytestmark = [
    pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning"),  # RMSNorm in bf16
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),  # vmap over SDPA
]

DTYPES = [torch.bfloat16, torch.float16]
DTYPE_IDS = ["bf16", "fp16"]


def unit_roundoff(dtype: torch.dtype) -> float:
    """Largest relative error of one rounding to ``dtype``: 2^-8 for bf16, 2^-11 for fp16."""
    return torch.finfo(dtype).eps / 2


def under_autocast(
    loss_fn: Callable[[nn.Module, Any], Tensor], dtype: torch.dtype
) -> Callable[[nn.Module, Any], Tensor]:
    """``loss_fn`` with the model's forward and the loss under CPU autocast, as Lightning runs a training step."""

    def loss(model: nn.Module, batch: Any) -> Tensor:
        with torch.autocast("cpu", dtype=dtype):
            return loss_fn(model, batch)

    return loss


def captured(model: nn.Module, loss_fn: Callable[[nn.Module, Any], Tensor], batch: Any) -> CaptureSession:
    """A closed session after one backward of ``loss_fn`` (backward outside autocast, as recommended)."""
    with CaptureSession(model) as session:
        loss_fn(model, batch).backward()
    return session


# -- every rule family, bf16 and fp16 ---------------------------------------------------


class SelfAttention(nn.Module):
    """``(B, L, E)`` -> ``nn.MultiheadAttention`` self-attention -> mean over non-padded positions -> logits."""

    def __init__(self, batch_first: bool, need_weights: bool = True) -> None:
        super().__init__()
        self.batch_first, self.need_weights = batch_first, need_weights
        self.attn = nn.MultiheadAttention(8, 2, batch_first=batch_first)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor, padding: Tensor) -> Tensor:  # (B, L, E), (B, L) True = padded
        h = x if self.batch_first else x.transpose(0, 1)
        h, _ = self.attn(h, h, h, key_padding_mask=padding, need_weights=self.need_weights)
        h = h if self.batch_first else h.transpose(0, 1)  # (B, L, E)
        keep = (~padding).float().unsqueeze(-1)  # (B, L, 1)
        return self.head((h * keep).sum(1) / keep.sum(1))  # (B, 3)


def attention_loss(model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    return nn.functional.cross_entropy(model(batch[0], batch[1]), batch[2])


def attention_batch() -> tuple[Tensor, Tensor, Tensor]:
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[0, 3:] = True  # sample 0 is padded at the end
    return torch.randn(3, 5, 8), padding, torch.randint(0, 3, (3,))


def hf_conv1d_model() -> nn.Module:
    from transformers.pytorch_utils import Conv1D

    return nn.Sequential(Conv1D(16, 6), nn.GELU(), Conv1D(3, 16))  # Conv1D(nf=d_out, nx=d_in)


def image_head(conv: nn.Module, after: list[nn.Module] | None = None) -> nn.Module:
    return nn.Sequential(conv, *(after or [nn.Tanh()]), nn.Flatten(), nn.LazyLinear(3))


def norm_after_conv(norm: nn.Module) -> nn.Module:
    """A bias-free convolution (InstanceNorm would cancel its bias: a zero gradient, all rounding noise) and a norm."""
    with torch.no_grad():  # non-trivial affine parameters
        for param in norm.parameters():
            param.add_(torch.randn_like(param) * 0.3)
    return image_head(nn.Conv2d(3, 4, 3, padding=1, bias=False), [norm, nn.GELU()])


def images(size: int, channels: int = 3, dims: int = 2, batch: int = 4) -> Callable[[], tuple[Tensor, Tensor]]:
    return lambda: (torch.randn(batch, channels, *([size] * dims)), torch.randint(0, 3, (batch,)))


def tokens(d_in: int, d_out: int) -> Callable[[], tuple[Tensor, Tensor]]:
    return lambda: (torch.randn(4, 5, d_in), torch.randn(4, 5, d_out))


@dataclass(frozen=True)
class FamilyCase:
    id: str
    model: Callable[[], nn.Module]
    batch: Callable[[], Any]
    loss: Callable[[nn.Module, Any], Tensor] = cross_entropy


def _embedding_batch() -> tuple[Tensor, Tensor]:
    ids = torch.randint(1, 11, (4, 6))
    ids[:, 4:] = 0  # padding at the end
    return ids, torch.randint(0, 3, (4, 6))


FAMILY_CASES = [
    FamilyCase(
        "linear", lambda: nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3)), tokens(6, 3), squared_error
    ),
    FamilyCase("hf-conv1d", hf_conv1d_model, tokens(6, 3), squared_error),
    FamilyCase("conv1d", lambda: image_head(nn.Conv1d(3, 5, 3)), images(8, dims=1)),
    FamilyCase(
        "conv1d-same-dilated", lambda: image_head(nn.Conv1d(2, 4, 3, padding="same", dilation=2)), images(9, 2, dims=1)
    ),
    FamilyCase(
        "conv1d-groups-stride", lambda: image_head(nn.Conv1d(4, 4, 2, stride=3, groups=4)), images(10, 4, dims=1)
    ),
    FamilyCase("conv2d-dense", lambda: image_head(nn.Conv2d(3, 4, 3)), images(8)),
    FamilyCase("conv2d-factored", lambda: image_head(nn.Conv2d(3, 4, 5)), images(5)),
    FamilyCase(
        "conv2d-groups-reflect",
        lambda: image_head(nn.Conv2d(4, 6, (3, 2), groups=2, padding=1, padding_mode="reflect")),
        images(6, 4),
    ),
    FamilyCase(
        "conv2d-stride-dilation", lambda: image_head(nn.Conv2d(2, 4, 3, stride=2, dilation=2, padding=1)), images(9, 2)
    ),
    FamilyCase(
        "embedding", lambda: nn.Sequential(nn.Embedding(11, 8, padding_idx=0), nn.Linear(8, 3)), _embedding_batch
    ),
    FamilyCase(
        "layernorm",
        lambda: nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 3)),
        lambda: (torch.randn(4, 5, 6), torch.randint(0, 3, (4, 5))),
    ),
    FamilyCase("groupnorm", lambda: norm_after_conv(nn.GroupNorm(2, 4)), images(5)),
    FamilyCase("instancenorm", lambda: norm_after_conv(nn.InstanceNorm2d(4, affine=True)), images(5)),
    FamilyCase("batchnorm-eval", lambda: norm_after_conv(nn.BatchNorm2d(4).eval()), images(5)),
    FamilyCase(
        "rmsnorm",
        lambda: nn.Sequential(nn.Linear(6, 8), nn.RMSNorm(8), nn.Linear(8, 3)),
        lambda: (torch.randn(4, 5, 6), torch.randint(0, 3, (4, 5))),
    ),
    FamilyCase("mha-batch-first", lambda: SelfAttention(batch_first=True), attention_batch, attention_loss),
    FamilyCase("mha-sequence-first", lambda: SelfAttention(batch_first=False), attention_batch, attention_loss),
    FamilyCase("mha-sdpa", lambda: SelfAttention(True, need_weights=False), attention_batch, attention_loss),
]


def _family_model(case: FamilyCase) -> tuple[nn.Module, Any]:
    model, batch = case.model(), case.batch()
    case.loss(model, batch)  # materialize lazy layers
    return model, batch


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", FAMILY_CASES, ids=lambda c: c.id)
def test_every_rule_is_exact_under_autocast(case: FamilyCase, dtype: torch.dtype) -> None:
    """Statement 1: within one rounding to the autocast dtype of per-sample autograd of the same forward."""
    model, batch = _family_model(case)
    loss = under_autocast(case.loss, dtype)
    expected = autocast_reference_per_sample_gradients(model, case.loss, batch, dtype)
    session = captured(model, loss, batch)
    assert session.uncaptured_parameters() == []
    actual = session.per_sample_gradients()
    assert set(actual) == {name for name, p in model.named_parameters() if p.requires_grad}
    bound = 4 * unit_roundoff(dtype)
    for name, want in expected.items():
        assert actual[name].shape == want.shape, name
        error = (actual[name].double() - want.double()).abs().flatten(1).amax(1)  # (B,)
        scale = want.double().abs().flatten(1).amax(1)  # (B,) each sample's largest entry
        assert (error <= bound * scale + 1e-5 * scale.max()).all(), (name, (error / scale).max().item())


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", FAMILY_CASES, ids=lambda c: c.id)
def test_every_rule_is_close_to_the_fp32_reference_under_autocast(case: FamilyCase, dtype: torch.dtype) -> None:
    """Statement 3: within 8u of the fp32 torch.func reference, the error of the low-precision forward itself."""
    model, batch = _family_model(case)
    expected = reference_per_sample_gradients(model, case.loss, batch)  # fp32, no autocast
    session = captured(model, under_autocast(case.loss, dtype), batch)
    assert max_model_relative_error(session.per_sample_gradients(), expected) <= 8 * unit_roundoff(dtype)


def test_stacked_conv2d_under_autocast_is_captured() -> None:
    """Conv2d under autocast used to raise "expected scalar type Float but found BFloat16" (or Half)."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.Flatten(), nn.LazyLinear(4))
    x, y = torch.randn(4, 3, 12, 12), torch.randint(0, 4, (4,))
    model(x)
    for dtype in DTYPES:
        session = captured(model, under_autocast(cross_entropy, dtype), (x, y))
        records = {r.layer: r for r in session.factors()}
        assert {"0", "2", "4"} <= set(records)
        assert all(
            t.dtype == torch.float32
            for r in records.values()
            for k, t in r.tensors.items()
            if k not in ("sample", "position")
        )


# -- MLPs: stored factors are what autocast back-propagated ------------------------------


@dataclass(frozen=True)
class AutocastCase:
    id: str
    layers: tuple[int, ...]  # widths, input first
    tokens: int | None  # None: plain vectors
    batch: int = 4
    norm: bool = False


CASES = [
    AutocastCase("mlp", (10, 32, 32, 4), tokens=None, batch=8),
    AutocastCase("sequence-linear", (16, 32, 5), tokens=3),
    AutocastCase("sequence-layernorm", (16, 32, 5), tokens=3, norm=True),
]


def _model(case: AutocastCase) -> nn.Module:
    layers: list[nn.Module] = []
    for i, (d_in, d_out) in enumerate(zip(case.layers, case.layers[1:])):
        if i:
            layers += [nn.LayerNorm(d_in)] if case.norm else []
            layers += [nn.GELU()]
        layers.append(nn.Linear(d_in, d_out))
    return nn.Sequential(*layers)


def _loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """Mean cross-entropy over samples (and tokens), in fp32 as autocast does for losses."""
    x, y = batch
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def _batch(case: AutocastCase) -> tuple[Tensor, Tensor]:
    lead = (case.batch,) if case.tokens is None else (case.batch, case.tokens)
    return torch.randn(*lead, case.layers[0]), torch.randint(0, case.layers[-1], lead)


def _autocast_capture(
    case: AutocastCase, dtype: torch.dtype
) -> tuple[nn.Module, tuple[Tensor, Tensor], CaptureSession]:
    model, batch = _model(case), _batch(case)
    with CaptureSession(model) as session:
        with torch.autocast("cpu", dtype=dtype):
            logits = model(batch[0])
        assert logits.dtype == dtype  # autocast really ran in low precision
        nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[1].reshape(-1)).backward()
    return model, batch, session


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_factors_are_fp32_and_close_to_the_fp32_reference(case: AutocastCase, dtype: torch.dtype) -> None:
    model, batch, session = _autocast_capture(case, dtype)
    records = session.factors()
    stored = [t for r in records for key, t in r.tensors.items() if key not in ("sample", "position")]
    assert stored and all(t.dtype == torch.float32 for t in stored)
    linear = {str(i) for i, module in enumerate(model) if isinstance(module, nn.Linear)}
    assert {r.kind for r in records if r.layer in linear} == {"outer"}
    assert session.uncaptured_parameters() == []
    expected = reference_per_sample_gradients(model, _loss, batch)  # fp32, no autocast
    assert max_model_relative_error(session.per_sample_gradients(), expected) <= 8 * unit_roundoff(dtype)


def _in_fp64(record: LayerRecord) -> LayerRecord:
    return replace(record, tensors={k: t.double() if t.is_floating_point() else t for k, t in record.tensors.items()})


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_factors_are_exactly_what_autocast_backpropagated(case: AutocastCase, dtype: torch.dtype) -> None:
    """Statement 2: the prefix is the matmul's low-precision operand, and the product is ``.grad`` before rounding."""
    model, _, session = _autocast_capture(case, dtype)
    params = dict(model.named_parameters())
    linear_records = [r for r in session.factors() if r.kind == "outer"]
    assert len(linear_records) == len(case.layers) - 1
    for record in linear_records:
        prefix = record.tensors["prefix"]  # (R, 1, d_in) fp32, including the first layer's fp32 input
        assert torch.equal(prefix, prefix.to(dtype).float()), record.layer
        for name, per_sample in _in_fp64(record).restore().items():
            exact = per_sample.mean(0)  # (*shape) in fp64: what autocast's matmul rounds once
            grad = params[name].grad.double()
            slack = 1e-6 * exact.abs().max()  # fp32 accumulation inside the kernel
            assert ((grad - exact).abs() <= 2 * unit_roundoff(dtype) * exact.abs() + slack).all(), name
