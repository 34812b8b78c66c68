"""CPU bf16 autocast: factors are stored as fp32 and lose nothing beyond autocast itself.

Three statements, from weakest to strongest:

1. restored per-sample gradients agree with the fp32 ``torch.func`` reference up to the
   error of running the model in bf16 (relative error <= 3e-2; about 1e-2 observed);
2. summed over the batch they agree with the ``.grad`` of the autocast backward up to
   the same order (<= 2e-2): ``.grad`` is itself a bf16 matrix product, rounded to
   bf16 (unit roundoff 2^-8 ~ 3.9e-3), and of the bf16-rounded input, so a 1e-3 bound is
   not reachable by anyone;
3. the stored suffix is the exact gradient autocast back-propagated and the stored
   prefix is the layer input: restored with the prefix rounded to bf16 as autocast's
   matmul saw it and summed over the batch, they give ``.grad`` element by element
   up to that bf16 rounding (relative error <= 2^-7, twice the unit roundoff; at most
   2^-8 observed: CPU bf16 kernels accumulate in fp32 and round once).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from torch import Tensor, nn

from metastore_plugins.core.capture import CaptureSession, LayerRecord
from metastore_plugins.testing import max_relative_error, reference_per_sample_gradients

BF16_UNIT_ROUNDOFF = 2.0**-8


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


def _autocast_capture(case: AutocastCase) -> tuple[nn.Module, tuple[Tensor, Tensor], CaptureSession]:
    model, batch = _model(case), _batch(case)
    with CaptureSession(model) as session:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(batch[0])
        assert logits.dtype == torch.bfloat16  # autocast really ran in bf16
        nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[1].reshape(-1)).backward()
    return model, batch, session


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_factors_are_fp32_and_close_to_the_fp32_reference(case: AutocastCase) -> None:
    model, batch, session = _autocast_capture(case)
    records = session.factors()
    stored = [t for r in records for key, t in r.tensors.items() if key not in ("sample", "position")]
    assert stored and all(t.dtype == torch.float32 for t in stored)
    linear = {str(i) for i, module in enumerate(model) if isinstance(module, nn.Linear)}
    assert {r.kind for r in records if r.layer in linear} == {"outer"}
    assert session.uncaptured_parameters() == []
    expected = reference_per_sample_gradients(model, _loss, batch)  # fp32, no autocast
    assert max_relative_error(session.per_sample_gradients(), expected) <= 3e-2


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_summed_per_sample_gradients_match_the_autocast_grad(case: AutocastCase) -> None:
    model, _, session = _autocast_capture(case)
    summed = {name: grad.mean(0) for name, grad in session.per_sample_gradients().items()}  # mean loss
    assert max_relative_error(summed, {n: p.grad for n, p in model.named_parameters()}) <= 2e-2


def _as_autocast_saw_it(record: LayerRecord) -> LayerRecord:
    """The record in fp64, with the prefix rounded to bf16 as autocast's matmul rounded its input."""
    prefix, suffix = record.tensors["prefix"], record.tensors["suffix"]  # (R, 1, d_in), (R, 1, d_out)
    tensors = dict(record.tensors, prefix=prefix.bfloat16().double(), suffix=suffix.double())
    return replace(record, tensors=tensors)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_factors_are_exactly_what_autocast_backpropagated(case: AutocastCase) -> None:
    model, _, session = _autocast_capture(case)
    params = dict(model.named_parameters())
    linear_records = [r for r in session.factors() if r.kind == "outer"]
    assert len(linear_records) == len(case.layers) - 1
    for record in linear_records:
        for name, per_sample in _as_autocast_saw_it(record).restore().items():
            exact = per_sample.mean(0)  # (*shape) in fp64: what autocast's bf16 matmul rounds once
            grad = params[name].grad.double()
            slack = 1e-6 * exact.abs().max()  # fp32 accumulation inside the kernel
            assert ((grad - exact).abs() <= 2 * BF16_UNIT_ROUNDOFF * exact.abs() + slack).all(), name
