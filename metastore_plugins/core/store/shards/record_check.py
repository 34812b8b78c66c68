"""The checks a decoded record must pass against its manifest entry before any query sees it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.records import EIGENBASIS_TENSORS, EXACT_KINDS, INTEGER_TENSORS, KIND_TENSORS, dense_key
from metastore_plugins.core.store.shards.encoding import is_scale_key
from metastore_plugins.core.store.shards.manifest import MAX_EMBEDDING_ROWS


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

    def need(ok: bool, key: str, what: str) -> None:
        if not ok:
            raise StoreError(f"{path}: tensor {where}{key} {what} (layer {entry['layer']!r}, kind {entry['kind']!r})")

    for key, value in raw.items():  # row scales: float, one per row of the tensor they scale
        if is_scale_key(key, raw):
            data = raw[key[: -len(".scale")]]
            need(
                value.is_floating_point() and value.dim() == 1 and data.dim() >= 1 and value.shape[0] == data.shape[0],
                key,
                f"must be a float (R,) row scale; got {value.dtype} {tuple(value.shape)}",
            )
    kind, shapes = entry["kind"], {role: tuple(shape) for role, shape in layer["param_shapes"].items()}
    if kind == "dense":
        for role in layer["params"]:
            key = dense_key(role)
            found = tensors.get(key)
            need(found is not None, key, "is missing")
            value = found if found is not None else torch.empty(0)
            need(
                value.is_floating_point() and tuple(value.shape) == (size, *shapes[role]),
                key,
                f"must be float {(size, *shapes[role])}; got {value.dtype} {tuple(value.shape)}",
            )
        return
    for key in KIND_TENSORS[kind]:
        need(key in tensors, key, "is missing")
    if kind not in EXACT_KINDS:
        _check_kept(need, tensors, kind, size)
        return
    for key in KIND_TENSORS[kind]:
        value = tensors[key]
        if key in INTEGER_TENSORS:
            need(
                not value.is_floating_point() and value.dim() == 1,
                key,
                f"must be a 1-d integer tensor; got {value.dtype} {tuple(value.shape)}",
            )
        else:
            need(value.is_floating_point(), key, f"must be a float tensor; got {value.dtype}")
        need(
            value.shape[0] == tensors["suffix"].shape[0],
            key,
            f"has {value.shape[0]} rows, suffix has {tensors['suffix'].shape[0]}",
        )
    sample = tensors["sample"]
    need(_within(sample, size), "sample", f"holds samples outside 0..{size - 1}")
    need(bool((sample[1:] >= sample[:-1]).all()), "sample", "is not grouped by sample in ascending order")
    suffix = tensors["suffix"]
    if kind == "embedding":
        vocab, dim = (shapes.get("weight", ()) + (0, 0))[:2]
        need(
            suffix.dim() == 2 and suffix.shape[1] == dim and len(shapes.get("weight", ())) == 2,
            "suffix",
            f"must be (R, {dim}); got {tuple(suffix.shape)}",
        )
        need(
            vocab <= MAX_EMBEDDING_ROWS,
            "ids",
            f"belongs to an embedding of {vocab} rows in the manifest's shape, more than the {MAX_EMBEDDING_ROWS} a "
            "query holds: the manifest's shape is not the stored layer's",
        )
        need(_within(tensors["ids"], vocab), "ids", f"holds token ids outside 0..{vocab - 1}")
        return
    prefix = tensors["prefix"]
    need(prefix.dim() == 3, "prefix", f"must be (R, G, d_in); got {tuple(prefix.shape)}")
    need(
        suffix.dim() == 3 and suffix.shape[1] == prefix.shape[1],
        "suffix",
        f"must be (R, G, d_out); got {tuple(suffix.shape)}",
    )
    groups, d_in, d_out = prefix.shape[1], prefix.shape[2], suffix.shape[2]
    if "weight" in shapes:  # out_in: (G d_out, *rest), prod(rest) = d_in; in_out: (d_in, *rest), prod(rest) = G d_out
        weight = shapes["weight"]
        first, rest = (groups * d_out, d_in) if layer["layout"] == "out_in" else (d_in, groups * d_out)
        need(
            len(weight) >= 2 and weight[0] == first and math.prod(weight[1:]) == rest,
            "prefix",
            f"and suffix do not make a weight of shape {weight} ({layer['layout']}: {groups} group(s) of d_out "
            f"{d_out}, d_in {d_in}): the manifest's shape or layout is not the stored layer's",
        )
    if "bias" in shapes:
        need(groups * d_out == math.prod(shapes["bias"]), "suffix", f"does not make a bias of shape {shapes['bias']}")


def _within(values: Tensor, bound: int) -> bool:
    """Whether every entry of integer ``values`` lies in ``0..bound - 1``."""
    return values.numel() == 0 or (int(values.min()) >= 0 and int(values.max()) < bound)


def _check_kept(need: Any, tensors: dict[str, Tensor], kind: str, size: int) -> None:
    """A ``"projected"`` record: ``projected (B, k_out, k_in)`` and ``sq_norm (B,)``; a ``"norms"`` one: ``sq_norm``."""
    sq_norm = tensors.get("sq_norm", torch.empty(0))
    need(
        sq_norm.is_floating_point() and tuple(sq_norm.shape) == (size,),
        "sq_norm",
        f"must be float ({size},); got {sq_norm.dtype} {tuple(sq_norm.shape)}",
    )
    if kind == "projected":
        projected = tensors.get("projected", torch.empty(0))
        need(
            projected.is_floating_point() and projected.dim() == 3 and projected.shape[0] == size,
            "projected",
            f"must be float ({size}, k_out, k_in); got {projected.dtype} {tuple(projected.shape)}",
        )
        _check_eigenbasis(need, tensors, tuple(projected.shape[1:]))


def _check_eigenbasis(need: Any, tensors: dict[str, Tensor], block: tuple[int, ...]) -> None:
    """A projected record's curvature eigenbasis tensors: all or none, ``basis (1,)`` integer,
    ``eigenvalues (k_out, k_in)`` and ``mean_eigenvalue (1,)`` finite float, not negative."""
    present = [key for key in EIGENBASIS_TENSORS if key in tensors]
    if not present:
        return
    need(len(present) == len(EIGENBASIS_TENSORS), "basis", f"needs all of {EIGENBASIS_TENSORS}; has {present}")
    if len(present) != len(EIGENBASIS_TENSORS):
        return
    basis, values, mean = (tensors[key] for key in EIGENBASIS_TENSORS)
    need(not basis.is_floating_point() and tuple(basis.shape) == (1,), "basis", "must be an integer (1,) tensor")
    for key, value, shape in (("eigenvalues", values, block), ("mean_eigenvalue", mean, (1,))):
        need(
            value.is_floating_point()
            and tuple(value.shape) == shape
            and bool(torch.isfinite(value).all())
            and bool((value >= 0).all()),
            key,
            f"must be finite, non-negative float {shape}; got {value.dtype} {tuple(value.shape)}",
        )
