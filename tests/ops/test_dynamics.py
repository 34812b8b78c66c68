"""Batch gradients, accumulated |gradients|, per-weight top contributors and exceed fractions."""

from __future__ import annotations

import itertools

import pytest
import torch
from opscases import TOLERANCE, Case, flat_reference, rel_err, separating_thresholds

from metastore_plugins.core.ops import (
    abs_grad_accumulate,
    batch_gradient,
    entry_gradients,
    exceed_fraction,
    step_exceed_fractions,
    top_contributors,
    weight_exceed_fraction,
)
from metastore_plugins.core.records import to_dense


def test_batch_gradient_equals_what_the_optimizer_saw(case: Case) -> None:
    restored = batch_gradient(case.train_records, "mean")
    assert set(restored) == set(case.train_grad)
    for name, grad in case.train_grad.items():
        assert rel_err(restored[name], grad) <= TOLERANCE, name
        assert rel_err(batch_gradient(case.train_records, "sum")[name], case.train_ref[name].sum(0)) <= TOLERANCE


def test_batch_gradient_of_a_module_called_twice(tied_case: Case) -> None:
    restored = batch_gradient(tied_case.train_records)
    for name, grad in tied_case.train_grad.items():
        assert rel_err(restored[name], grad) <= TOLERANCE, name
    with pytest.raises(ValueError, match="'sum' or 'mean'"):
        batch_gradient(tied_case.train_records, "max")  # type: ignore[arg-type]


def test_abs_grad_accumulate(case: Case) -> None:
    for record in case.train_records:
        for dense in (False, True):
            rec = to_dense(record) if dense else record
            absolute = abs_grad_accumulate(rec)
            signed = abs_grad_accumulate(rec, signed=True)
            for name in record.params.values():
                ref = case.train_ref[name].double()
                assert rel_err(absolute[name], ref.abs().sum(0)) <= TOLERANCE, name
                assert rel_err(signed[name], ref.sum(0)) <= TOLERANCE, name
            assert set(abs_grad_accumulate(rec, max_bytes=1)) == set(absolute)


def _some_entries(shape: tuple[int, ...], count: int = 6) -> list[tuple[int, ...]]:
    every = list(itertools.product(*(range(s) for s in shape)))
    step = max(1, len(every) // count)
    return every[::step][:count] + [every[-1]]


def test_entry_gradients_and_top_contributors(case: Case) -> None:
    for record in case.train_records:
        for role, name in record.params.items():
            entries = _some_entries(record.param_shapes[role])
            ref = case.train_ref[name].double()  # (B, *shape)
            expected = torch.stack([ref[(slice(None), *e)] for e in entries], 1)  # (B, E)
            for rec in (record, to_dense(record)):
                assert rel_err(entry_gradients(rec, role, entries), expected) <= TOLERANCE, (name, rec.kind)
                assert rel_err(entry_gradients(rec, role, entries, max_bytes=1), expected) <= TOLERANCE
            top = top_contributors(record, role, entries, k=2)
            order = expected.abs().argsort(0, descending=True)[:2].T  # (E, 2)
            atol = TOLERANCE * float(expected.abs().max())
            for e in range(len(entries)):  # ties in |g| (e.g. all zero) may order either way
                assert torch.allclose(top.values[e].double().abs(), expected[order[e], e].abs(), rtol=0, atol=atol)
                assert torch.allclose(top.values[e].double(), expected[top.indices[e], e], rtol=0, atol=atol)


def test_entry_gradients_accepts_one_entry_and_rejects_bad_ones(case: Case) -> None:
    record = case.train_records[0]
    shape = record.param_shapes["weight"]
    one = entry_gradients(record, "weight", tuple(0 for _ in shape))
    assert one.shape == (record.batch_size, 1)
    with pytest.raises(ValueError, match="out of range"):
        entry_gradients(record, "weight", tuple(shape))
    with pytest.raises(ValueError, match="no captured parameter role"):
        entry_gradients(record, "gamma", (0,))


def test_exceed_fractions(case: Case) -> None:
    """Fractions above thresholds placed between the torch.func reference values, never on one.

    The code's norms (from factors) and batch gradient agree with the reference within
    ``TOLERANCE`` of the largest value; every threshold is 100 times that far from every
    reference value, so each sample (entry) is on the same side of it in the code and in the
    reference, and the fractions are equal: multiples of ``1 / B`` (``1 / entries``).
    """
    record = case.train_records[0]
    norms = flat_reference(case.train_ref, list(record.params.values())).norm(dim=1)  # (B,)
    thresholds = separating_thresholds(norms, margin=100 * TOLERANCE * float(norms.max()))
    assert len(thresholds) == len(norms) - 1  # distinct norms: every fraction 1/B .. (B-1)/B is tested
    for threshold, above in thresholds:
        assert exceed_fraction(record, threshold) == pytest.approx(above / len(norms), abs=1e-9), threshold
    assert exceed_fraction(record, 0.5 * float(norms.min())) == pytest.approx(1.0, abs=1e-9)
    assert exceed_fraction(record, 2.0 * float(norms.max())) == pytest.approx(0.0, abs=1e-9)
    grads = {n: case.train_ref[n].double().mean(0) for n in record.params.values()}
    entries = torch.cat([g.flatten() for g in grads.values()]).abs()  # (P,)
    restored = batch_gradient([record])
    limits = separating_thresholds(entries, margin=100 * TOLERANCE * float(entries.max()))
    assert any(len(entries) // 4 <= above <= 3 * len(entries) // 4 for _, above in limits)  # some split the middle
    for limit, above in limits:
        assert weight_exceed_fraction(restored, limit) == pytest.approx(above / len(entries), abs=1e-9), limit


def test_step_exceed_fractions_count_per_step_in_step_order() -> None:
    norms = torch.tensor([0.5, 3.0, 2.0, 0.1, 4.0, 2.5])
    steps = torch.tensor([7, 2, 7, 2, 9, 7])
    stored, fractions = step_exceed_fractions(norms, steps, threshold=1.0)
    expected = {
        s: sum(n > 1.0 for n, t in zip(norms.tolist(), steps.tolist()) if t == s) / steps.tolist().count(s)
        for s in (2, 7, 9)
    }
    assert stored.tolist() == [2, 7, 9]
    assert fractions.tolist() == pytest.approx([expected[2], expected[7], expected[9]], abs=1e-9)  # 1/2, 2/3, 1
