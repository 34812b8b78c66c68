"""Fixtures of every test: an isolated, seeded torch RNG, and deterministic hypothesis runs.

See tests/README.md for the rules these support (no reliance on global RNG state or test order).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

# Property tests draw the same examples on every run and machine (seeded from each test), and keep no
# example database between runs: a failure is reproducible from the test alone, never from an earlier run.
# ``HYPOTHESIS_PROFILE=explore`` draws fresh random examples instead, to look for new failures.
settings.register_profile(
    "deterministic", derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("explore", database=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))


@pytest.fixture(autouse=True)
def _isolated_torch_rng() -> Iterator[None]:
    """Each test starts from torch's global RNG seeded with 0 and leaves the global RNG as it found it.

    So no test depends on which tests ran before it (pytest-randomly shuffles them), and what a test
    draws from the global RNG (``nn.Linear`` initialisation, ``torch.randn`` without a generator,
    dropout) is the same on every run. Data is still best drawn from a local ``torch.Generator``.
    Module-scoped fixtures run before this one: they seed themselves (``torch.random.fork_rng``).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield
