"""A dependency-free progress line on stderr for long store scans (only when stderr is a terminal)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

#: Scans of fewer batches than this show no progress line.
MIN_BATCHES = 200


def progress(items: Iterable[T], total: int, description: str) -> Iterator[T]:
    """Yield ``items``, redrawing ``description k/total`` at most 5 times a second on an interactive stderr."""
    if total < MIN_BATCHES or not sys.stderr.isatty():
        yield from items
        return
    last = 0.0
    for done, item in enumerate(items, 1):
        now = time.monotonic()
        if now - last > 0.2 or done == total:
            sys.stderr.write(f"\r{description} {done}/{total} batches")
            sys.stderr.flush()
            last = now
        yield item
    sys.stderr.write("\n")
