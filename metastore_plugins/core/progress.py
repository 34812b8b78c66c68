"""A tqdm progress bar on stderr for long store scans, only when stderr is a terminal.

Every scan of stored batches
(:meth:`Selection.batches <metastore_plugins.core.store.reading.selection.Selection.batches>`: influence,
self-influence, sketches, the reports, the ``metastore`` subcommands) goes through
:func:`progress`. The bar shows for scans of :data:`MIN_BATCHES` batches or more, when the
stream is a terminal: in tests (stderr captured) and when stderr is redirected or piped
(``metastore ... 2>&1 | cat``) nothing is written. It is cleared when the scan ends
(``leave=False``), so nested scans (influence over column chunks) leave no trail.

tqdm is imported only when a bar is due; it comes with the ``lightning`` and ``hf`` extras
(``pip install tqdm`` otherwise). Without it scans run without a bar.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import IO, TypeVar

T = TypeVar("T")

#: Scans of fewer batches than this show no progress bar.
MIN_BATCHES = 200


def _is_terminal(stream: IO[str] | None) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):  # a closed or detached stream
        return False


def progress(items: Iterable[T], total: int, description: str, *, file: IO[str] | None = None) -> Iterator[T]:
    """Yield ``items`` with a tqdm bar ``description: k/total batches`` on ``file`` (default: stderr).

    No bar (plain iteration) when ``total < MIN_BATCHES``, when ``file`` is not a terminal,
    or when tqdm is not installed.
    """
    stream = sys.stderr if file is None else file
    if total < MIN_BATCHES or not _is_terminal(stream):
        yield from items
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield from items
        return
    with tqdm(
        items,
        total=total,
        desc=description,
        unit="batch",
        file=stream,
        leave=False,
        mininterval=0.2,
        dynamic_ncols=True,
    ) as bar:
        yield from bar
