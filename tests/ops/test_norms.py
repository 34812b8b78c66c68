"""sq_norms / sq_norms_by_param against torch.func per-sample gradients."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from opscases import TOLERANCE, Case, capture, flat_reference, rel_err

from metastore_plugins.core.ops import plan_norms, sq_norms, sq_norms_by_param, total_sq_norms
from metastore_plugins.core.records import LayerRecord, to_dense
from metastore_plugins.testing import reference_per_sample_gradients


def _expected(record: LayerRecord, ref: dict[str, torch.Tensor]) -> torch.Tensor:
    return flat_reference(ref, list(record.params.values())).pow(2).sum(1)  # (B,)


@pytest.mark.parametrize("method", ["auto", "factored", "dense"])
def test_sq_norms_every_record(case: Case, method: str) -> None:
    for record in case.train_records:
        assert rel_err(sq_norms(record, method=method), _expected(record, case.train_ref)) <= TOLERANCE, record.layer


def test_sq_norms_of_dense_records(case: Case) -> None:
    for record in case.train_records:
        dense = to_dense(record)
        assert rel_err(sq_norms(dense), _expected(record, case.train_ref)) <= TOLERANCE


def test_sq_norms_by_param(case: Case) -> None:
    for record in case.train_records:
        by_param = sq_norms_by_param(record)
        assert set(by_param) == set(record.params.values())
        for name, value in by_param.items():
            expected = case.train_ref[name].reshape(record.batch_size, -1).double().pow(2).sum(1)
            assert rel_err(value, expected) <= TOLERANCE, name


def test_params_selects_a_subset(case: Case) -> None:
    record = case.train_records[-1]
    name = next(iter(record.params.values()))
    expected = case.train_ref[name].reshape(record.batch_size, -1).double().pow(2).sum(1)
    assert rel_err(sq_norms(record, params=[name]), expected) <= TOLERANCE


def test_small_memory_budget_gives_the_same_norms(case: Case) -> None:
    for record in case.train_records:
        for method in ("factored", "dense"):
            assert rel_err(sq_norms(record, method=method, max_bytes=1), _expected(record, case.train_ref)) <= TOLERANCE


def test_total_sq_norms_with_a_module_called_twice(tied_case: Case) -> None:
    expected = flat_reference(tied_case.train_ref, sorted(tied_case.train_ref)).pow(2).sum(1)
    assert rel_err(total_sq_norms(tied_case.train_records), expected) <= TOLERANCE


def test_cost_model_prefers_factors_for_short_rows_and_dense_for_long_ones() -> None:
    from metastore_plugins.core.capture.build import outer_record

    g = torch.Generator().manual_seed(0)
    params, shapes = {"weight": "w", "bias": "b"}, {"weight": (8, 6), "bias": (8,)}
    short = outer_record(
        "l",
        torch.randn(4, 1, 1, 6, generator=g),
        torch.randn(4, 1, 1, 8, generator=g),
        params,
        shapes,
        choose_smaller=False,
    )
    long = outer_record(
        "l",
        torch.randn(4, 50, 1, 6, generator=g),
        torch.randn(4, 50, 1, 8, generator=g),
        params,
        shapes,
        choose_smaller=False,
    )
    assert plan_norms(short).method == "factored"
    assert plan_norms(long).method == "dense"
    for record in (short, long):
        grads = record.restore()
        expected = grads["w"].double().pow(2).sum((1, 2)) + grads["b"].double().pow(2).sum(1)
        assert rel_err(sq_norms(record), expected) <= TOLERANCE


@settings(max_examples=20, deadline=None)
@given(
    batch=st.integers(1, 4),
    tokens=st.integers(1, 5),
    d_in=st.integers(8, 14),
    d_out=st.integers(8, 14),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_outer_norms_over_shapes(batch: int, tokens: int, d_in: int, d_out: int, bias: bool, seed: int) -> None:
    from opscases import MaskedSequence, _sequence_batch, cross_entropy

    torch.manual_seed(seed)
    model = MaskedSequence(d_in, d_out).double()
    model.inp.bias.requires_grad_(bias)
    data = _sequence_batch(batch, tokens, d_in, seed)
    records, _ = capture(model, data)
    ref = reference_per_sample_gradients(model, cross_entropy, data)
    for record in records:
        for method in ("factored", "dense"):
            assert rel_err(sq_norms(record, method=method), _expected(record, ref)) <= TOLERANCE
