"""Fixtures of the capture tests (helpers live in :mod:`capturecases`, importable from every test file)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
