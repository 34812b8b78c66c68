"""Weight snapshots in the store: the trainable parameters at a checkpoint pass, for exact recomputation.

``<store>/snapshots/<name>-rank<r>.safetensors`` holds fp32 parameters. To save bytes a snapshot
refers to the previous one of its rank (``base`` in its metadata) and stores, per parameter:

- nothing, when the parameter is bitwise equal to the base's (frozen in practice);
- ``rows/<param>`` (int64 row indices) and ``part/<param>`` (those rows), when fewer than half of
  its rows (dim 0) changed: an embedding whose unseen tokens never moved;
- ``full/<param>`` otherwise.

Loading resolves the chain exactly (every value is a bitwise copy). Files are written whole to a
temporary name and renamed; ``__metadata__`` holds the format tag, name, step, rank, base,
attributes (JSON) and every parameter's shape (JSON).
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
from safetensors.torch import save_file
from torch import Tensor, nn

from metastore_plugins.core.store.manifest import StoreError, fsync_dir

FORMAT = "metastore-snapshot/1"
DIRECTORY = "snapshots"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")
_FILE = re.compile(r"(.+)-rank(\d+)\.safetensors")


@dataclass(frozen=True)
class SnapshotInfo:
    """One snapshot: its name, the step it was taken at, its rank, file and size, and attributes."""

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


def snapshot_bytes(model: nn.Module) -> int:
    """Bytes of a full fp32 snapshot of ``model``'s trainable parameters."""
    return 4 * sum(p.numel() for p in trainable(model).values())


def snapshot_path(store_dir: str | os.PathLike[str], name: str, rank: int = 0) -> Path:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"a snapshot name must be 1-100 letters, digits, '_', '.' or '-'; got {name!r}")
    return Path(store_dir) / DIRECTORY / f"{name}-rank{rank}.safetensors"


class SnapshotWriter:
    """Writes the snapshots of one rank, each relative to the previous one (kept in memory, on the CPU)."""

    def __init__(self, store_dir: str | os.PathLike[str], rank: int = 0) -> None:
        self.store_dir, self.rank = Path(store_dir), rank
        self._base: tuple[str, dict[str, Tensor]] | None = None

    def write(
        self, model: nn.Module, *, name: str, step: int, attributes: dict[str, Any] | None = None
    ) -> SnapshotInfo:
        """Write ``model``'s trainable weights as snapshot ``name``; returns what was written."""
        path = snapshot_path(self.store_dir, name, self.rank)
        weights = {
            key: p.detach().to("cpu", torch.float32, copy=True).contiguous() for key, p in trainable(model).items()
        }
        base_name, base = self._base if self._base is not None else (None, {})
        tensors: dict[str, Tensor] = {}
        for key, value in weights.items():
            old = base.get(key)
            if old is None or old.shape != value.shape:
                tensors[f"full/{key}"] = value
                continue
            changed = (value != old).reshape(value.shape[0], -1).any(1) if value.dim() else (value != old).reshape(1)
            count = int(changed.sum())
            if count == 0:
                continue
            if value.dim() and 2 * count < value.shape[0]:
                rows = changed.nonzero().squeeze(1)  # (n,)
                tensors[f"rows/{key}"], tensors[f"part/{key}"] = rows, value[rows].contiguous()
            else:
                tensors[f"full/{key}"] = value
        metadata = {
            "format": FORMAT,
            "name": name,
            "step": str(int(step)),
            "rank": str(self.rank),
            "base": base_name or "",
            "attributes": json.dumps(attributes or {}, allow_nan=False),
            "shapes": json.dumps({key: list(value.shape) for key, value in weights.items()}),
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        try:
            save_file(tensors, str(tmp), metadata=metadata)
            with open(tmp, "rb") as handle:
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)
        self._base = (name, weights)
        return _info(path)


def _info(path: Path) -> SnapshotInfo:
    meta = _metadata(path)
    return SnapshotInfo(
        meta["name"],
        int(meta["step"]),
        int(meta["rank"]),
        path,
        path.stat().st_size,
        meta["base"] or None,
        json.loads(meta["attributes"]),
    )


def _metadata(path: Path) -> dict[str, str]:
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
    except (OSError, SafetensorError) as exc:
        raise StoreError(f"{path}: not a readable snapshot ({exc})") from exc
    missing = {"format", "name", "step", "rank", "base", "attributes", "shapes"} - set(meta)
    if meta.get("format") != FORMAT or missing:
        raise StoreError(f"{path}: not a metastore snapshot (format {meta.get('format')!r}, missing {sorted(missing)})")
    return meta


def list_snapshots(store_dir: str | os.PathLike[str]) -> list[SnapshotInfo]:
    """The snapshots of a store, by step then rank (none: an empty list)."""
    directory = Path(store_dir) / DIRECTORY
    found = (
        [_info(directory / n) for n in sorted(os.listdir(directory)) if _FILE.fullmatch(n)]
        if directory.is_dir()
        else []
    )
    return sorted(found, key=lambda info: (info.step, info.rank, info.name))


def load_snapshot(store_dir: str | os.PathLike[str], name: str, rank: int = 0) -> dict[str, Tensor]:
    """The full fp32 weights of snapshot ``name`` (its chain of bases resolved), by parameter name.

    Raises:
        StoreError: naming the file, when it (or a base it refers to) is missing or damaged.
    """
    chain, seen = [], set()
    current: str | None = name
    while current:
        path = snapshot_path(store_dir, current, rank)
        if not path.is_file():
            known = ", ".join(info.name for info in list_snapshots(store_dir) if info.rank == rank) or "none"
            what = "snapshot" if current == name else f"base snapshot {current!r} of {name!r}"
            raise StoreError(f"{path}: the {what} is missing (snapshots of rank {rank}: {known})")
        if current in seen:
            raise StoreError(f"{path}: snapshot {name!r} refers to itself through its bases")
        seen.add(current)
        chain.append(path)
        current = _metadata(path)["base"] or None
    weights: dict[str, Tensor] = {}
    for path in reversed(chain):  # the oldest first
        shapes = json.loads(_metadata(path)["shapes"])
        with safe_open(str(path), framework="pt") as handle:
            keys = set(handle.keys())
            for key in keys:
                kind, param = key.split("/", 1)
                if kind == "full":
                    weights[param] = handle.get_tensor(key)
                elif kind == "rows":
                    if param not in weights:
                        raise StoreError(f"{path}: {param!r} changes rows of a parameter its base does not hold")
                    weights[param] = weights[param].clone()
                    weights[param][handle.get_tensor(key)] = handle.get_tensor(f"part/{param}")
        weights = {key: value for key, value in weights.items() if key in shapes}
        wrong = sorted(key for key, shape in shapes.items() if key not in weights or list(weights[key].shape) != shape)
        if wrong:
            raise StoreError(f"{path}: parameters {wrong[:5]} are missing or have the wrong shape")
    return weights


def write_snapshot(
    store_dir: str | os.PathLike[str],
    model: nn.Module,
    *,
    name: str,
    step: int,
    rank: int = 0,
    attributes: dict[str, Any] | None = None,
) -> SnapshotInfo:
    """Write one full snapshot (no base): :class:`SnapshotWriter` writes chains that save bytes."""
    return SnapshotWriter(store_dir, rank).write(model, name=name, step=step, attributes=attributes)
