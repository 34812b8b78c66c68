"""Sketches computed once and kept: ``<store>/sketches/*.safetensors``.

One file per (capture point, ``dim``, seed, layer set) holds two tensors in the selection
order of the capture point (``store.sample_ids(capture_point)``):

- ``sketch``: ``(N, dim * dim)`` float32, the per-sample Kronecker sketches summed over the layers;
- ``sample_id``: ``(N,)`` int64.

Its string metadata says what it was computed from. A reader uses a file only when all hold:

- ``format`` and ``version`` are this module's, and ``capture_point``, ``dim``, ``seed`` and
  ``layers`` are the ones asked for;
- ``binding`` equals the sha256 of the capture point's batches as the manifests list them
  now (``(shard file, batch index, shard sha256)`` in selection order): a store that grew,
  lost or rewrote a shard of that capture point gets different sketches, which are recomputed;
- the tensors have the dtypes and shapes above (``N`` from the manifests), are finite, and
  their bytes hash to ``checksum``.

Anything else (a missing, truncated, damaged or foreign file, a link, a FIFO or device, a
``sketches/`` that is a link) is ignored unread, and the sketches are recomputed. Files are
read whole within a cap from ``N`` and written through the store's files module
(:meth:`~metastore_plugins.core.store.files.StoreDir.atomic_write`: an unguessable temporary,
fsynced, renamed over the old file or link), so readers see a whole file or none and nothing
outside the store is ever written. A store that cannot be written (read-only, a linked
``sketches/``) gets its sketches computed in memory, without error. Shards and manifests are
never written.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes
from torch import Tensor

from metastore_plugins.core.errors import ConfigError, StoreError
from metastore_plugins.core.store.files import StoreDir

#: The folder of the cache inside a store directory.
CACHE_DIR = "sketches"
FORMAT, VERSION = "metastore-sketches", "1"

#: Bytes a cache file may hold beyond its tensors (header and metadata) before it is refused unread.
MAX_HEADER_BYTES = 1 << 20


@dataclass(frozen=True)
class SketchKey:
    """What a cache file must have been computed from to be used.

    Attributes:
        capture_point: the capture point sketched.
        dim: ``k_out = k_in``; a sketch has ``dim * dim`` entries.
        seed: the projections' seed.
        layers: the layers summed, sorted.
        binding: :func:`binding` of the capture point's batches.
        samples: ``N``, the sample occurrences of the capture point.
    """

    capture_point: str
    dim: int
    seed: int
    layers: tuple[str, ...]
    binding: str
    samples: int

    def file_name(self) -> str:
        """``sketch-d{dim}-s{seed}-{hash of capture point and layers}.safetensors`` (no path characters)."""
        named = json.dumps([self.capture_point, list(self.layers)]).encode()
        return f"sketch-d{self.dim}-s{self.seed}-{hashlib.sha256(named).hexdigest()[:16]}.safetensors"

    def metadata(self) -> dict[str, str]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "capture_point": self.capture_point,
            "dim": str(self.dim),
            "seed": str(self.seed),
            "layers": json.dumps(list(self.layers)),
            "binding": self.binding,
            "samples": str(self.samples),
        }


def binding(batches: Sequence[tuple[str, int, str]]) -> str:
    """sha256 of ``(shard file, batch index, shard sha256)`` per batch, in selection order."""
    return hashlib.sha256(json.dumps([list(b) for b in batches]).encode()).hexdigest()


def _checksum(sample_ids: Tensor, sketch: Tensor) -> str:
    digest = hashlib.sha256(np.ascontiguousarray(sample_ids.numpy()).tobytes())
    digest.update(np.ascontiguousarray(sketch.numpy()).tobytes())
    return digest.hexdigest()


def cache_path(store_dir: Path, key: SketchKey) -> Path:
    return store_dir / CACHE_DIR / key.file_name()


def _parse(data: bytes) -> tuple[dict[str, str], dict[str, Tensor]] | None:
    """``(metadata, tensors)`` of a safetensors file's bytes, or None when its header is not sound."""
    if len(data) < 8 or int.from_bytes(data[:8], "little") > min(MAX_HEADER_BYTES, len(data) - 8):
        return None
    try:
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
        tensors = load_bytes(data)  # copies of the checked bytes
    except (ValueError, RecursionError, SafetensorError):
        return None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return (meta if isinstance(meta, dict) else {}), tensors


def load(store_dir: Path, key: SketchKey) -> tuple[np.ndarray, Tensor] | None:
    """``(sample ids (N,), sketch (N, dim^2))`` from the cache file of ``key``, or ``None`` if it is unusable."""
    width = key.dim * key.dim
    cap = key.samples * (4 * width + 8) + MAX_HEADER_BYTES
    try:  # never through a link, never a FIFO or device, never more than the sketches can take
        with StoreDir(store_dir) as store, store.subdir(CACHE_DIR) as folder:
            parsed = _parse(folder.read(key.file_name(), cap, "sketch cache file"))
    except (OSError, StoreError):  # missing or unusable: rebuilt by the caller
        return None
    if parsed is None:
        return None
    meta, tensors = parsed
    if set(tensors) != {"sketch", "sample_id"} or {k: meta.get(k) for k in key.metadata()} != key.metadata():
        return None
    sketch, ids = tensors["sketch"], tensors["sample_id"]
    if sketch.dtype != torch.float32 or tuple(sketch.shape) != (key.samples, width):
        return None
    if ids.dtype != torch.int64 or tuple(ids.shape) != (key.samples,):
        return None
    if meta.get("checksum") != _checksum(ids, sketch) or not bool(torch.isfinite(sketch).all()):
        return None
    return ids.numpy(), sketch


def save(store_dir: Path, key: SketchKey, sample_ids: np.ndarray, sketch: Tensor) -> Path | None:
    """Write the cache file of ``key`` atomically; ``None`` (and no file) where the store cannot be written
    or ``sketches/`` (or the file) is not the store's own (a link, a FIFO: never written through)."""
    ids = torch.as_tensor(np.asarray(sample_ids, dtype=np.int64))  # (N,)
    sketch = sketch.detach().to("cpu", torch.float32).contiguous()  # (N, dim^2)
    if tuple(sketch.shape) != (key.samples, key.dim * key.dim) or math.prod(ids.shape) != key.samples:
        raise ConfigError(f"sketch {tuple(sketch.shape)} and ids {tuple(ids.shape)} do not fit {key}")
    metadata = {**key.metadata(), "checksum": _checksum(ids, sketch)}
    try:
        data = save_bytes({"sketch": sketch, "sample_id": ids}, metadata=metadata)
        with StoreDir(store_dir) as store, store.subdir(CACHE_DIR, create=True) as folder:
            folder.atomic_write(key.file_name(), data)
    except (OSError, StoreError, SafetensorError):  # read-only store, full disk: compute per query instead
        return None
    return cache_path(store_dir, key)
