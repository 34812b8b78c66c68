"""The per-call planning of dots (``dots_method``) and the one-block outer x outer path, against hand-built
dense gradients (float64) and the plans of ``plan_dots``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from opscases import TOLERANCE, Case, rel_err

from metastore_plugins.core.capture.build import outer_record
from metastore_plugins.core.ops import dots, plan_dots
from metastore_plugins.core.ops._common import common_params
from metastore_plugins.core.ops.cost import Method, dots_method
from metastore_plugins.core.records import LayerRecord, to_dense

METHODS: tuple[Method, ...] = ("auto", "factored", "dense")


def _factors(batch: int, tokens: int, d_in: int, d_out: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, T, 1, d_in)`` inputs and ``(B, T, 1, d_out)`` output gradients, later positions of a sample padded."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randn(batch, tokens, 1, d_in, generator=g)  # (B, T, 1, d_in)
    suffix = torch.randn(batch, tokens, 1, d_out, generator=g)  # (B, T, 1, d_out)
    lengths = torch.randint(1, tokens + 1, (batch,), generator=g)  # (B,)
    suffix[torch.arange(tokens)[None, :] >= lengths[:, None]] = 0.0  # padding: pruned rows
    return prefix, suffix


def _record(prefix: torch.Tensor, suffix: torch.Tensor, bias: bool = True) -> LayerRecord:
    d_in, d_out = prefix.shape[-1], suffix.shape[-1]
    params: dict[str, str] = {"weight": "w"}
    shapes: dict[str, tuple[int, ...]] = {"weight": (d_out, d_in)}
    if bias:
        params, shapes = params | {"bias": "b"}, shapes | {"bias": (d_out,)}
    return outer_record("l", prefix, suffix, params, shapes, choose_smaller=False)


def _dense(prefix: torch.Tensor, suffix: torch.Tensor, names: list[str]) -> torch.Tensor:
    """``(B, P)`` float64 per-sample gradients ``sum_t D_t^T A_t`` (and ``sum_t D_t``), built from the factors."""
    a, d = prefix[:, :, 0].double(), suffix[:, :, 0].double()  # (B, T, d_in), (B, T, d_out)
    parts = {"w": torch.einsum("bto,bti->boi", d, a).flatten(1), "b": d.sum(1)}  # (B, d_out d_in), (B, d_out)
    return torch.cat([parts[n] for n in names], 1)  # (B, P)


def _shuffled(record: LayerRecord, seed: int) -> LayerRecord:
    """The same record with its rows in a random order (rows need not be sorted by sample)."""
    order = torch.randperm(record.tensors["sample"].shape[0], generator=torch.Generator().manual_seed(seed))
    return replace(record, tensors={key: value[order] for key, value in record.tensors.items()})


def test_dots_method_is_the_plan_of_plan_dots(case: Case) -> None:
    """Every pair of kinds, every method: the per-call decision equals the plan's."""
    for a, b in case.pairs():
        for a2, b2 in ((a, b), (a, to_dense(b)), (to_dense(a), b), (to_dense(a), to_dense(b))):
            names = common_params(a2, b2, None)
            for method in METHODS:
                assert dots_method(a2, b2, names, method) == plan_dots(a2, b2, names, method).method, (
                    a.layer,
                    a2.kind,
                    b2.kind,
                    method,
                )


@pytest.mark.parametrize(("tokens", "d"), [(1, 32), (3, 16), (40, 8), (64, 4)])
def test_dots_method_where_the_bound_does_not_decide(tokens: int, d: int) -> None:
    """Long sequences on narrow layers: rebuilding wins and the rows per sample are counted; short ones: factored."""
    a, b = _record(*_factors(6, tokens, d, d, 1)), _record(*_factors(5, tokens, d, d, 2))
    names = common_params(a, b, None)
    for method in METHODS:
        assert dots_method(a, b, names, method) == plan_dots(a, b, names, method).method


def test_dots_method_refuses_an_unknown_method() -> None:
    a = _record(*_factors(2, 2, 3, 3, 0))
    with pytest.raises(ValueError, match="method must be"):
        dots_method(a, a, ["w"], "fast")  # type: ignore[arg-type]


@pytest.mark.parametrize("names", [["w", "b"], ["w"], ["b"]])
@pytest.mark.parametrize("shuffle", [False, True])
def test_one_block_and_blocked_products_against_dense_gradients(names: list[str], shuffle: bool) -> None:
    """The one-block path (default budget) and row blocks (small budgets) against a dense matmul."""
    fa, fb = _factors(7, 9, 12, 10, 3), _factors(5, 9, 12, 10, 4)
    a, b = _record(*fa), _record(*fb)
    if shuffle:
        a, b = _shuffled(a, 5), _shuffled(b, 6)
    expected = _dense(*fa, names) @ _dense(*fb, names).T  # (B_a, B_b)
    for max_bytes in (2**29, 12 * 40, 12 * 7, 1):
        actual = dots(a, b, params=names, method="factored", max_bytes=max_bytes)
        assert actual.shape == (7, 5)
        assert rel_err(actual, expected) <= TOLERANCE, max_bytes


def test_one_block_path_on_records_without_bias() -> None:
    fa, fb = _factors(4, 6, 8, 5, 7), _factors(3, 6, 8, 5, 8)
    a, b = _record(*fa, bias=False), _record(*fb, bias=False)
    expected = _dense(*fa, ["w"]) @ _dense(*fb, ["w"]).T  # (B_a, B_b)
    assert rel_err(dots(a, b, method="factored"), expected) <= TOLERANCE


def test_a_non_finite_sample_stays_in_its_row() -> None:
    """A NaN in one sample's factors reaches that sample's scores only, in every path."""
    fa, fb = _factors(4, 5, 6, 6, 9), _factors(3, 5, 6, 6, 10)
    fa[0][2, 0, 0, 1] = float("nan")  # sample 2's first input
    a, b = _record(*fa), _record(*fb)
    expected = _dense(*fa, ["w", "b"]) @ _dense(*fb, ["w", "b"]).T  # (B_a, B_b)
    for max_bytes in (2**29, 12 * 5):
        actual = dots(a, b, method="factored", max_bytes=max_bytes)
        assert bool(actual[2].isnan().all())
        keep = torch.tensor([0, 1, 3])
        assert rel_err(actual[keep], expected[keep]) <= TOLERANCE
