"""The row delta of a snapshot against its base: the entries written, and how they are applied back.

Per tensor ``p`` of the new weights, against the base's ``b`` (same name, shape and dtype):

- nothing, when every row (dim 0) of ``p`` is bitwise equal to ``b``'s;
- ``rows/<p>`` (``(n,)`` int64 indices of the rows that differ) and ``part/<p>`` (``(n, ...)`` those
  rows of ``p``), when ``n (row_bytes + 8) < p_bytes``;
- ``full/<p>`` otherwise (or when ``b`` is missing, of another shape or dtype, or ``p`` is empty).

Applying the entries to ``b`` gives ``p`` bitwise; every index and shape is checked first.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.store.snapshots.snapshot_check import BUFFERS, entry_kind


def delta(new: dict[str, Tensor], old: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The entries (keys under ``prefix``) that turn ``old`` into ``new`` bitwise."""
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


def apply(tensors: dict[str, Tensor], groups: dict[str, dict[str, Tensor]], path: Path) -> None:
    """Apply the entries of one snapshot file to the parameters (``groups[""]``) and buffers of its base."""
    for key, value in tensors.items():
        buffer, kind, entry = entry_kind(key)
        prefix = BUFFERS if buffer else ""
        values = groups[prefix]
        if kind == "full":
            values[entry] = value
        elif kind == "rows":
            part = tensors.get(f"{prefix}part/{entry}")
            if entry not in values or part is None:
                raise StoreError(
                    f"{path}: a damaged snapshot ({key!r} changes rows of a tensor its base does not hold, or has no "
                    "part); delete it and take it again"
                )
            values[entry] = _apply_rows(values[entry], value, part, key, path)
        elif f"{prefix}rows/{entry}" not in tensors:  # a part without its rows
            raise StoreError(f"{path}: a damaged snapshot ({key!r} has no rows); delete it and take it again")


def _apply_rows(values: Tensor, rows: Tensor, part: Tensor, key: str, path: Path) -> Tensor:
    """``values`` with rows ``rows`` replaced by ``part``, refused unless every index and shape fits exactly."""
    fits = (
        rows.dim() == 1
        and values.dim() >= 1
        and part.shape == (rows.numel(), *values.shape[1:])
        and part.dtype == values.dtype
        and (rows.numel() == 0 or (int(rows.min()) >= 0 and int(rows.max()) < values.shape[0]))
    )
    if not fits:
        raise StoreError(
            f"{path}: a damaged snapshot ({key!r}: rows {list(rows.shape)} outside, or not of the shape of, its "
            f"tensor {list(values.shape)}); delete it and take it again"
        )
    out = values.clone()  # (rows, ...) the base's tensor, its changed rows replaced
    out[rows] = part
    return out
