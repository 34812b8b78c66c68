"""Many journal lines checked and parsed at once: the same trust as :func:`~.journal.decode_line` line by line.

A tags file of a million lines costs 20 us a line through ``decode_line`` (a regular expression, a CRC, a
``json.loads`` call and its encoding detection per line). :func:`decode_lines` checks a block of lines
together: each line's form (``{...} crc32\\n``), read off the newline positions with numpy; the CRCs, computed
by ``map(zlib.crc32, ...)`` and compared as arrays; and one ``json.loads`` of the block's objects joined into
an array. A joined parse alone could let two damaged lines pair into one object (``{"a":[{}`` and
``{}]}``), so the block's bracket depth outside strings is computed (numpy) at every line boundary: each
line must close what it opens, so each parsed value is exactly one line's text. A block that fails any
check is decoded again line by line, so the first bad line is named exactly as ``decode_line`` names it.
"""

from __future__ import annotations

import gc
import json
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from metastore_plugins.core.errors import JournalError
from metastore_plugins.core.store.shards.journal import MAX_LINE_BYTES, MAX_LINE_VALUES, decode_line
from metastore_plugins.core.store.shards.manifest import json_values_problem

#: Lines checked and parsed together (about 3 MB of tag lines; within MAX_LINE_VALUES values when well formed).
BLOCK_LINES = 2**14
#: The value of each lowercase hex digit's byte; 255 for every other byte.
_HEX = np.full(256, 255, dtype=np.uint8)
_HEX[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_HEX[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16)
_SHIFTS = np.arange(28, -1, -4, dtype=np.uint32)  # (8,) a CRC's hex digits, most significant first
_SMALLEST = len(b"{} 00000000")


def decode_lines(
    data: bytes, needles: tuple[bytes, ...] | None = None
) -> Iterator[tuple[dict[str, Any] | JournalError | None, int]]:
    """``(object of the line, or the JournalError decode_line raises for it; offset after the line)`` for each
    line of ``data``, in order; a last line without its newline comes as a torn :class:`JournalError`.

    With ``needles``, a line whose text holds none of them is checked (its form and CRC) but not parsed: None.
    """
    lines = data.split(b"\n")
    tail = lines.pop()
    offset = 0
    for first in range(0, len(lines), BLOCK_LINES):
        block = lines[first : first + BLOCK_LINES]
        lengths = np.fromiter(map(len, block), np.int64, len(block)) + 1  # (n,) with their newlines
        ends = offset + np.cumsum(lengths)  # (n,) offset after each line
        entries = _block(data, block, ends, needles)
        if entries is None:  # something is wrong in the block: name it as decode_line does
            entries = [_one(line + b"\n") for line in block]
        yield from zip(entries, ends.tolist())
        offset = int(ends[-1])
    if tail:
        yield _one(tail), len(data)


def _one(line: bytes) -> dict[str, Any] | JournalError:
    try:
        if len(line) > MAX_LINE_BYTES:
            raise JournalError("longer than any line a reader accepts")
        return decode_line(line)
    except JournalError as exc:
        return exc


def _block(
    data: bytes, block: list[bytes], ends: np.ndarray, needles: tuple[bytes, ...] | None
) -> list[dict[str, Any] | JournalError | None] | None:
    """The objects of ``block`` (lines without newlines, ending at ``ends`` in ``data``; None for those holding
    none of ``needles``) when every line passes every check of :func:`decode_line`, else None."""
    raw = np.frombuffer(data, np.uint8)
    newline = ends - 1  # (n,)
    starts = newline - (np.fromiter(map(len, block), np.int64, len(block)))  # (n,)
    if (newline - starts < _SMALLEST).any() or (newline - starts > MAX_LINE_BYTES).any():
        return None
    form = (raw[starts] == ord("{")) & (raw[newline - 10] == ord("}")) & (raw[newline - 9] == ord(" "))
    digits = _HEX[raw[newline[:, None] + np.arange(-8, 0)]]  # (n, 8)
    if not form.all() or (digits == 255).any():
        return None
    given = (digits.astype(np.uint32) << _SHIFTS).sum(axis=1, dtype=np.uint32)  # (n,)
    texts = [line[:-9] for line in block]
    if not np.array_equal(np.fromiter(map(zlib.crc32, texts), np.uint32, len(texts)), given):
        return None
    chosen = list(range(len(texts)))
    if needles is not None:
        chosen = _holding(data, needles, int(starts[0]), ends)
        texts = [texts[i] for i in chosen]
        if not texts:
            return [None] * len(block)
    joined = b"[" + b",\n".join(texts) + b"]"
    if json_values_problem(joined, MAX_LINE_VALUES) is not None:
        return None
    try:
        entries = json.loads(joined)
    except (ValueError, RecursionError, MemoryError):
        return None
    if len(entries) != len(texts) or not all(type(entry) is dict for entry in entries):
        return None
    lengths = np.fromiter(map(len, texts), np.int64, len(texts))  # (m,)
    commas = 1 + np.cumsum(lengths[:-1]) + 2 * np.arange(len(texts) - 1)  # (m - 1,) the ',' after each text
    if not _separate(joined, commas):
        return None
    if needles is None:
        return entries
    out: list[dict[str, Any] | JournalError | None] = [None] * len(block)
    for i, entry in zip(chosen, entries):
        out[i] = entry
    return out


def _holding(data: bytes, needles: tuple[bytes, ...], start: int, ends: np.ndarray) -> list[int]:
    """The lines (indices; they end at ``ends`` in ``data``, the first starts at ``start``) holding a needle."""
    hits = []
    for needle in needles:  # bytes.find over the block: a rare name costs a scan, not a test per line
        at = data.find(needle, start, int(ends[-1]))
        while at >= 0:
            hits.append(at)
            at = data.find(needle, at + 1, int(ends[-1]))
    return np.unique(np.searchsorted(ends, np.asarray(hits, dtype=np.int64), side="right")).tolist()


def _separate(joined: bytes, commas: np.ndarray) -> bool:
    """Whether every comma at ``commas`` of the (valid JSON) array ``joined`` sits between its elements: outside
    strings, at bracket depth 1."""
    plain = joined.replace(b"\\\\", b"__").replace(b'\\"', b"__")  # escapes paired left to right, as a parser does
    text = np.frombuffer(plain, np.uint8)
    inside = (np.cumsum(text == ord('"'), dtype=np.int32) & 1).astype(bool)  # (len,) within a string
    opens = (text == ord("{")) | (text == ord("["))
    closes = (text == ord("}")) | (text == ord("]"))
    depth = np.cumsum((opens & ~inside).astype(np.int8) - (closes & ~inside).astype(np.int8), dtype=np.int32)
    return bool((depth[commas] == 1).all() and not inside[commas].any())


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off within the block (back as it was after): for building many containers
    (a million parsed lines: the collector would walk them again and again, a third of the time)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
