"""Writing one shard file: records encoded straight into one buffer, saved as safetensors.

The safetensors format: an 8-byte little-endian header length, a JSON header giving each
tensor's ``dtype``, ``shape`` and ``data_offsets`` (plus ``__metadata__``), padded with spaces
to a multiple of 8, then the tensors' bytes back to back. Tensors are laid out by element
size, largest first, so that each starts at a multiple of its own size.

A shard holds thousands of small tensors. Encoding each one into its place in a single
buffer, writing that buffer once and hashing it in memory costs a third of encoding into
separate tensors, serializing them and reading the file back for its checksum.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from metastore_plugins.core.capture.records import LayerRecord
from metastore_plugins.core.store import manifest as mf
from metastore_plugins.core.store.encoding import Encoding, encode_into, stored_specs

_DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}

Batches = Sequence[tuple[Sequence[LayerRecord], Mapping[str, Tensor]]]


class ShardBuffer:
    """Memory for encoding shards, kept from one shard to the next (fresh memory costs a page
    fault per 4 KiB: about a sixth of encoding a shard). It grows to the largest shard."""

    def __init__(self) -> None:
        self._memory = torch.empty(0, dtype=torch.uint8)

    def take(self, nbytes: int) -> Tensor:
        """``(nbytes,)`` uint8, valid until the next call."""
        if self._memory.numel() < nbytes:
            self._memory = torch.empty(0, dtype=torch.uint8)  # free the old one first
            self._memory = torch.empty(nbytes, dtype=torch.uint8)
        return self._memory[:nbytes]


def write_shard(
    path: str | os.PathLike[str], batches: Batches, encoding: Encoding, metadata: dict[str, str], buffer: ShardBuffer | None = None
) -> tuple[int, str]:
    """Write ``(records, metadata columns)`` batches as one safetensors file, synced to disk.

    Records are encoded (:mod:`~metastore_plugins.core.store.encoding`), metadata columns stored
    as they are, through ``buffer`` (a new one when not given). Returns the file's size in
    bytes and its sha256.
    """
    if sys.byteorder != "little":
        raise NotImplementedError("shards are written on little-endian hosts only (safetensors stores little-endian)")
    records = [
        (mf.record_key(index, k, name), tensor)
        for index, (batch_records, _) in enumerate(batches)
        for k, record in enumerate(batch_records)
        for name, tensor in record.tensors.items()
    ]
    columns = [(mf.meta_key(index, column), values) for index, (_, meta) in enumerate(batches) for column, values in meta.items()]
    specs = {key: spec for name, tensor in records for key, spec in stored_specs(name, tensor, encoding).items()}
    specs.update({key: (values.dtype, tuple(values.shape)) for key, values in columns})
    header, size = _layout(specs)
    data_section = (buffer or ShardBuffer()).take(size)  # (bytes,)
    views = {key: data_section[begin:end].view(specs[key][0]).view(specs[key][1]) for key, (begin, end) in header.items()}
    for name, tensor in records:
        encode_into(name, tensor, encoding, views)
    for key, values in columns:
        views[key].copy_(values)
    head = _header_bytes(header, specs, metadata)
    data = data_section.numpy().data
    digest = hashlib.sha256(head)
    digest.update(data)
    with open(path, "wb") as handle:
        handle.write(head)
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    return len(head) + size, digest.hexdigest()


def _layout(specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> tuple[dict[str, tuple[int, int]], int]:
    """Byte range of each tensor in the data section (largest element size first), and its size."""
    ranges: dict[str, tuple[int, int]] = {}
    offset = 0
    for key in sorted(specs, key=lambda k: -specs[k][0].itemsize):  # stable: keys keep their order within a size
        dtype, shape = specs[key]
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"{key}: dtype {dtype} cannot be stored in a shard; use one of {sorted(map(str, _DTYPE_NAMES))}")
        nbytes = math.prod(shape) * dtype.itemsize
        ranges[key] = (offset, offset + nbytes)
        offset += nbytes
    return ranges, offset


def _header_bytes(ranges: Mapping[str, tuple[int, int]], specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict[str, str]) -> bytes:
    """The length prefix and the JSON header, padded with spaces to a multiple of 8."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    for key, (begin, end) in ranges.items():
        header[key] = {"dtype": _DTYPE_NAMES[specs[key][0]], "shape": list(specs[key][1]), "data_offsets": [begin, end]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text
