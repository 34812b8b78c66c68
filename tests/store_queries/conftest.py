"""Fixtures of the store-query tests: stores of real little training runs (see :mod:`runcases`)."""

from __future__ import annotations

import pytest
from runcases import Run, make_twice, train


@pytest.fixture(scope="module")
def run_a(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Two epochs of four steps of six shuffled samples, decaying learning rate."""
    return train(tmp_path_factory.mktemp("run-a"))


@pytest.fixture(scope="module")
def run_b(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The same model and data, another order and learning rate, only six steps."""
    return train(tmp_path_factory.mktemp("run-b"), epochs=2, batch=8, lr=lambda step: 0.2, shuffle_seed=5)


@pytest.fixture(scope="module")
def run_accum(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Gradient accumulation over two micro-batches: equal sizes at steps 0-1, 5 + 3 later."""
    return train(tmp_path_factory.mktemp("run-accum"), epochs=1, batch=8, micro=lambda s: [4, 4] if s < 2 else [5, 3])


@pytest.fixture(scope="module")
def run_twice(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """A model that calls one Linear twice: two records per batch share its parameters."""
    return train(tmp_path_factory.mktemp("run-twice"), epochs=1, model_fn=make_twice)
