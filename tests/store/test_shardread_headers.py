"""Shard headers built byte by byte (``core/store/shards/shardread.py``): malformed, overlapping, past the file
or past the bound derived from the index are refused before any JSON is parsed; edge tensors read right."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from shardcases import _assert_same, _reference, _refused, no_leaked_descriptors  # noqa: F401 - a fixture

from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.records import dense_record
from metastore_plugins.core.store.shards.shardfile import write_shard
from metastore_plugins.core.store.shards.shardread import (
    ShardExpectation,
    expected_keys,
    read_shard,
)


def _hand(directory: Path, header: dict[str, Any] | bytes, data: bytes = b"", length: int | None = None) -> Path:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path = directory / "hand.safetensors"
    path.write_bytes((len(text) if length is None else length).to_bytes(8, "little") + text + data)
    return path


def _expect(path: Path, keys: frozenset[str] = frozenset({"a", "b"})) -> ShardExpectation:
    return ShardExpectation(path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest(), keys)


def _f32(shape: list[int], begin: int, end: int, dtype: Any = "F32") -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


NOT_READABLE = r"^not a readable safetensors file \("


@pytest.mark.parametrize(
    ("header", "data", "pattern"),
    [
        ({"a": _f32([2], 0, 8), "b": _f32([2], 4, 12)}, bytes(12), "tensors a and b overlap"),
        ({"a": _f32([2], 0, 8), "b": _f32([2], 8, 16)}, bytes(12), r"tensor b has data_offsets \[8, 16\] that do not"),
        ({"a": _f32([3], 0, 8), "b": _f32([0], 8, 8)}, bytes(8), r"tensor a has data_offsets \[0, 8\] .* shape \[3\]"),
        ({"a": _f32([2], 0, 8, "F8_E4M3"), "b": _f32([0], 8, 8)}, bytes(8), "tensor a has dtype 'F8_E4M3', not one of"),
        ({"a": _f32([2], 0, 8, ["F32"]), "b": _f32([0], 8, 8)}, bytes(8), r"tensor a has dtype \['F32'\], not one of"),
        ({"a": _f32([-2], 0, 8), "b": _f32([0], 8, 8)}, bytes(8), "tensor a has no valid shape"),
        ({"a": _f32([True, 2], 0, 8), "b": _f32([0], 8, 8)}, bytes(8), "tensor a has no valid shape"),
        ({"a": _f32([1] * 17, 0, 4), "b": _f32([0], 4, 4)}, bytes(4), "tensor a has no valid shape"),
        ({"a": _f32([2], 0, 2**40), "b": _f32([0], 8, 8)}, bytes(8), "tensor a has no valid data_offsets"),
        ({"a": [], "b": _f32([0], 8, 8)}, bytes(8), "tensor a has dtype None"),
        ({"__metadata__": {"x": 1}, "a": _f32([0], 0, 0), "b": _f32([0], 0, 0)}, b"", "__metadata__ is not a map of"),
        (b"[1, 2]", b"", r"header is not a JSON object\)$"),
        (b'{"a": ', b"", r"header is not valid UTF-8 JSON: "),
        (b'{"\xff": 1}', b"", r"header is not valid UTF-8 JSON: "),
        (b'{"a": {}, "a": {}}', b"", r"header is not valid UTF-8 JSON: a key appears twice"),
        (b"[" * 30_000 + b"]" * 30_000, b"", r"header is not valid UTF-8 JSON: maximum recursion"),
    ],
    ids=[
        "overlap", "past-end", "shape-offsets", "unknown-dtype", "unhashable-dtype", "negative-size", "bool-size",
        "too-many-dims", "huge-offset", "entry-not-object", "metadata", "array", "truncated-json", "not-utf8",
        "duplicate-key", "deep-nesting",
    ],
)  # fmt: skip
def test_malformed_headers_are_refused(tmp_path: Path, header: Any, data: bytes, pattern: str) -> None:
    path = _hand(tmp_path, header, data)
    _refused(path, tmp_path, _expect(path), NOT_READABLE + pattern)


def test_hand_built_edge_tensors_read_right(tmp_path: Path) -> None:
    """Bool bytes other than 0/1 read as True, bf16 and empty tensors, offsets in any order."""
    values = torch.tensor([1.5, -2.25], dtype=torch.bfloat16)
    header = {
        "__metadata__": {"format": "metastore"},
        "a": _f32([3], 4, 7, "BOOL"),
        "b": _f32([2], 0, 4, "BF16"),
        "c": _f32([0, 5], 5, 5),  # empty, inside a's bytes: no overlap
    }
    path = _hand(tmp_path, header, values.view(torch.uint8).numpy().tobytes() + bytes([0, 1, 2]))
    data = read_shard(path, tmp_path, _expect(path, frozenset({"a", "b", "c"})))
    assert data.get("a").view(torch.uint8).tolist() == [0, 1, 1]  # stored as 0 and 1, as bool kernels assume
    assert torch.equal(data.get("b"), values)
    assert data.get("c").shape == (0, 5)
    with pytest.raises(StoreError, match="holds no tensor 'd'"):
        data.get("d")


def test_header_lengths_past_the_file_or_the_bound_are_refused_before_parsing(tmp_path: Path) -> None:
    path = _hand(tmp_path, b"{}", length=10**6)
    _refused(path, tmp_path, _expect(path), NOT_READABLE + r"a header of 1000000 bytes, larger than the file")
    path.write_bytes(b"\x01\x02")
    _refused(path, tmp_path, _expect(path), NOT_READABLE + r"shorter than its 8-byte header length")
    # 1.2 million empty tensors: a 70 MB header that safetensors would take gigabytes and half a minute over
    entries = ",".join(f'"t{i}":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}' for i in range(1_200_000))
    path = _hand(tmp_path, ("{" + entries + "}").encode())
    expect = ShardExpectation(path.stat().st_size, None, frozenset({"t0", "t1"}))
    start = time.perf_counter()
    _refused(path, tmp_path, expect, NOT_READABLE + r"a header of \d+ bytes, larger than the file or the \d+ bytes")
    assert time.perf_counter() - start < 2.0


def test_long_non_ascii_role_names_stay_within_the_header_bound(tmp_path: Path) -> None:
    """Names may hold 1024 characters; JSON escapes them up to 6 bytes per UTF-8 byte."""
    roles = [f"{i}" + "\U0001f600" * 1023 for i in range(40)]
    grads = {role: torch.randn(2, 3) for role in roles}
    path = tmp_path / "s.safetensors"
    size, sha256, _ = write_shard(
        path, [([dense_record("x", grads, dict.fromkeys(roles, "p"))], {"sample_id": torch.arange(2)})], "fp16", {}
    )
    required, _ = expected_keys([((), [("dense", roles)])], "fp16")
    assert int.from_bytes(path.read_bytes()[:8], "little") > 1 << 19  # far past the fixed slack
    data = read_shard(path, tmp_path, ShardExpectation(size, sha256, required))
    _assert_same(data, _reference(path))


pytestmark = pytest.mark.usefixtures("no_leaked_descriptors")
