"""Projected and norms-only representations against torch.func references, and the errors of what they cannot do.

A ``"projected"`` record must equal ``P_out G_i P_in^T`` of the torch.func gradient (the seeded
projections, float rounding only) and carry its exact squared norm; a ``"norms"`` record the exact
squared norm alone. Their inner products are those of the projections; what needs gradients says so.
"""

from __future__ import annotations

import pytest
import torch
from opscases import Case, reference_sketch, rel_err

from metastore_plugins.core.errors import RepresentationError
from metastore_plugins.core.ops import dots, sketch, sq_norms, total_dots, total_sq_norms
from metastore_plugins.core.ops.represent import by_layer, norms_record, projected_record, represent
from metastore_plugins.core.records import PROJECTION_SEED, LayerRecord

K_IN, K_OUT = 5, 4


def _reference_sq_norms(records: list[LayerRecord], ref: dict[str, torch.Tensor]) -> torch.Tensor:
    names = {name for record in records for name in record.params.values()}
    return sum(ref[name].double().flatten(1).pow(2).sum(1) for name in names)  # type: ignore[return-value]


def _reference_projection(records: list[LayerRecord], ref: dict[str, torch.Tensor]) -> torch.Tensor:
    return reference_sketch(records[0], ref, PROJECTION_SEED, K_IN, K_OUT)


def test_projected_record_is_the_projection_of_the_reference_gradient(case: Case) -> None:
    for layer, group in by_layer(case.train_records).items():
        kept = projected_record(group, K_IN, K_OUT)
        assert kept.kind == "projected" and tuple(kept.tensors["projected"].shape) == (group[0].batch_size, K_OUT, K_IN)
        expected = _reference_projection(group, case.train_ref)  # (B, k)
        assert rel_err(kept.tensors["projected"].flatten(1), expected) <= 1e-5, layer
        assert rel_err(kept.tensors["sq_norm"], _reference_sq_norms(group, case.train_ref)) <= 1e-5, layer


def test_norms_record_is_exact(case: Case) -> None:
    for layer, group in by_layer(case.train_records).items():
        kept = norms_record(group)
        assert list(kept.tensors) == ["sq_norm"]
        assert rel_err(sq_norms(kept), _reference_sq_norms(group, case.train_ref)) <= 1e-5, layer


def test_tied_calls_are_summed_before_projecting(tied_case: Case) -> None:
    """A Linear called twice: one record per call, one projection and one exact norm of their sum."""
    kept = represent(tied_case.train_records, {}, K_IN, K_OUT)
    assert kept == list(tied_case.train_records)  # nothing asked: exact
    everything = {record.layer: "norms" for record in tied_case.train_records}
    normed = represent(tied_case.train_records, everything, K_IN, K_OUT)  # type: ignore[arg-type]
    expected = total_sq_norms(tied_case.train_records)
    assert rel_err(total_sq_norms(normed), expected) <= 1e-5
    layers = [record.layer for record in tied_case.train_records]
    if len(set(layers)) == len(layers):  # a parameter tied across layers: those layers stay exact
        assert all(record.kind in ("outer", "embedding", "dense") for record in normed)


def test_inner_products_are_those_of_the_projections(case: Case) -> None:
    train = represent(case.train_records, {r.layer: "projected" for r in case.train_records}, K_IN, K_OUT)
    expected = sum(
        _reference_projection(group, case.train_ref) @ _reference_projection(group, case.test_ref).T
        for group in by_layer(case.train_records).values()
    )
    # projected x exact: the exact side is sketched with the same projection
    assert rel_err(total_dots(train, case.test_records), expected) <= 1e-5
    test = represent(case.test_records, {r.layer: "projected" for r in case.test_records}, K_IN, K_OUT)
    assert rel_err(total_dots(train, test), expected) <= 1e-5
    assert rel_err(total_dots(case.test_records, train), expected.T) <= 1e-5
    for record in train:
        assert torch.equal(sketch(record, K_IN, K_OUT, PROJECTION_SEED), record.tensors["projected"].flatten(1))


def test_what_a_kept_record_cannot_answer_says_so(case: Case) -> None:
    group = by_layer(case.train_records)[case.train_records[0].layer]
    normed, projected = norms_record(group), projected_record(group, K_IN, K_OUT)
    with pytest.raises(RepresentationError, match=f"layer '{normed.layer}'.*exact squared norms only.*policy='exact'"):
        dots(normed, group[0])
    with pytest.raises(RepresentationError, match="recompute"):
        normed.restore()
    with pytest.raises(RepresentationError, match="sketches"):
        sketch(normed, K_IN, K_OUT)
    with pytest.raises(RepresentationError, match=r"projected to \(4, 5\).*dim_out=4, dim_in=5"):
        sketch(projected, 8, 8)
    other = projected_record(group, K_IN + 1, K_OUT)
    with pytest.raises(RepresentationError, match="same projection on both sides"):
        dots(projected, other)
    if len(projected.params) > 1:
        with pytest.raises(RepresentationError, match="select all of them"):
            sq_norms(projected, params=[next(iter(projected.params.values()))])


def test_scaling_a_kept_record_scales_norms_by_the_square() -> None:
    record = LayerRecord(
        "l",
        "projected",
        2,
        {"weight": "w"},
        {"weight": (3, 3)},
        {"projected": torch.ones(2, 2, 2), "sq_norm": torch.tensor([1.0, 4.0])},
    )
    scaled = record.scale(0.5)
    assert torch.allclose(scaled.tensors["projected"], torch.full((2, 2, 2), 0.5))
    assert torch.allclose(scaled.tensors["sq_norm"], torch.tensor([0.25, 1.0]))


def test_layers_captured_unpacked_for_a_summary_give_the_same_projection_and_pack_when_kept_exact() -> None:
    """``summarized_layers``: all ``B T`` rows kept (padding included); the summaries match torch.func, and an
    exact record made of them drops the zero rows, as a packed capture would."""
    from torch import nn
    from torch.func import functional_call, grad, vmap

    from metastore_plugins.core.capture import CaptureSession

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    x = torch.randn(4, 5, 6, dtype=torch.float64)  # (B, T, d_in)
    mask = torch.rand(4, 5, 1) > 0.4  # padding positions get no gradient

    def loss_of(params: dict[str, torch.Tensor], x_i: torch.Tensor, m_i: torch.Tensor) -> torch.Tensor:
        return (functional_call(model, params, (x_i,)) * m_i).pow(2).sum()

    params = {name: p.detach() for name, p in model.named_parameters()}
    ref = vmap(grad(loss_of), in_dims=(None, 0, 0))(params, x, mask)  # name -> (B, *shape)
    with CaptureSession(model, loss_reduction="sum") as session:
        session.summarized_layers = frozenset({"0", "2"})
        (model(x) * mask).pow(2).sum().backward()
        records = session.factors()
    assert all(r.tensors["sample"].numel() == 4 * 5 for r in records)  # unpacked: every row kept
    for record in records:
        kept = projected_record([record], K_IN, K_OUT)
        expected = reference_sketch(record, ref, PROJECTION_SEED, K_IN, K_OUT)
        assert rel_err(kept.tensors["projected"].flatten(1), expected) <= 1e-5  # kept in float32
        assert rel_err(kept.tensors["sq_norm"], _reference_sq_norms([record], ref)) <= 1e-6  # float32 norms
    exact = represent(records, {}, K_IN, K_OUT)
    assert all(r.tensors["sample"].numel() == int(mask.sum()) for r in exact)  # zero rows dropped
    for name, value in exact[0].restore().items():
        assert rel_err(value, ref[name]) <= 1e-5  # records are float32
