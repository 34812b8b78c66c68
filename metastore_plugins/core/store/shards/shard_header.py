"""The safetensors header of a shard, parsed by hand within a size bound derived from the keys it must hold.

A hostile header cannot cost more than the index allows: its length is capped by the expected keys
(:func:`header_cap`), its entries are checked as whole columns (numpy) before any is trusted, and
tensors may neither leave the file nor overlap.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import torch

from metastore_plugins.core.errors import StoreError

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
#: Header bytes allowed per expected key (beyond 6 per byte of its name: JSON escapes), and for
#: ``__metadata__`` and padding. A real entry of 9 dimensions takes under 200 bytes plus its name.
_HEADER_BYTES_PER_KEY = 256
_HEADER_SLACK = 1 << 16
_MAX_DIMS = 16

Entry = tuple[torch.dtype, tuple[int, ...], tuple[int, int]]


def header_cap(keys: Collection[str]) -> int:
    """The largest safetensors header (bytes) a shard holding the tensor keys ``keys`` may have."""
    return _HEADER_SLACK + sum(_HEADER_BYTES_PER_KEY + 6 * len(key.encode()) for key in keys)


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise StoreError("a key appears twice in one object")
    return out


def parse_header(
    path: Path, data: memoryview, required: frozenset[str], optional: frozenset[str]
) -> tuple[dict[str, Entry], dict[str, str], int]:
    """``(entries, __metadata__, data start)`` of a whole shard's bytes ``data``, checked: within the size the
    expected keys allow, valid JSON without a key twice, holding exactly the ``required`` keys and any of
    ``optional``, every entry's dtype, shape and offsets inside the file, no two tensors overlapping.

    Raises:
        StoreError: naming the path and the first thing wrong.
    """

    def fail(what: str) -> StoreError:
        return StoreError(f"{path}: not a readable safetensors file ({what})")

    if len(data) < 8:
        raise fail("shorter than its 8-byte header length")
    length, cap = int.from_bytes(data[:8], "little"), header_cap(required | optional)
    if length > len(data) - 8 or length > cap:
        raise fail(f"a header of {length} bytes, larger than the file or the {cap} bytes its index allows")
    try:
        text = str(data[8 : 8 + length], "utf-8")
        raw = json.loads(text)
        if isinstance(raw, dict) and text.count('"data_offsets"') != len(raw) - ("__metadata__" in raw):
            raw = json.loads(text, object_pairs_hook=_unique)  # a key twice? (the hook costs a third of the parse)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise fail(f"header is not valid UTF-8 JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise fail("header is not a JSON object")
    metadata = raw.pop("__metadata__", {})
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise fail("__metadata__ is not a map of strings")
    unexpected = sorted(set(raw) - required - optional)
    if unexpected:
        raise StoreError(f"{path}: holds {len(unexpected)} tensor key(s) the index does not list: {_few(unexpected)}")
    missing = sorted(required - set(raw))
    if missing:
        raise StoreError(f"{path}: lacks {len(missing)} tensor key(s) the index lists: {_few(missing)}")
    start, size = 8 + length, len(data) - 8 - length
    header = _entries(raw, size)
    if header is None:  # something is wrong: the first entry at fault, by name
        header = {key: _entry(key, entry, size, fail) for key, entry in raw.items()}
    keys = list(header)
    spans = np.array([span for _, _, span in header.values()], dtype=np.int64).reshape(-1, 2)  # (n, 2)
    used = np.flatnonzero(spans[:, 0] != spans[:, 1])
    order = used[np.argsort(spans[used, 0], kind="stable")]  # non-empty tensors by offset
    clash = np.flatnonzero(spans[order[1:], 0] < spans[order[:-1], 1])
    if len(clash):
        first, second = order[clash[0]], order[clash[0] + 1]
        raise fail(f"tensors {keys[first]} and {keys[second]} overlap")
    return header, metadata, start


def _entries(raw: dict[str, Any], size: int) -> dict[str, Entry] | None:
    """Every entry checked as columns (dtype, shape, offsets); None when one is wrong (:func:`_entry` names it)."""
    try:
        values = list(raw.values())
        names = [value["dtype"] for value in values]
        shapes = [value["shape"] for value in values]
        offsets = [value["data_offsets"] for value in values]
        dtypes = [_DTYPES[name] for name in names]
    except (TypeError, KeyError):  # not a dict, a field missing, an unknown or unhashable dtype
        return None
    if not (
        all(type(shape) is list and len(shape) <= _MAX_DIMS for shape in shapes)
        and all(type(pair) is list and len(pair) == 2 for pair in offsets)
    ):
        return None
    dims = list(chain.from_iterable(shapes))
    bounds = list(chain.from_iterable(offsets))
    if not all(type(value) is int for value in chain(dims, bounds)):
        return None  # floats, bools, None, strings
    try:
        dim_array = np.array(dims, dtype=np.int64)  # (sum of ranks,)
        span = np.array(bounds, dtype=np.int64).reshape(-1, 2)  # (n, 2)
    except OverflowError:
        return None
    if (dim_array < 0).any() or (dim_array >= 2**40).any() or (span < 0).any() or (span >= 2**40).any():
        return None
    itemsize = np.array([dtype.itemsize for dtype in dtypes], dtype=np.int64)  # (n,)
    numel = [math.prod(shape) for shape in shapes]  # exact: up to 16 sizes below 2^40
    if not ((span[:, 0] <= span[:, 1]).all() and (span[:, 1] <= size).all()):
        return None
    if not all(n * i == e for n, i, e in zip(numel, itemsize.tolist(), (span[:, 1] - span[:, 0]).tolist())):
        return None
    return {
        key: (dtype, tuple(shape), (begin, end))
        for key, dtype, shape, (begin, end) in zip(raw, dtypes, shapes, span.tolist())
    }


def _entry(key: str, entry: Any, size: int, fail: Callable[[str], StoreError]) -> Entry:
    dtype_name = entry.get("dtype") if isinstance(entry, dict) else None
    if not (isinstance(dtype_name, str) and dtype_name in _DTYPES):
        raise fail(f"tensor {key} has dtype {ascii(dtype_name)[:40]}, not one of {', '.join(_DTYPES)}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(shape, list) and len(shape) <= _MAX_DIMS and all(_small_int(d) for d in shape)):
        raise fail(f"tensor {key} has no valid shape (a list of at most {_MAX_DIMS} sizes below 2^40)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_small_int(v) for v in offsets)):
        raise fail(f"tensor {key} has no valid data_offsets (two byte offsets)")
    dtype = _DTYPES[dtype_name]
    begin, end = offsets
    if not begin <= end <= size or end - begin != math.prod(shape) * dtype.itemsize:
        raise fail(f"tensor {key} has data_offsets {offsets} that do not fit its shape {shape} in {size} data bytes")
    return dtype, tuple(shape), (begin, end)


def _small_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**40


def _few(keys: list[str]) -> str:
    return ", ".join(ascii(k)[1:-1] for k in keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
