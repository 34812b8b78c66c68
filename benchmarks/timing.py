"""Side-by-side timing: methods run round-robin (one step each per round) so that load from
other processes on a shared machine hits every method alike; the median over rounds is kept."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def round_robin(steps: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each step, ``repeats`` rounds after ``warmup`` untimed rounds."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return times


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def rel_error(actual: Any, expected: Any) -> float:
    """``max |a - e| / max |e|`` over whole arrays (a global scale: exact-zero entries do not inflate it)."""
    import numpy as np

    a, e = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    scale = max(float(np.abs(e).max()) if e.size else 0.0, 1e-30)
    return float(np.abs(a - e).max() / scale) if e.size else 0.0
