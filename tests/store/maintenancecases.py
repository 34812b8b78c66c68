"""What the maintenance tests share: a digest of every file in and around a store, references read from the
shards' own bytes with safetensors, and metadata-only stores built in bulk (journal lines and shards written
directly, as the writer lays them out, without a training loop)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save

from metastore_plugins.core.store.shards import manifest as mf
from metastore_plugins.core.store.shards.entries import new_entry
from metastore_plugins.core.store.shards.journal import encode_line


def tree(root: Path) -> dict[str, str]:
    """``relative path -> sha256`` of every regular file under ``root`` (links as ``link -> target``, directories
    and special files by kind), links never followed: what a test compares before and after."""
    out: dict[str, str] = {}
    for folder, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            path = Path(folder) / name
            mode = os.lstat(path).st_mode
            key = str(path.relative_to(root))
            if stat.S_ISLNK(mode):
                out[key] = f"link -> {os.readlink(path)}"
            elif stat.S_ISREG(mode):
                out[key] = hashlib.sha256(path.read_bytes()).hexdigest()
            elif stat.S_ISDIR(mode):
                out[key] = "directory"
            else:
                out[key] = "special"
    return out


def changed(before: dict[str, str], after: dict[str, str]) -> set[str]:
    """Paths added, removed or different."""
    return {key for key in before.keys() | after.keys() if before.get(key) != after.get(key)}


def shard_samples(path: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Per sample id, the gradients its shard holds, from the shard's own tensors read with safetensors: record
    ``r0`` is ``fc`` (outer: ``grad W = sum_rows suffix^T prefix``, ``grad b = sum_rows suffix``), ``r1`` is ``ln``
    (dense), as ``storecases.synthetic_batch`` writes them (fp32, so the stored values are the written ones)."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    with safe_open(str(path), framework="pt") as handle:
        keys = set(handle.keys())
        j = 0
        while f"b{j}/meta/sample_id" in keys:
            ids = handle.get_tensor(f"b{j}/meta/sample_id")  # (B,)
            prefix = handle.get_tensor(f"b{j}/r0/prefix")[:, 0]  # (R, d_in)
            suffix = handle.get_tensor(f"b{j}/r0/suffix")[:, 0]  # (R, d_out)
            rows = handle.get_tensor(f"b{j}/r0/sample").long()  # (R,)
            dense = handle.get_tensor(f"b{j}/r1/grad.weight")  # (B, d_out)
            for pos, sample in enumerate(ids.tolist()):
                mine = rows == pos
                out[sample] = {
                    "fc.weight": torch.einsum("ro,ri->oi", suffix[mine], prefix[mine]),
                    "fc.bias": suffix[mine].sum(0),
                    "ln.weight": dense[pos],
                }
            j += 1
    return out


def shard_ids(path: Path) -> list[int]:
    """The sample ids a shard holds, batch by batch, read with safetensors."""
    ids: list[int] = []
    with safe_open(str(path), framework="pt") as handle:
        keys = set(handle.keys())
        j = 0
        while f"b{j}/meta/sample_id" in keys:
            ids += handle.get_tensor(f"b{j}/meta/sample_id").tolist()
            j += 1
    return ids


def bulk_store(
    path: Path, shards: int, batches: int, size: int, distinct_points: bool = False, ids_only: bool = False
) -> np.ndarray:
    """A metadata-only rank 0 store (sample id, label, loss per sample; no records) written directly.

    Shard ``s`` holds ``batches`` batches of ``size`` samples; batch ``b`` of the store (counting across
    shards) is at step ``b``, capture point ``train`` (``p{b}`` with ``distinct_points``); ``ids_only``: no label
    and loss.
    Returns every sample id in journal order.
    """
    path.mkdir(parents=True, exist_ok=True)
    manifest = mf.new_manifest(0, {})
    (path / mf.manifest_name(0)).write_text(json.dumps(manifest))
    lines: list[bytes] = []
    first = 0
    for s in range(shards):
        tensors: dict[str, torch.Tensor] = {}
        infos: list[tuple[dict[str, Any], dict[str, torch.Tensor]]] = []
        for j in range(batches):
            b = s * batches + j
            ids = torch.arange(first, first + size, dtype=torch.int64)  # (B,)
            first += size
            meta = (
                {"sample_id": ids}
                if ids_only
                else {"sample_id": ids, "label": ids % 7, "loss": (ids % 11).float() / 10}
            )
            tensors.update({f"b{j}/meta/{key}": value for key, value in meta.items()})
            point = f"p{b}" if distinct_points else "train"
            info = {"capture_point": point, "step": b, "epoch": 0, "micro_batch": 0, "size": size, "lr": None}
            infos.append((info | {"records": []}, meta))
        blob = save(tensors, metadata={"format": mf.FORMAT, "encoding": "fp32"})
        name = mf.shard_name(0, s)
        (path / name).write_bytes(blob)
        entry = new_entry(name, len(blob), hashlib.sha256(blob).hexdigest(), "fp32", 0, infos)
        lines.append(encode_line(entry.to_json()))
    (path / "index-rank0.jsonl").write_bytes(b"".join(lines))
    (path / "rank0.lock").write_bytes(b"")  # as a writer leaves it
    return np.arange(first, dtype=np.int64)
