"""Weight snapshots in the store: the weights at a checkpoint pass, for exact recomputation.

``<store>/snapshots/<name>-rank<r>.safetensors`` holds the trainable parameters as fp32 and the
floating-point buffers (BatchNorm running statistics) in their own dtype. To save bytes a snapshot
refers to the previous one of its rank (``base`` in its metadata) and stores, per parameter ``p``:

- nothing, when every row (dim 0) of ``p`` is bitwise equal to the base's (frozen in practice);
- ``rows/<p>`` (``(n,)`` int64 row indices) and ``part/<p>`` (``(n, ...)`` those rows), when that is
  smaller than ``p``: ``n (row_bytes + 8) < p_bytes`` (an embedding whose unseen tokens never moved);
- ``full/<p>`` otherwise. Buffers likewise, under ``buffers/full/``, ``buffers/rows/``, ``buffers/part/``.

Loading resolves the chain exactly: ``s_k`` is ``s_0`` (full) with the rows of ``s_1 .. s_k`` applied
in order, every value a bitwise copy. Files are written whole to a temporary name and renamed;
``__metadata__`` holds the format tag, name, step, rank, base, attributes (JSON), the parameters'
shapes (``shapes``, JSON) and the buffers' (``buffer_shapes``; absent in snapshots written before
buffers were kept). Writing a name again first rewrites in full the snapshots whose base it is.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save
from torch import Tensor, nn

from metastore_plugins.core.store.manifest import StoreError, atomic_write_bytes

FORMAT = "metastore-snapshot/1"
DIRECTORY = "snapshots"
BUFFERS = "buffers/"  # key prefix of the buffers' entries
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")
_FILE = re.compile(r"(.+)-rank(\d+)\.safetensors")

#: A snapshot's contents: (parameters, buffers) by name; buffers None where the snapshot kept none.
Weights = tuple[dict[str, Tensor], dict[str, Tensor] | None]


@dataclass(frozen=True)
class SnapshotInfo:
    """One snapshot: its name, the step it was taken at, its rank, file and size, base and attributes."""

    name: str
    step: int
    rank: int
    path: Path
    nbytes: int
    base: str | None = None
    attributes: dict[str, Any] = field(default_factory=dict)


def trainable(model: nn.Module) -> dict[str, Tensor]:
    """The trainable parameters of ``model`` by name (shared ones once)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def floating_buffers(model: nn.Module) -> dict[str, Tensor]:
    """The floating-point buffers of ``model`` by name (running statistics; not integer counters or masks)."""
    return {name: b for name, b in model.named_buffers() if b.is_floating_point()}


def snapshot_bytes(model: nn.Module) -> int:
    """Bytes of a full snapshot of ``model``: its trainable parameters as fp32 and its floating buffers."""
    buffers = sum(b.numel() * b.element_size() for b in floating_buffers(model).values())
    return 4 * sum(p.numel() for p in trainable(model).values()) + buffers


def snapshot_path(store_dir: str | os.PathLike[str], name: str, rank: int = 0) -> Path:
    """``<store_dir>/snapshots/<name>-rank<rank>.safetensors``, for a valid name and rank."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"a snapshot name must be 1-100 letters, digits, '_', '.' or '-'; got {name!r}")
    if not isinstance(rank, int) or rank < 0:
        raise ValueError(f"a snapshot rank must be an int >= 0; got {rank!r}")
    return Path(store_dir) / DIRECTORY / f"{name}-rank{rank}.safetensors"


class SnapshotWriter:
    """Writes the snapshots of one rank, each relative to the previous one (kept in memory, on the CPU).

    Args:
        store_dir: the store directory (``snapshots/`` is made in it).
        rank: the rank whose snapshots these are.
        continue_chain: the first snapshot refers to the latest one of ``rank`` already in the store
            (loaded once) instead of being written in full.
    """

    def __init__(self, store_dir: str | os.PathLike[str], rank: int = 0, *, continue_chain: bool = False) -> None:
        self.store_dir, self.rank = Path(store_dir), rank
        self._base: tuple[str, dict[str, Tensor], dict[str, Tensor] | None] | None = None
        for info in reversed(_infos(self.store_dir, rank) if continue_chain else []):  # the latest readable one
            try:
                self._base = (info.name, *_resolve(self.store_dir, info.name, rank))
                break
            except StoreError:
                continue

    def write(
        self, model: nn.Module, *, name: str, step: int, attributes: dict[str, Any] | None = None
    ) -> SnapshotInfo:
        """Write ``model``'s trainable weights (and floating buffers) as snapshot ``name``; returns what was written."""
        path = snapshot_path(self.store_dir, name, self.rank)
        params = {
            key: p.detach().to("cpu", torch.float32, copy=True).contiguous() for key, p in trainable(model).items()
        }
        buffers = {key: b.detach().to("cpu", copy=True).contiguous() for key, b in floating_buffers(model).items()}
        if path.exists():
            self._detach_dependents(name)
        base_name, base, base_buffers = self._base if self._base is not None and self._base[0] != name else ("", {}, {})
        tensors = _delta(params, base, "") | _delta(buffers, base_buffers or {}, BUFFERS)
        meta = {"name": name, "step": str(int(step)), "rank": str(self.rank), "base": base_name}
        _save(path, tensors, {**meta, "attributes": json.dumps(attributes or {}, allow_nan=False)}, (params, buffers))
        self._base = (name, params, buffers)
        return _info(path)

    def _detach_dependents(self, name: str) -> None:
        """Rewrite in full each snapshot whose base is ``name`` (about to be replaced); broken ones stay as they are."""
        for info in _infos(self.store_dir, self.rank):
            if info.base != name:
                continue
            try:
                params, buffers = _resolve(self.store_dir, info.name, self.rank)
            except StoreError:
                continue
            tensors = {f"full/{k}": v for k, v in params.items()}
            tensors |= {f"{BUFFERS}full/{k}": v for k, v in (buffers or {}).items()}
            meta = {"name": info.name, "step": str(info.step), "rank": str(self.rank), "base": ""}
            _save(info.path, tensors, {**meta, "attributes": json.dumps(info.attributes)}, (params, buffers))


def _delta(new: dict[str, Tensor], old: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The entries that turn ``old`` into ``new`` bitwise (see the module docstring)."""
    out: dict[str, Tensor] = {}
    for key, value in new.items():
        before = old.get(key)
        if before is None or before.shape != value.shape or before.dtype != value.dtype or value.numel() == 0:
            out[f"{prefix}full/{key}"] = value
            continue
        rows = value.shape[0] if value.dim() else 1
        changed = (_bits(value, rows) != _bits(before, rows)).any(1)  # (rows,) bitwise: -0.0 != 0.0, NaN == NaN
        count = int(changed.sum())
        if count == 0:
            continue
        if value.dim() and count * (value.nbytes // rows + 8) < value.nbytes:
            index = changed.nonzero().squeeze(1)  # (n,) int64
            out[f"{prefix}rows/{key}"], out[f"{prefix}part/{key}"] = index, value[index].contiguous()
        else:
            out[f"{prefix}full/{key}"] = value
    return out


def _bits(value: Tensor, rows: int) -> Tensor:
    return value.reshape(-1).view(torch.uint8).reshape(rows, -1)  # (rows, row_bytes)


def _save(path: Path, tensors: dict[str, Tensor], meta: dict[str, str], params: Weights) -> None:
    """Write a snapshot file whole to a temporary name, then rename it (``params``: what it resolves to)."""
    shapes = [json.dumps({key: list(value.shape) for key, value in (group or {}).items()}) for group in params]
    metadata = {"format": FORMAT, **meta, "shapes": shapes[0], "buffer_shapes": shapes[1]}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, save(tensors, metadata=metadata))


def _info(path: Path) -> SnapshotInfo:
    meta = _metadata(path)
    try:
        step, rank, size = int(meta["step"]), int(meta["rank"]), path.stat().st_size
        return SnapshotInfo(meta["name"], step, rank, path, size, meta["base"] or None, json.loads(meta["attributes"]))
    except (ValueError, OSError) as exc:
        raise StoreError(f"{path}: a damaged snapshot ({exc}); delete it and take it again") from exc


def _metadata(path: Path) -> dict[str, str]:
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
    except (OSError, SafetensorError) as exc:
        raise StoreError(f"{path}: a damaged snapshot, not readable ({exc}); delete it and take it again") from exc
    missing = {"format", "name", "step", "rank", "base", "attributes", "shapes"} - set(meta)
    if meta.get("format") != FORMAT or missing:
        what = f"format {meta.get('format')!r}, missing {sorted(missing)}"
        raise StoreError(f"{path}: not a metastore snapshot ({what}); move it out of snapshots/")
    return meta


def _infos(store_dir: Path, rank: int | None = None, strict: bool = False) -> list[SnapshotInfo]:
    """The snapshots of ``rank`` (all: None) by step, rank, name; damaged ones raise if ``strict``, else are skipped."""
    directory, found = store_dir / DIRECTORY, []
    for name in sorted(os.listdir(directory)) if directory.is_dir() else []:
        match = _FILE.fullmatch(name)
        if match and (rank is None or int(match.group(2)) == rank):
            try:
                found.append(_info(directory / name))
            except StoreError:
                if strict:
                    raise
    return sorted(found, key=lambda info: (info.step, info.rank, info.name))


def list_snapshots(store_dir: str | os.PathLike[str]) -> list[SnapshotInfo]:
    """The snapshots of a store, by step then rank (none: an empty list).

    Raises:
        StoreError: naming the file, when a snapshot's header is damaged.
    """
    return _infos(Path(store_dir), strict=True)


def load_snapshot(store_dir: str | os.PathLike[str], name: str, rank: int = 0) -> dict[str, Tensor]:
    """The full fp32 weights of every trainable parameter of snapshot ``name`` (its chain of bases resolved).

    Raises:
        StoreError: naming the file, when it (or a base it refers to) is missing or damaged.
    """
    return _resolve(Path(store_dir), name, rank)[0]


def load_snapshot_state(store_dir: str | os.PathLike[str], name: str, rank: int = 0) -> Weights:
    """``(parameters, buffers)`` of snapshot ``name``: :func:`load_snapshot`'s and the floating buffers by name
    (None for a snapshot written before buffers were kept)."""
    return _resolve(Path(store_dir), name, rank)


def _resolve(store_dir: Path, name: str, rank: int) -> Weights:
    chain: list[tuple[Path, dict[str, str]]] = []
    current: str | None = name
    while current:
        path = snapshot_path(store_dir, current, rank)
        if not path.is_file():
            known = ", ".join(info.name for info in _infos(store_dir, rank)) or "none"
            what = "snapshot is" if current == name else f"base snapshot {current!r} of {name!r} is"
            raise StoreError(f"{path}: the {what} missing (snapshots of rank {rank}: {known}); take it again")
        if any(path == seen for seen, _ in chain):
            raise StoreError(f"{path}: snapshot {name!r} refers to itself through its bases; take it again")
        meta = _metadata(path)
        chain.append((path, meta))
        current = meta["base"] or None
    groups: dict[str, dict[str, Tensor]] = {"": {}, BUFFERS: {}}
    for path, meta in reversed(chain):  # the oldest first
        try:
            _apply(path, groups)
        except (OSError, SafetensorError, ValueError, IndexError, RuntimeError) as exc:
            raise StoreError(
                f"{path}: a damaged snapshot ({type(exc).__name__}: {exc}); delete it and take it again"
            ) from exc
        for prefix, shapes in ("", json.loads(meta["shapes"])), (BUFFERS, json.loads(meta.get("buffer_shapes", "{}"))):
            values = groups[prefix] = {key: value for key, value in groups[prefix].items() if key in shapes}
            wrong = sorted(key for key, shape in shapes.items() if key not in values or [*values[key].shape] != shape)
            if wrong:
                what = "buffers" if prefix else "parameters"
                raise StoreError(f"{path}: a damaged snapshot: {what} {wrong[:5]} missing or of the wrong shape")
    return groups[""], groups[BUFFERS] if "buffer_shapes" in chain[0][1] else None


def _apply(path: Path, groups: dict[str, dict[str, Tensor]]) -> None:
    """Apply the entries of one snapshot file to the parameters (``groups[""]``) and buffers of its base."""
    with safe_open(str(path), framework="pt") as handle:
        for key in handle.keys():
            prefix = BUFFERS if key.startswith(BUFFERS) else ""
            kind, entry = key[len(prefix) :].split("/", 1)
            values = groups[prefix]
            if kind == "full":
                values[entry] = handle.get_tensor(key)
            elif kind == "rows":
                if entry not in values:
                    raise ValueError(f"{entry!r} changes rows of a tensor its base does not hold")
                values[entry] = values[entry].clone()
                values[entry][handle.get_tensor(key)] = handle.get_tensor(f"{prefix}part/{entry}")


def write_snapshot(
    store_dir: str | os.PathLike[str],
    model: nn.Module,
    *,
    name: str,
    step: int,
    rank: int = 0,
    attributes: dict[str, Any] | None = None,
) -> SnapshotInfo:
    """Write one snapshot of ``model``, relative to the latest snapshot of ``rank`` in the store (if any).

    Loads that snapshot to compare with; :class:`SnapshotWriter` keeps it in memory across writes.
    """
    writer = SnapshotWriter(store_dir, rank, continue_chain=True)
    return writer.write(model, name=name, step=step, attributes=attributes)
