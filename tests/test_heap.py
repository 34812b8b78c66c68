"""Inside ``large_blocks_mapped`` a large block the heap cannot hold gets a mapping of its own (glibc); after it,
the heap grows for it again.

Run in a fresh interpreter (a heap with no large free block, as the test needs); the reference is glibc's own
count of mapped bytes (``mallinfo2().hblkhd``), not the module's state."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from metastore_plugins.core import heap

PROBE = """
import ctypes, json, torch
from metastore_plugins.core import heap

FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS]

libc = heap._glibc()
libc.mallinfo2.restype = MallInfo2

def mapped_for(nbytes):
    free, before = libc.mallinfo2().fordblks, libc.mallinfo2().hblkhd
    block = torch.empty(nbytes, dtype=torch.uint8)
    added = libc.mallinfo2().hblkhd - before
    del block
    return {"added": added, "heap_free_before": free}

MiB = 2**20
warm = mapped_for(30 * MiB)  # mapped, then freed: glibc's dynamic threshold rises to 30 MiB, as in a long run
with heap.large_blocks_mapped():
    inside = mapped_for(20 * MiB)  # at least the threshold inside (16 MiB), below the dynamic one
after = mapped_for(24 * MiB)  # above the threshold inside, below the one after (32 MiB)
print(json.dumps({"warm": warm, "inside": inside, "after": after}))
"""


@pytest.mark.skipif(not heap.tunable(), reason="mallopt is glibc's; MALLOC_MMAP_THRESHOLD_ must not be set")
def test_large_blocks_mapped_inside_and_from_the_heap_after() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    mib = 2**20
    assert seen["warm"]["added"] >= 30 * mib  # a fresh process maps it (the threshold starts at 128 KiB)
    assert seen["inside"]["heap_free_before"] < 20 * mib  # the heap could not hold it: the threshold decides
    assert seen["inside"]["added"] >= 20 * mib  # mapped, where the dynamic threshold (30 MiB) would grow the heap
    assert seen["after"]["heap_free_before"] < 24 * mib
    assert seen["after"]["added"] < mib  # the heap grew for it: the threshold is no longer the one inside


def test_nothing_changes_where_the_user_set_the_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int, int]] = []

    class Recorder:
        def mallopt(self, param: int, value: int) -> int:
            calls.append(("mallopt", param, value))
            return 1

        def malloc_trim(self, pad: int) -> int:
            calls.append(("malloc_trim", pad, 0))
            return 0

    monkeypatch.setattr(heap, "_glibc", lambda: Recorder())
    monkeypatch.setenv(heap.USER_SETTING, "65536")
    with heap.large_blocks_mapped():
        pass
    assert calls == []
    monkeypatch.delenv(heap.USER_SETTING)
    with heap.large_blocks_mapped():
        assert calls == [("mallopt", heap.M_MMAP_THRESHOLD, heap.LARGE_BLOCK_BYTES), ("malloc_trim", 0, 0)]
    assert calls[2:] == [("mallopt", heap.M_MMAP_THRESHOLD, heap.AFTER_BYTES), ("malloc_trim", 0, 0)]


def test_nothing_changes_without_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_glibc", lambda: None)
    assert not heap.tunable()
    with heap.large_blocks_mapped():
        pass
