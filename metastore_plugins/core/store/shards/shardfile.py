"""Writing one shard file: records encoded straight into one buffer, saved as safetensors.

The safetensors format: an 8-byte little-endian header length, a JSON header giving each
tensor's ``dtype``, ``shape`` and ``data_offsets`` (plus ``__metadata__``), padded with spaces
to a multiple of 8, then the tensors' bytes back to back. Tensors are laid out by element
size, largest first, so that each starts at a multiple of its own size.

Encoding each tensor into its place in a single buffer, then writing that buffer once and
hashing it in memory, takes about half the CPU of encoding into separate tensors, serializing
them and reading the file back for its checksum (one BERT step's shard, see docs/store.md).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import torch
from torch import Tensor

from metastore_plugins.core.errors import ConfigError, UnsupportedPlatformError
from metastore_plugins.core.records import LayerRecord, meta_key, record_key
from metastore_plugins.core.store.files import StoreDir
from metastore_plugins.core.store.shards.encoding import EXACT_KEYS, Encoding, encode_into, stored_specs
from metastore_plugins.core.store.shards.shardread import digests_of

_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_ITEMSIZE = {dtype: dtype.itemsize for dtype in _DTYPE_NAMES}

#: record tensors with fewer elements are encoded in groups
_GROUPED_NUMEL = 1 << 16

Batches = Sequence[tuple[Sequence[LayerRecord], Mapping[str, Tensor]]]


class Written(NamedTuple):
    """A shard just written: its size and the checksums its journal line records (lowercase hex)."""

    bytes: int
    sha256: str
    xxh3_128: str


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
    target: BinaryIO | str | os.PathLike[str],
    batches: Batches,
    encoding: Encoding,
    metadata: dict[str, str],
    buffer: ShardBuffer | None = None,
) -> Written:
    """Write ``(records, metadata columns)`` batches as one safetensors file.

    ``target``: an open binary file (the store writes through
    :meth:`~metastore_plugins.core.store.files.StoreDir.atomic_write`,
    which syncs it), or a path, replaced the same way.
    Records are encoded (:mod:`~metastore_plugins.core.store.shards.encoding`), metadata columns stored
    as they are, through ``buffer`` (a new one when not given). Returns the file's size in
    bytes and its checksums, computed on the buffer in memory.
    """
    if sys.byteorder != "little":
        raise UnsupportedPlatformError(
            "shards are written on little-endian hosts only (safetensors stores little-endian)"
        )
    tensors = [
        (record_key(index, k, name), name, tensor)
        for index, (batch_records, _) in enumerate(batches)
        for k, record in enumerate(batch_records)
        for name, tensor in record.tensors.items()
    ]
    records = [(key, tensor) for key, name, tensor in tensors if name not in EXACT_KEYS]
    columns = [
        (meta_key(index, column), values) for index, (_, meta) in enumerate(batches) for column, values in meta.items()
    ] + [(key, tensor.float()) for key, name, tensor in tensors if name in EXACT_KEYS]
    encoded, plain = _groups(records), _groups(columns)
    specs = {
        key: spec
        for members in encoded
        for name, tensor in members
        for key, spec in stored_specs(name, tensor, encoding).items()
    }
    specs.update({name: (tensor.dtype, tuple(tensor.shape)) for members in plain for name, tensor in members})
    header, size = tensor_layout(specs)  # a group's tensors of each stored role lie next to each other
    data_section = (buffer or ShardBuffer()).take(size)  # (bytes,)
    with torch.no_grad():
        for members in encoded:  # one call per group
            joined = _joined(members)
            encode_into("", joined, encoding, _slots(data_section, header, members, stored_specs("", joined, encoding)))
        for members in plain:
            joined = _joined(members)
            _slots(data_section, header, members, {"": (joined.dtype, tuple(joined.shape))})[""].copy_(joined)
    head = header_bytes(header, specs, metadata)
    data = data_section.numpy().data
    digests = digests_of(head, data)
    if isinstance(target, (str, os.PathLike)):
        path = Path(target)
        with StoreDir(path.parent) as directory:
            directory.atomic_write(path.name, lambda handle: (handle.write(head), handle.write(data)))
    else:
        target.write(head)
        target.write(data)
    return Written(len(head) + size, digests["sha256"], digests["xxh3_128"])


def _groups(records: Sequence[tuple[str, Tensor]]) -> list[list[tuple[str, Tensor]]]:
    """Tensors in groups written with one call: small ones by dtype and row shape (a shard of a
    small MLP holds thousands), large ones alone (joining them would copy them once more). Every
    encoding works row by row, so the stored values are the same either way."""
    groups: dict[Any, list[tuple[str, Tensor]]] = {}
    for name, tensor in records:
        key = (tensor.dtype, tuple(tensor.shape[1:])) if tensor.numel() < _GROUPED_NUMEL else name
        groups.setdefault(key, []).append((name, tensor))
    return list(groups.values())


def _joined(members: list[tuple[str, Tensor]]) -> Tensor:
    return members[0][1] if len(members) == 1 else torch.cat([tensor for _, tensor in members])


def _slots(
    section: Tensor,
    ranges: Mapping[str, tuple[int, int]],
    members: list[tuple[str, Tensor]],
    roles: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
) -> dict[str, Tensor]:
    """For each stored role (``""``: data, ``".scale"``), the members' slots of ``section``.

    As one tensor of the given shape."""
    out = {}
    for role, (dtype, shape) in roles.items():
        begin, end = ranges[members[0][0] + role][0], ranges[members[-1][0] + role][1]
        out[role] = section[begin:end].view(dtype).view(shape)
    return out


def tensor_layout(specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> tuple[dict[str, tuple[int, int]], int]:
    """Byte range of each tensor in the data section (largest element size first, keys in their
    order within a size), and the section's size."""
    by_size: dict[int, list[str]] = {8: [], 4: [], 2: [], 1: []}
    for key, (dtype, _) in specs.items():
        if dtype not in _DTYPE_NAMES:
            raise ConfigError(
                f"{key}: dtype {dtype} cannot be stored in a shard; use one of {sorted(map(str, _DTYPE_NAMES))}"
            )
        by_size[_ITEMSIZE[dtype]].append(key)
    ranges: dict[str, tuple[int, int]] = {}
    offset = 0
    for itemsize, keys in by_size.items():
        for key in keys:
            nbytes = math.prod(specs[key][1]) * itemsize
            ranges[key] = (offset, offset + nbytes)
            offset += nbytes
    return ranges, offset


def header_bytes(
    ranges: Mapping[str, tuple[int, int]],
    specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    metadata: dict[str, str],
) -> bytes:
    """The length prefix and the JSON header, padded with spaces to a multiple of 8.

    Written as text: thousands of small dicts would cost more in the garbage collector's passes
    over a process full of objects than in the encoding itself."""
    entries = [json.dumps({"__metadata__": metadata})[1:-1]] if metadata else []
    for key, (begin, end) in ranges.items():
        dtype, shape = specs[key]
        entries.append(
            f'{json.dumps(key)}:{{"dtype":"{_DTYPE_NAMES[dtype]}","shape":[{",".join(map(str, shape))}],'
            f'"data_offsets":[{begin},{end}]}}'
        )
    text = ("{" + ",".join(entries) + "}").encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text
