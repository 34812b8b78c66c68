"""Large temporaries of checkpoint passes and reports kept out of the C heap, so that they cannot fragment it.

glibc's ``malloc`` serves a block from the heap's free space when a free block there holds it; else a
block of at least its *mmap threshold* gets a mapping of its own, given back to the system when freed,
and a smaller one grows the heap, where a freed block stays resident for as long as a live block lies
above it. The threshold starts at 128 KiB and rises to the size of each mapped block freed (up to 32
MiB), so a long run soon serves its large tensors from the heap. A checkpoint pass allocates activations
and factors of other shapes than the training steps (batches cut by bytes, other sequence lengths, the
basis fit's Kronecker sums), which leaves freed holes the next step cannot reuse: on the MiniLM example
the process's resident memory climbed pass after pass, its heap holding 700 MB free beside 400 MB in use
(peak 1.8-1.9 GiB against 1.1 GiB without the callback).

Inside :func:`large_blocks_mapped` the threshold is fixed at :data:`LARGE_BLOCK_BYTES`: blocks that
large reuse the heap's holes or get their own mapping, and never grow the heap. On leaving it is fixed
at :data:`AFTER_BYTES` (the ceiling of the dynamic threshold, where a long run's threshold ends up). The
heap's free pages are given back (``malloc_trim``) on entering and on leaving. Where ``mallopt`` is
missing (macOS, Windows, musl) or the user chose the threshold (``MALLOC_MMAP_THRESHOLD_`` set), nothing
changes.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

#: The mmap threshold inside :func:`large_blocks_mapped` (16 MiB: peak 1.42-1.44x the run without the callback
#: on the MiniLM example, at no measurable cost in time; 8 MiB and 4 MiB lowered the peak a little more
#: and cost seconds of page faults; docs/benchmarks.md).
LARGE_BLOCK_BYTES = 16 * 2**20
#: The threshold after it: glibc's dynamic threshold's ceiling on 64-bit hosts (``DEFAULT_MMAP_THRESHOLD_MAX``).
AFTER_BYTES = 32 * 2**20
#: ``mallopt``'s parameter number of the mmap threshold (``M_MMAP_THRESHOLD`` in ``malloc.h``).
M_MMAP_THRESHOLD = -3
#: The environment variable with which a user fixes glibc's threshold themself.
USER_SETTING = "MALLOC_MMAP_THRESHOLD_"


@cache
def _glibc() -> ctypes.CDLL | None:
    """The process's C library when it has glibc's ``mallopt`` and ``malloc_trim``, else None."""
    try:
        libc = ctypes.CDLL(None)  # the symbols the process has loaded: the C library's among them
        libc.mallopt, libc.malloc_trim  # noqa: B018 - both must be there
    except (OSError, AttributeError, TypeError):  # TypeError: no CDLL(None) on Windows
        return None
    return libc


def tunable() -> bool:
    """Whether :func:`large_blocks_mapped` changes anything here (glibc, no threshold set by the user)."""
    return _glibc() is not None and USER_SETTING not in os.environ


@contextmanager
def large_blocks_mapped(threshold: int = LARGE_BLOCK_BYTES) -> Iterator[None]:
    """Serve blocks of ``threshold`` bytes and more with their own mapping inside the block (see the module)."""
    libc = _glibc() if tunable() else None
    if libc is None:
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, int(threshold))
    libc.malloc_trim(0)  # the free pages the steps left in the heap, before the block adds its own
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, AFTER_BYTES)
        libc.malloc_trim(0)
