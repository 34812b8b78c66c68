"""Side-by-side timing: methods run round-robin (one step each per round) so that load from
other processes on a shared machine hits every method alike; the median over rounds is kept.
Also what every benchmark records of where it ran: the machine's description and the versions."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
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


def machine() -> str:
    """The OS and CPU model of this machine."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.system()} {platform.release()}, {cpu}"


def versions(*dists: str) -> dict[str, str]:
    """Python's version and each installed distribution's ("not installed" when missing)."""
    out = {"python": platform.python_version()}
    for dist in dists:
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "not installed"
    return out
