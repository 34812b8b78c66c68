"""dots between records of one layer (every pair of kinds, every cost-model branch) against torch.func."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from opscases import TOLERANCE, Case, capture, flat_reference, rel_err

from metastore_plugins.core.capture.build import outer_record
from metastore_plugins.core.ops import dots, plan_dots
from metastore_plugins.core.records import LayerRecord, to_dense
from metastore_plugins.testing import reference_per_sample_gradients


def _expected(a: LayerRecord, ref_a: dict[str, torch.Tensor], ref_b: dict[str, torch.Tensor]) -> torch.Tensor:
    names = list(a.params.values())
    return flat_reference(ref_a, names) @ flat_reference(ref_b, names).T  # (B_a, B_b)


def _dot_err(
    actual: torch.Tensor, a: LayerRecord, ref_a: dict[str, torch.Tensor], ref_b: dict[str, torch.Tensor]
) -> float:
    """Error of a dot matrix relative to ``||g_a|| ||g_b||``, the scale fp32 factors are exact to.

    A single dot of two nearly orthogonal gradients is tiny; its fp32 rounding error is
    relative to the norms (Cauchy-Schwarz), not to the dot itself.
    """
    names = list(a.params.values())
    fa, fb = flat_reference(ref_a, names), flat_reference(ref_b, names)  # (B_a, P), (B_b, P)
    scale = (fa.norm(dim=1)[:, None] * fb.norm(dim=1)[None, :]).max().clamp_min(1e-300)
    return float((actual.double() - fa @ fb.T).abs().max() / scale)


@pytest.mark.parametrize("method", ["auto", "factored", "dense"])
def test_train_by_test_dots(case: Case, method: str) -> None:
    for a, b in case.pairs():
        expected = _expected(a, case.train_ref, case.test_ref)
        assert rel_err(dots(a, b, method=method), expected) <= TOLERANCE, (a.layer, a.kind)


@pytest.mark.parametrize("method", ["factored", "dense"])
@pytest.mark.parametrize("dense_side", ["first", "second", "both"])
def test_cross_kind_dots(case: Case, method: str, dense_side: str) -> None:
    """outer x dense, embedding x dense (either order) and dense x dense."""
    for a, b in case.pairs():
        a2 = to_dense(a) if dense_side in ("first", "both") else a
        b2 = to_dense(b) if dense_side in ("second", "both") else b
        expected = _expected(a, case.train_ref, case.test_ref)
        assert rel_err(dots(a2, b2, method=method), expected) <= TOLERANCE, (a.layer, a2.kind, b2.kind)


def test_self_dots_diagonal_is_the_squared_norm(case: Case) -> None:
    for a in case.train_records:
        expected = _expected(a, case.train_ref, case.train_ref)
        assert rel_err(dots(a, a), expected) <= TOLERANCE


@pytest.mark.parametrize("method", ["factored", "dense"])
def test_memory_budget_chunks_give_identical_results(case: Case, method: str) -> None:
    for a, b in case.pairs():
        full = dots(a, b, method=method)
        for budget in (1, 64, 1000):
            atol = 1e-6 * float(full.abs().max())
            assert torch.allclose(dots(a, b, method=method, max_bytes=budget), full, rtol=1e-5, atol=atol)
            assert torch.allclose(dots(a, to_dense(b), method=method, max_bytes=budget), full, rtol=1e-5, atol=atol)


def test_weight_only_and_bias_only(case: Case) -> None:
    for a, b in case.pairs():
        for role, name in a.params.items():
            expected = flat_reference(case.train_ref, [name]) @ flat_reference(case.test_ref, [name]).T
            for method in ("factored", "dense"):
                assert rel_err(dots(a, b, params=[name], method=method), expected) <= TOLERANCE, (a.layer, role)
                assert rel_err(dots(a, to_dense(b), params=[name], method=method), expected) <= TOLERANCE


def test_records_of_different_layers_are_refused(case: Case) -> None:
    a, b = case.train_records[0], case.train_records[-1]
    if set(a.params.values()) & set(b.params.values()):
        pytest.skip("records share parameters")
    with pytest.raises(ValueError, match="share no parameter"):
        dots(a, b)


def _linear_record(batch: int, tokens: int, d_in: int, d_out: int, seed: int = 0) -> LayerRecord:
    g = torch.Generator().manual_seed(seed)
    params, shapes = {"weight": "w", "bias": "b"}, {"weight": (d_out, d_in), "bias": (d_out,)}
    prefix, suffix = torch.randn(batch, tokens, 1, d_in, generator=g), torch.randn(batch, tokens, 1, d_out, generator=g)
    return outer_record("l", prefix, suffix, params, shapes, choose_smaller=False)


def test_cost_model_branches() -> None:
    """Short rows (a classifier head) -> factored; long sequences on a narrow layer -> dense; both exact."""
    short_a, short_b = _linear_record(6, 1, 32, 32, seed=1), _linear_record(5, 1, 32, 32, seed=2)
    long_a, long_b = _linear_record(6, 40, 8, 8, seed=3), _linear_record(5, 40, 8, 8, seed=4)
    assert plan_dots(short_a, short_b).method == "factored"
    assert plan_dots(long_a, long_b).method == "dense"
    plan = plan_dots(long_a, long_b)
    assert plan.dense_cost < plan.factored_cost
    for a, b in ((short_a, short_b), (long_a, long_b)):
        ga, gb = a.restore(), b.restore()
        expected = (ga["w"].double().flatten(1) @ gb["w"].double().flatten(1).T) + ga["b"].double() @ gb["b"].double().T
        results = {m: dots(a, b, method=m) for m in ("auto", "factored", "dense")}
        for value in results.values():
            assert rel_err(value, expected) <= TOLERANCE
    assert plan_dots(to_dense(short_a), to_dense(short_b)).method == "dense"  # only one way for dense records


def test_plan_flops_count_the_matrix_products_dots_runs() -> None:
    """``Plan.flops`` against the flops torch's FlopCounterMode sees: the factored plan adds one
    per Hadamard element to its products; the dense plan counts the bias rebuild as products too."""
    from torch.utils.flop_counter import FlopCounterMode

    for (a, b), method in (
        ((_linear_record(6, 3, 32, 32, seed=1), _linear_record(5, 2, 32, 32, seed=2)), "factored"),
        ((_linear_record(6, 40, 8, 8, seed=3), _linear_record(5, 40, 8, 8, seed=4)), "dense"),
    ):
        plan = plan_dots(a, b, method=method)
        with FlopCounterMode(display=False) as counter:
            dots(a, b, method=method)
        counted = counter.get_total_flops()
        if method == "factored":
            assert plan.flops == counted + a.tensors["sample"].numel() * b.tensors["sample"].numel()
        else:
            assert counted <= plan.flops <= 1.2 * counted, (plan.flops, counted)


@settings(max_examples=20, deadline=None)
@given(
    sizes=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    tokens=st.integers(1, 5),
    d_in=st.integers(8, 14),
    d_out=st.integers(8, 14),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_outer_dots_over_shapes(
    sizes: tuple[int, int], tokens: int, d_in: int, d_out: int, bias: bool, seed: int
) -> None:
    from opscases import MaskedSequence, _sequence_batch, cross_entropy

    torch.manual_seed(seed)
    model = MaskedSequence(d_in, d_out).double()
    model.inp.bias.requires_grad_(bias)
    batches = [_sequence_batch(n, tokens, d_in, seed + k) for k, n in enumerate(sizes)]
    (rec_a, rec_b) = [capture(model, data)[0] for data in batches]
    ref_a, ref_b = [reference_per_sample_gradients(model, cross_entropy, data) for data in batches]
    for a, b in zip(rec_a, rec_b):
        for method in ("factored", "dense"):
            assert _dot_err(dots(a, b, method=method), a, ref_a, ref_b) <= TOLERANCE
            assert _dot_err(dots(a, b, method=method, max_bytes=200), a, ref_a, ref_b) <= TOLERANCE
