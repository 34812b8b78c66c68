"""Fixtures of the operator tests: captured records of tiny models with torch.func references."""

from __future__ import annotations

import pytest
from opscases import CASE_NAMES, Case, get_case


@pytest.fixture(params=CASE_NAMES)
def case(request: pytest.FixtureRequest) -> Case:
    """Each tiny model (Linear with padding, grouped Conv2d, Embedding, LayerNorm, MHA, HF Conv1D), captured once."""
    if request.param == "conv1d-hf":
        pytest.importorskip("transformers")
    return get_case(request.param)


@pytest.fixture(params=["tied", "tied-lm"])
def tied_case(request: pytest.FixtureRequest) -> Case:
    """Records sharing parameters: a Linear called twice; an embedding tied to the output layer."""
    return get_case(request.param)
