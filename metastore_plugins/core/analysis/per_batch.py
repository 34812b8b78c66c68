"""Per-batch helpers of the training-dynamics queries: sums over shared parameters, top entries, argument checks."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import overload

import numpy as np
import torch
from torch import Tensor

from metastore_plugins.core import ops
from metastore_plugins.core.errors import ConfigError, QueryError
from metastore_plugins.core.records import LayerRecord


def positive_int(name: str, value: int) -> int:
    """``value`` as an int, or a ``ValueError`` naming the argument if it is not a positive integer."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


@overload
def positive_number(name: str, value: float) -> float: ...


@overload
def positive_number(name: str, value: None) -> None: ...


def positive_number(name: str, value: float | None) -> float | None:
    """``value`` as a float (``None`` unchanged), or a ``ValueError`` naming ``name`` if it is no positive number."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not value > 0:
        raise ConfigError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def add_to(total: dict[str, Tensor], name: str, value: Tensor) -> None:
    """``total[name] += value``, starting from ``value``."""
    total[name] = total[name] + value if name in total else value


def holders(records: Sequence[LayerRecord], names: Iterable[str]) -> dict[str, list[LayerRecord]]:
    """Parameter name -> the records of a batch that hold it (several for shared parameters)."""
    wanted = set(names)
    held: dict[str, list[LayerRecord]] = {}
    for record in records:
        for name in record.params.values():
            if name in wanted:
                held.setdefault(name, []).append(record)
    return held


def abs_sum(records: Sequence[LayerRecord], names: Iterable[str], max_bytes: int) -> dict[str, Tensor]:
    """``sum_i |g_i|`` per parameter for one batch; shared parameters are summed before ``abs``."""
    out: dict[str, Tensor] = {}
    for name, held in holders(records, names).items():
        if len(held) == 1:
            out[name] = ops.abs_grad_accumulate(held[0], params=[name], max_bytes=max_bytes)[name]
            continue
        batch = held[0].batch_size
        numel = math.prod(next(r.param_shapes[role] for r in held for role, n in r.params.items() if n == name))
        for lo, hi in ops.chunks(batch, max_bytes // (8 * numel + 1)):
            grad: Tensor | None = None
            for record in held:
                part = ops.restore_chunk(record, lo, hi, [name])[name]  # (n, *shape)
                grad = part if grad is None else grad + part
            if grad is not None:
                add_to(out, name, grad.abs().sum(0))
    return out


def entry_values(records: Sequence[LayerRecord], name: str, entries: Tensor, max_bytes: int) -> Tensor:
    """``(B, E)`` per-sample gradient of the given entries of parameter ``name`` (all holders summed)."""
    total: Tensor | None = None
    for record in holders(records, [name]).get(name, []):
        role = next(role for role, n in record.params.items() if n == name)
        part = ops.entry_gradients(record, role, entries, max_bytes)  # (B, E)
        total = part if total is None else total + part
    if total is None:
        raise QueryError(f"a stored batch holds no record of parameter '{name}'")
    return total


def top_entries(values: Tensor, k: int) -> tuple[list[tuple[int, ...]], list[float]]:
    """The ``k`` largest entries of ``values`` as index tuples (largest first) and their values."""
    flat = values.reshape(-1).double()
    order = torch.sort(flat, descending=True, stable=True).indices[: min(k, flat.numel())]
    index = np.unravel_index(order.numpy(), tuple(values.shape))
    return [tuple(int(i[j]) for i in index) for j in range(order.numel())], flat[order].tolist()
