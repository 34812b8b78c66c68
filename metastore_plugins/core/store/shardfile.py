"""The tensors of one shard file, and writing them fast.

A shard holds thousands of small tensors (a few per record, per batch). ``save_file`` of
``safetensors.torch`` spends most of its time on per-tensor checks for that many tensors,
so :func:`save_tensors` hands ``safetensors.serialize_file`` the tensors' memory directly
(same bytes on disk) where the installed safetensors offers ``TensorSpec``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

import safetensors
import torch
from safetensors.torch import save_file
from torch import Tensor

from metastore_plugins.core.capture.records import LayerRecord
from metastore_plugins.core.store import manifest as mf
from metastore_plugins.core.store.encoding import Encoding, encode_many

_SPEC = getattr(safetensors, "TensorSpec", None)


def shard_tensors(batches: Sequence[tuple[Sequence[LayerRecord], Mapping[str, Tensor]]], encoding: Encoding) -> dict[str, Tensor]:
    """Stored tensors of a shard of ``(records, metadata columns)`` batches: records encoded, metadata as is."""
    records = [
        (mf.record_key(index, k, name), tensor)
        for index, (batch_records, _) in enumerate(batches)
        for k, record in enumerate(batch_records)
        for name, tensor in record.tensors.items()
    ]
    tensors = encode_many(records, encoding)
    for index, (_, meta) in enumerate(batches):
        for column, values in meta.items():
            tensors[mf.meta_key(index, column)] = values
    return tensors


def save_tensors(tensors: Mapping[str, Tensor], path: str | os.PathLike[str], metadata: dict[str, str]) -> None:
    """Write contiguous CPU ``tensors`` (they may share memory) as one safetensors file."""
    if _SPEC is None or sys.byteorder != "little":
        save_file({key: value.clone() for key, value in tensors.items()}, str(path), metadata=metadata)
        return
    specs = {
        key: _SPEC(
            dtype=str(value.dtype).removeprefix("torch."), shape=tuple(value.shape),
            data_ptr=value.data_ptr(), data_len=value.numel() * value.element_size(),
        )
        for key, value in tensors.items()
    }
    safetensors.serialize_file(specs, str(path), metadata=metadata)  # `tensors` keeps the memory alive meanwhile
