"""total_dots, cosine, TracIn influence, self-influence and top-k against torch.func."""

from __future__ import annotations

import pytest
import torch
from opscases import TOLERANCE, Case, MaskedSequence, _sequence_batch, capture, cross_entropy, flat_reference, rel_err

from metastore_plugins.core.ops import (
    cosine,
    influence_scores,
    self_influence,
    topk,
    total_dots,
    total_sq_norms,
)
from metastore_plugins.core.records import to_dense
from metastore_plugins.testing import reference_per_sample_gradients


def _all(ref: dict[str, torch.Tensor]) -> torch.Tensor:
    return flat_reference(ref, sorted(ref))  # (B, P) every parameter


def test_total_dots_over_all_layers(case: Case) -> None:
    expected = _all(case.train_ref) @ _all(case.test_ref).T
    assert rel_err(total_dots(case.train_records, case.test_records), expected) <= TOLERANCE


def test_total_dots_with_a_module_called_twice(tied_case: Case) -> None:
    expected = _all(tied_case.train_ref) @ _all(tied_case.test_ref).T
    assert rel_err(total_dots(tied_case.train_records, tied_case.test_records), expected) <= TOLERANCE
    mixed = [to_dense(r) if k % 2 else r for k, r in enumerate(tied_case.test_records)]
    assert rel_err(total_dots(tied_case.train_records, mixed), expected) <= TOLERANCE


def test_cosine(case: Case) -> None:
    train, test = _all(case.train_ref), _all(case.test_ref)
    expected = (train @ test.T) / torch.outer(train.norm(dim=1), test.norm(dim=1))
    actual = cosine(
        total_dots(case.train_records, case.test_records),
        total_sq_norms(case.train_records),
        total_sq_norms(case.test_records),
    )
    assert rel_err(actual, expected) <= TOLERANCE
    assert float(actual.abs().max()) <= 1 + 1e-5


def test_cosine_of_a_zero_gradient_is_zero() -> None:
    out = cosine(torch.zeros(2, 2), torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.0]))
    assert torch.equal(out, torch.zeros(2, 2))


def _checkpoints() -> tuple[list, list, list[float], torch.Tensor, torch.Tensor]:
    """Two checkpoints of a small model (an SGD step apart), with TracIn computed from the reference."""
    torch.manual_seed(3)
    model = MaskedSequence().double()
    train, test = _sequence_batch(6, 5, 12, 21), _sequence_batch(4, 5, 12, 22)
    rates = [0.1, 0.03]
    train_records, test_records = [], []
    expected = torch.zeros(6, 4, dtype=torch.float64)
    expected_self = torch.zeros(6, dtype=torch.float64)
    for lr in rates:
        train_records.append(capture(model, train)[0])
        test_records.append(capture(model, test)[0])
        ref_train = _all(reference_per_sample_gradients(model, cross_entropy, train))
        ref_test = _all(reference_per_sample_gradients(model, cross_entropy, test))
        expected += lr * ref_train @ ref_test.T
        expected_self += lr * ref_train.pow(2).sum(1)
        model.zero_grad()
        cross_entropy(model, train).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return train_records, test_records, rates, expected, expected_self


def test_influence_scores_over_checkpoints() -> None:
    train, test, rates, expected, expected_self = _checkpoints()
    for method in ("auto", "factored", "dense"):
        assert rel_err(influence_scores(train, test, rates, method=method), expected) <= TOLERANCE
    assert rel_err(self_influence(train, rates), expected_self) <= TOLERANCE


def test_influence_needs_one_rate_per_checkpoint() -> None:
    train, test, rates, _, _ = _checkpoints()
    with pytest.raises(ValueError, match="one of each per checkpoint"):
        influence_scores(train, test, rates[:1])


def test_topk_proponents_and_opponents() -> None:
    scores = torch.tensor([[3.0, -1.0], [-2.0, 5.0], [1.0, 0.5], [0.0, -4.0]])  # (N_train=4, N_test=2)
    ranked = topk(scores, 2)
    assert ranked.proponents.tolist() == [[0, 2], [1, 2]]
    assert ranked.proponent_scores.tolist() == [[3.0, 1.0], [5.0, 0.5]]
    assert ranked.opponents.tolist() == [[1, 3], [3, 0]]
    assert ranked.opponent_scores.tolist() == [[-2.0, 0.0], [-4.0, -1.0]]
    assert topk(scores, 10).proponents.shape == (2, 4)
    assert topk(scores, 1, dim=1).proponents.flatten().tolist() == [0, 1, 0, 0]


def test_topk_of_influence_matches_the_reference_ranking() -> None:
    train, test, rates, expected, _ = _checkpoints()
    ordered = expected.T.sort(dim=1, descending=True).values  # (N_test, N_train)
    gaps = ordered[:, :-1] - ordered[:, 1:]
    assert float(gaps.min()) > 100 * TOLERANCE * float(expected.abs().max())  # no near-ties: rounding cannot reorder
    ranked = topk(influence_scores(train, test, rates), 3)
    assert torch.equal(ranked.proponents, torch.argsort(expected.T, dim=1, descending=True)[:, :3])
    assert torch.equal(ranked.opponents, torch.argsort(expected.T, dim=1)[:, :3])


def test_self_influence_is_lr_weighted_norms(case: Case) -> None:
    expected = 0.5 * _all(case.train_ref).pow(2).sum(1)
    assert rel_err(self_influence([case.train_records], [0.5]), expected) <= TOLERANCE
    head = case.train_records[0]
    head_expected = flat_reference(case.train_ref, list(head.params.values())).pow(2).sum(1)
    assert rel_err(self_influence([[head]], [1.0]), head_expected) <= TOLERANCE
