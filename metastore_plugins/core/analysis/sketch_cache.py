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

Anything else (a missing, truncated, damaged or foreign file, a link) is ignored, and the
sketches are recomputed and the file rewritten. Files are written under a unique temporary
name in the same folder, fsynced, then renamed over the old one (``os.replace``), so readers
see a whole file or none. A store that cannot be written (read-only) gets its sketches
computed in memory, without error. Shards and manifests are never written.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from metastore_plugins.core.store.manifest import fsync_dir

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


def load(store_dir: Path, key: SketchKey) -> tuple[np.ndarray, Tensor] | None:
    """``(sample ids (N,), sketch (N, dim^2))`` from the cache file of ``key``, or ``None`` if it is unusable."""
    path = cache_path(store_dir, key)
    width = key.dim * key.dim
    try:
        if path.parent.is_symlink() or path.is_symlink() or not path.is_file():
            return None
        if path.stat().st_size > key.samples * (4 * width + 8) + MAX_HEADER_BYTES:
            return None
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
            if (
                set(handle.keys()) != {"sketch", "sample_id"}
                or {k: meta.get(k) for k in key.metadata()} != key.metadata()
            ):
                return None
            sketch, ids = handle.get_tensor("sketch").clone(), handle.get_tensor("sample_id").clone()
    except (OSError, SafetensorError, ValueError, RuntimeError):  # unreadable: rebuilt by the caller
        return None
    if sketch.dtype != torch.float32 or tuple(sketch.shape) != (key.samples, width):
        return None
    if ids.dtype != torch.int64 or tuple(ids.shape) != (key.samples,):
        return None
    if meta.get("checksum") != _checksum(ids, sketch) or not bool(torch.isfinite(sketch).all()):
        return None
    return ids.numpy(), sketch


def save(store_dir: Path, key: SketchKey, sample_ids: np.ndarray, sketch: Tensor) -> Path | None:
    """Write the cache file of ``key`` atomically; ``None`` (and no file) where the store cannot be written."""
    ids = torch.as_tensor(np.asarray(sample_ids, dtype=np.int64))  # (N,)
    sketch = sketch.detach().to("cpu", torch.float32).contiguous()  # (N, dim^2)
    if tuple(sketch.shape) != (key.samples, key.dim * key.dim) or math.prod(ids.shape) != key.samples:
        raise ValueError(f"sketch {tuple(sketch.shape)} and ids {tuple(ids.shape)} do not fit {key}")
    path = cache_path(store_dir, key)
    tmp: Path | None = None
    try:
        if path.parent.is_symlink():
            return None
        path.parent.mkdir(exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=path.parent)
        os.close(fd)
        tmp = Path(name)
        save_file(
            {"sketch": sketch, "sample_id": ids}, name, metadata={**key.metadata(), "checksum": _checksum(ids, sketch)}
        )
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        tmp = None
    except (OSError, SafetensorError):  # read-only store, full disk: compute per query instead
        return None
    finally:
        if tmp is not None:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
    fsync_dir(path.parent)
    return path
