"""nn.EmbeddingBag against a per-bag reference: one backward of each bag's own loss, the bag alone."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from capturecases import TOLERANCE, assert_exact_under_autocast
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from metastore_plugins.core.capture import CaptureSession
from metastore_plugins.testing import max_relative_error


@dataclass(frozen=True)
class BagCase:
    """Bags of ids (one per sample), fed as 2-D ``(B, n)`` (equal sizes) or 1-D with offsets."""

    bags: tuple[tuple[int, ...], ...]
    vocab: int = 12
    dim: int = 5
    mode: str = "sum"
    padding_idx: int | None = None
    include_last_offset: bool = False
    weighted: bool = False  # per_sample_weights (sum mode)
    two_d: bool = False


class BagClassifier(nn.Module):
    def __init__(self, case: BagCase) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(
            case.vocab, case.dim, mode=case.mode, padding_idx=case.padding_idx,
            include_last_offset=case.include_last_offset,
        )  # fmt: skip
        self.head = nn.Linear(case.dim, 3)

    def forward(self, ids: Tensor, offsets: Tensor | None, weights: Tensor | None) -> Tensor:
        return self.head(torch.tanh(self.bag(ids, offsets, per_sample_weights=weights)))  # (B, 3)


Inputs = tuple[Tensor, Tensor | None, Tensor | None]


def bag_inputs(case: BagCase, bags: tuple[tuple[int, ...], ...], weights: list[Tensor] | None) -> Inputs:
    """``(ids, offsets, per_sample_weights)`` of ``bags`` as the case feeds them."""
    flat_weights = torch.cat(weights) if weights is not None else None
    if case.two_d:
        shape = (len(bags), len(bags[0]))
        return torch.tensor(bags).reshape(shape), None, None if flat_weights is None else flat_weights.reshape(shape)
    starts = [sum(len(b) for b in bags[:i]) for i in range(len(bags) + case.include_last_offset)]
    return torch.tensor([i for b in bags for i in b], dtype=torch.long), torch.tensor(starts), flat_weights


def bag_loss(model: nn.Module, inputs: Inputs, y: Tensor) -> Tensor:
    return nn.functional.cross_entropy(model(*inputs), y)


def per_bag_reference(model: nn.Module, case: BagCase, weights: list[Tensor] | None, y: Tensor) -> dict[str, Tensor]:
    """Each bag's own loss differentiated alone (a batch of one bag): independent of capture."""
    reference = copy.deepcopy(model)
    params = dict(reference.named_parameters())
    grads = []
    for i, bag in enumerate(case.bags):
        inputs = bag_inputs(case, (bag,), None if weights is None else [weights[i]])
        grads.append(torch.autograd.grad(bag_loss(reference, inputs, y[i : i + 1]), list(params.values())))
    return {name: torch.stack([g[k] for g in grads]) for k, name in enumerate(params)}


def check(case: BagCase, loss_reduction: str = "mean") -> CaptureSession:
    model = BagClassifier(case)
    weights = [torch.randn(len(b)) for b in case.bags] if case.weighted else None
    y = torch.randint(0, 3, (len(case.bags),))
    expected = per_bag_reference(model, case, weights, y)
    with CaptureSession(model, loss_reduction=loss_reduction, unsupported="error") as session:
        loss = bag_loss(model, bag_inputs(case, case.bags, weights), y)
        (loss * len(case.bags) if loss_reduction == "sum" else loss).backward()
    assert session.uncaptured_parameters() == []
    assert max_relative_error(session.per_sample_gradients(), expected) <= TOLERANCE
    return session


@st.composite
def bag_cases(draw: st.DrawFn) -> BagCase:
    """Opacus' grid (N 1-4 bags of 1-5 ids, sum and mean) and more: max mode, empty bags, repeated ids,
    padding_idx, include_last_offset, per_sample_weights, 2-D input."""
    vocab = draw(st.integers(2, 32))
    two_d = draw(st.booleans())
    count, fixed = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    sizes = [fixed] * count if two_d else [draw(st.integers(0, 5)) for _ in range(count)]
    bags = tuple(tuple(draw(st.integers(0, vocab - 1)) for _ in range(n)) for n in sizes)
    mode = draw(st.sampled_from(["sum", "mean", "max"]))
    return BagCase(
        bags, vocab, draw(st.integers(1, 17)), mode, draw(st.none() | st.integers(0, vocab - 1)),
        include_last_offset=not two_d and draw(st.booleans()), weighted=mode == "sum" and draw(st.booleans()),
        two_d=two_d,
    )  # fmt: skip


@settings(max_examples=100, deadline=None)
@given(case=bag_cases(), seed=st.integers(0, 2**16))
def test_embedding_bag_grid(case: BagCase, seed: int) -> None:
    torch.manual_seed(seed)
    check(case)


BAGS = ((1, 2, 2, 0), (), (3,), (0, 0), (5, 6, 7, 5, 8), (9, 9, 11))  # repeats, an empty bag, a padding-only bag


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [None, 0])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_embedding_bag_modes(mode: str, padding_idx: int | None, include_last_offset: bool) -> None:
    session = check(BagCase(BAGS, mode=mode, padding_idx=padding_idx, include_last_offset=include_last_offset))
    (record,) = [r for r in session.factors() if r.layer == "bag"]
    assert record.kind == "embedding" and record.batch_size == len(BAGS)
    if padding_idx is not None:
        assert not (record.tensors["ids"] == padding_idx).any()  # padding entries are never stored
    sample = record.tensors["sample"]
    assert bool((sample[1:] >= sample[:-1]).all())
    assert not (sample == 1).any()  # the empty bag has no rows


def test_per_sample_weights_and_sum_reduction() -> None:
    check(BagCase(BAGS, weighted=True), loss_reduction="sum")
    check(BagCase(((1, 2, 3), (4, 4, 4)), weighted=True, two_d=True))


def test_max_mode_keeps_one_row_per_winning_id() -> None:
    """A bag's gradient goes, dimension by dimension, to the id its maximum came from."""
    session = check(BagCase(((4, 4, 4),), dim=6, mode="max"))
    (record,) = [r for r in session.factors() if r.layer == "bag"]
    assert record.tensors["ids"].tolist() == [4]


def test_scale_grad_by_freq_is_reported_not_wrong() -> None:
    model = BagClassifier(BagCase(BAGS))
    model.bag.scale_grad_by_freq = True
    inputs = bag_inputs(BagCase(BAGS), BAGS, None)
    with pytest.warns(UserWarning, match="scale_grad_by_freq"):
        with CaptureSession(model) as session:
            bag_loss(model, inputs, torch.zeros(len(BAGS), dtype=torch.long)).backward()
    assert session.uncaptured_parameters() == ["bag.weight"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_embedding_bag_under_autocast(dtype: torch.dtype) -> None:
    case = BagCase(BAGS, mode="mean", padding_idx=0)
    model, y = BagClassifier(case), torch.randint(0, 3, (len(BAGS),))
    inputs = bag_inputs(case, BAGS, None)
    assert_exact_under_autocast(model, lambda m, b: bag_loss(m, b, y), inputs, dtype)
