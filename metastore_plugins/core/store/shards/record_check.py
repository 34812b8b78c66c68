"""The checks a decoded record must pass against its manifest entry before any query sees it."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.records import EIGENBASIS_TENSORS, EXACT_KINDS, INTEGER_TENSORS, KIND_TENSORS, dense_key
from metastore_plugins.core.store.shards.encoding import is_scale_key
from metastore_plugins.core.store.shards.manifest import MAX_EMBEDDING_ROWS

#: Makes the error of a check that failed: ``(key, what) -> StoreError``.
Failure = Callable[[str, str], StoreError]


def check_record(
    path: Path,
    where: str,
    entry: dict[str, Any],
    layer: dict[str, Any],
    size: int,
    raw: dict[str, Tensor],
    tensors: dict[str, Tensor],
) -> None:
    """Check dtypes, ranks and shapes of one decoded record against its manifest entry."""

    def fail(key: str, what: str) -> StoreError:  # raised where a check fails: its message is made only then
        return StoreError(f"{path}: tensor {where}{key} {what} (layer {entry['layer']!r}, kind {entry['kind']!r})")

    for key, value in raw.items():  # row scales: float, one per row of the tensor they scale
        if is_scale_key(key, raw):
            data = raw[key[: -len(".scale")]]
            if not (
                value.is_floating_point() and value.dim() == 1 and data.dim() >= 1 and value.shape[0] == data.shape[0]
            ):
                raise fail(key, f"must be a float (R,) row scale; got {value.dtype} {tuple(value.shape)}")
    kind, shapes = entry["kind"], {role: tuple(shape) for role, shape in layer["param_shapes"].items()}
    if kind == "dense":
        for role in layer["params"]:
            key = dense_key(role)
            found = tensors.get(key)
            if found is None:
                raise fail(key, "is missing")
            if not (found.is_floating_point() and tuple(found.shape) == (size, *shapes[role])):
                raise fail(key, f"must be float {(size, *shapes[role])}; got {found.dtype} {tuple(found.shape)}")
        return
    for key in KIND_TENSORS[kind]:
        if key not in tensors:
            raise fail(key, "is missing")
    if kind not in EXACT_KINDS:
        _check_kept(fail, tensors, kind, size)
        return
    for key in KIND_TENSORS[kind]:
        value = tensors[key]
        if key in INTEGER_TENSORS:
            if value.is_floating_point() or value.dim() != 1:
                raise fail(key, f"must be a 1-d integer tensor; got {value.dtype} {tuple(value.shape)}")
        elif not value.is_floating_point():
            raise fail(key, f"must be a float tensor; got {value.dtype}")
        if value.shape[0] != tensors["suffix"].shape[0]:
            raise fail(key, f"has {value.shape[0]} rows, suffix has {tensors['suffix'].shape[0]}")
    sample = tensors["sample"]
    if not _within(sample, size):
        raise fail("sample", f"holds samples outside 0..{size - 1}")
    if not bool((sample[1:] >= sample[:-1]).all()):
        raise fail("sample", "is not grouped by sample in ascending order")
    suffix = tensors["suffix"]
    if kind == "embedding":
        vocab, dim = (shapes.get("weight", ()) + (0, 0))[:2]
        if not (suffix.dim() == 2 and suffix.shape[1] == dim and len(shapes.get("weight", ())) == 2):
            raise fail("suffix", f"must be (R, {dim}); got {tuple(suffix.shape)}")
        if vocab > MAX_EMBEDDING_ROWS:
            raise fail(
                "ids",
                f"belongs to an embedding of {vocab} rows in the manifest's shape, more than the "
                f"{MAX_EMBEDDING_ROWS} a query holds: the manifest's shape is not the stored layer's",
            )
        if not _within(tensors["ids"], vocab):
            raise fail("ids", f"holds token ids outside 0..{vocab - 1}")
        return
    prefix = tensors["prefix"]
    if prefix.dim() != 3:
        raise fail("prefix", f"must be (R, G, d_in); got {tuple(prefix.shape)}")
    if not (suffix.dim() == 3 and suffix.shape[1] == prefix.shape[1]):
        raise fail("suffix", f"must be (R, G, d_out); got {tuple(suffix.shape)}")
    groups, d_in, d_out = prefix.shape[1], prefix.shape[2], suffix.shape[2]
    if "weight" in shapes:  # out_in: (G d_out, *rest), prod(rest) = d_in; in_out: (d_in, *rest), prod(rest) = G d_out
        weight = shapes["weight"]
        first, rest = (groups * d_out, d_in) if layer["layout"] == "out_in" else (d_in, groups * d_out)
        if not (len(weight) >= 2 and weight[0] == first and math.prod(weight[1:]) == rest):
            raise fail(
                "prefix",
                f"and suffix do not make a weight of shape {weight} ({layer['layout']}: {groups} group(s) of d_out "
                f"{d_out}, d_in {d_in}): the manifest's shape or layout is not the stored layer's",
            )
    if "bias" in shapes and groups * d_out != math.prod(shapes["bias"]):
        raise fail("suffix", f"does not make a bias of shape {shapes['bias']}")


def _within(values: Tensor, bound: int) -> bool:
    """Whether every entry of integer ``values`` lies in ``0..bound - 1``."""
    return values.numel() == 0 or (int(values.min()) >= 0 and int(values.max()) < bound)


def _check_kept(fail: Failure, tensors: dict[str, Tensor], kind: str, size: int) -> None:
    """A ``"projected"`` record: ``projected (B, k_out, k_in)`` and ``sq_norm (B,)``; a ``"norms"`` one: ``sq_norm``."""
    sq_norm = tensors.get("sq_norm", torch.empty(0))
    if not (sq_norm.is_floating_point() and tuple(sq_norm.shape) == (size,)):
        raise fail("sq_norm", f"must be float ({size},); got {sq_norm.dtype} {tuple(sq_norm.shape)}")
    if kind == "projected":
        projected = tensors.get("projected", torch.empty(0))
        if not (projected.is_floating_point() and projected.dim() == 3 and projected.shape[0] == size):
            raise fail(
                "projected", f"must be float ({size}, k_out, k_in); got {projected.dtype} {tuple(projected.shape)}"
            )
        _check_eigenbasis(fail, tensors, tuple(projected.shape[1:]))


def _check_eigenbasis(fail: Failure, tensors: dict[str, Tensor], block: tuple[int, ...]) -> None:
    """A projected record's curvature eigenbasis tensors: all or none, ``basis (1,)`` integer,
    ``eigenvalues (k_out, k_in)`` and ``mean_eigenvalue (1,)`` finite float, not negative."""
    present = [key for key in EIGENBASIS_TENSORS if key in tensors]
    if not present:
        return
    if len(present) != len(EIGENBASIS_TENSORS):
        raise fail("basis", f"needs all of {EIGENBASIS_TENSORS}; has {present}")
    basis, values, mean = (tensors[key] for key in EIGENBASIS_TENSORS)
    if basis.is_floating_point() or tuple(basis.shape) != (1,):
        raise fail("basis", "must be an integer (1,) tensor")
    for key, value, shape in (("eigenvalues", values, block), ("mean_eigenvalue", mean, (1,))):
        if not (value.is_floating_point() and tuple(value.shape) == shape and _finite_non_negative(value)):
            raise fail(key, f"must be finite, non-negative float {shape}; got {value.dtype} {tuple(value.shape)}")


def _finite_non_negative(value: Tensor) -> bool:
    """Every entry finite and not negative: ``0 <= min`` (False for a NaN) and ``max < inf``, by numpy where the
    dtype allows (a record's eigenvalues are read with each step record: torch's per-call cost was most of it)."""
    if value.numel() == 0:
        return True
    if value.dtype not in (torch.float32, torch.float64):
        return bool(torch.isfinite(value).all()) and bool((value >= 0).all())
    if value.numel() == 1:
        return 0 <= value.item() < math.inf
    array = value.detach().numpy()
    return bool(array.min() >= 0 and array.max() < math.inf)
