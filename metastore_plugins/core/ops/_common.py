"""Shared helpers of the operators: parameter selection, per-sample grouping, chunked restore.

Notation used across :mod:`metastore_plugins.core.ops`: a record holds ``B`` samples
and ``R`` kept rows; an ``"outer"`` record has ``G`` groups with factors
``A (R, G, d_in)`` (prefix) and ``D (R, G, d_out)`` (suffix); ``sample[r]`` is the
batch-local sample of row ``r``. Rows need not be sorted by sample.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Iterator, Sequence

import torch
from torch import Tensor

from metastore_plugins.core.errors import ConfigError, RepresentationError
from metastore_plugins.core.records import KIND_CODES, RECOMPUTE_HINT, SUMMARY_KINDS, LayerRecord

#: Default memory budget, in bytes, of one operator call (largest intermediate it builds) and of
#: one store query (decoded records it holds at once); the one default every ``max_bytes`` uses.
DEFAULT_MAX_BYTES = 512 * 2**20


def check_kind(record: LayerRecord) -> None:
    """Raise a ``ValueError`` naming the record if its kind is unknown."""
    if record.kind not in KIND_CODES:
        raise ConfigError(f"record of layer '{record.layer}' has unknown kind {record.kind!r}")


def unsupported(record: LayerRecord, what: str) -> RepresentationError:
    """The error for ``what`` asked of ``record``'s representation, with the ways out."""
    kept = {"projected": "a projected gradient with exact norms", "norms": "exact squared norms only"}[record.kind]
    return RepresentationError(
        f"{what} needs the per-sample gradients of layer '{record.layer}', which this store keeps as {kept} "
        f"(capture policy); capture it with policy='exact' (or a tag keep='exact' on those steps), or {RECOMPUTE_HINT}"
    )


def need_gradients(record: LayerRecord, what: str) -> None:
    """Raise :class:`RepresentationError` unless ``record`` holds the gradients themselves (factors or dense)."""
    if record.kind in SUMMARY_KINDS:
        raise unsupported(record, what)


def whole_record(record: LayerRecord, params: Collection[str] | None, what: str) -> None:
    """Raise :class:`RepresentationError` if ``params`` selects part of a projected or norms record's parameters.

    Such records hold one number set for all of the layer's parameters together.
    """
    chosen = selected_roles(record, params)
    if chosen and len(chosen) != len(record.params):
        raise RepresentationError(
            f"{what} of part of layer '{record.layer}' ({sorted(chosen.values())}): the store keeps that layer's "
            f"{sorted(record.params.values())} together ({record.kind}); select all of them, or capture with "
            "policy='exact'"
        )


def selected_roles(record: LayerRecord, params: Collection[str] | None) -> dict[str, str]:
    """Role -> parameter name of the record's parameters named in ``params`` (all when ``None``)."""
    check_kind(record)
    if params is None:
        return dict(record.params)
    return {role: name for role, name in record.params.items() if name in params}


def common_params(a: LayerRecord, b: LayerRecord, params: Collection[str] | None) -> list[str]:
    """Parameter names held by both records (and in ``params``), checked to have equal shapes.

    Raises:
        ValueError: if the records share no parameter or a shared one has two shapes.
    """
    names_a, names_b = selected_roles(a, params), selected_roles(b, params)
    shape_a = {name: a.param_shapes[role] for role, name in names_a.items()}
    shape_b = {name: b.param_shapes[role] for role, name in names_b.items()}
    common = [name for name in shape_a if name in shape_b]
    if not common:
        raise ConfigError(
            f"records of layers '{a.layer}' and '{b.layer}' share no parameter "
            f"({sorted(shape_a)} vs {sorted(shape_b)}); pair records of the same layer"
        )
    for name in common:
        if tuple(shape_a[name]) != tuple(shape_b[name]):
            raise ConfigError(
                f"parameter '{name}' has shape {tuple(shape_a[name])} in one record and "
                f"{tuple(shape_b[name])} in the other; pair records taken from the same model"
            )
    return common


def record_pairs(
    records_a: Sequence[LayerRecord], records_b: Sequence[LayerRecord], params: Collection[str] | None = None
) -> Iterator[tuple[LayerRecord, LayerRecord]]:
    """Every pair ``(a, b)`` holding a common parameter (in ``params``), ``a`` then ``b`` in order.

    Pairs are found through a parameter index: a model has many records, few pairs.
    """
    holders: dict[str, list[int]] = {}
    for j, b in enumerate(records_b):
        for name in selected_roles(b, params).values():
            holders.setdefault(name, []).append(j)
    for a in records_a:
        for j in sorted({j for name in selected_roles(a, params).values() for j in holders.get(name, ())}):
            yield a, records_b[j]


def roles_of(record: LayerRecord, names: Collection[str]) -> set[str]:
    """The roles of ``record`` whose parameter name is in ``names``."""
    return {role for role, name in record.params.items() if name in names}


def outer_dims(record: LayerRecord) -> tuple[int, int, int]:
    """``(G, d_in, d_out)`` of an ``"outer"`` record."""
    prefix, suffix = record.tensors["prefix"], record.tensors["suffix"]  # (R, G, d_in), (R, G, d_out)
    return prefix.shape[1], prefix.shape[2], suffix.shape[2]


def num_rows(record: LayerRecord) -> int:
    """Kept rows ``R`` of a factored record, ``B`` for a dense one."""
    if record.kind == "dense":
        return record.batch_size
    return int(record.tensors["sample"].shape[0])


def max_rows_per_sample(record: LayerRecord) -> int:
    """The largest number of rows any sample of a factored record has (``T_max``)."""
    sample = record.tensors["sample"]
    if sample.numel() == 0:
        return 0
    return int(torch.bincount(sample.long(), minlength=record.batch_size).max())


def param_numel(record: LayerRecord, names: Collection[str]) -> int:
    """Number of entries of the named parameters."""
    return sum(math.prod(record.param_shapes[role]) for role in roles_of(record, names))


def segment_sum(values: Tensor, sample: Tensor, batch: int, dim: int = 0) -> Tensor:
    """Sum ``values`` over rows of the same sample along ``dim``: ``(..., R, ...) -> (..., B, ...)``."""
    shape = list(values.shape)
    shape[dim] = batch
    return values.new_zeros(shape).index_add_(dim, sample, values)


def pad_by_sample(sample: Tensor, batch: int, *rows: Tensor) -> tuple[Tensor, ...]:
    """Scatter row tensors ``(R, ...)`` into zero-padded per-sample blocks ``(B, T_max, ...)``.

    Padding rows are zero, so they add nothing to Gram products or rebuilt gradients.
    """
    sample = sample.long()
    counts = torch.bincount(sample, minlength=batch)  # (B,)
    t_max = int(counts.max()) if sample.numel() else 0
    is_sorted = sample.numel() < 2 or bool((sample[1:] >= sample[:-1]).all())
    if is_sorted and sample.numel() == batch * t_max:  # every sample has T_max rows: a view
        return tuple(row.view(batch, t_max, *row.shape[1:]) for row in rows)
    order = None if is_sorted else torch.argsort(sample, stable=True)  # (R,)
    starts = torch.cumsum(counts, 0) - counts  # (B,)
    sorted_sample = sample if order is None else sample[order]  # (R,)
    position = torch.arange(sample.numel(), device=sample.device) - starts[sorted_sample]  # (R,)
    padded = []
    for row in rows:
        block = row.new_zeros(batch, t_max, *row.shape[1:])  # (B, T_max, ...)
        block[sorted_sample, position] = row if order is None else row[order]
        padded.append(block)
    return tuple(padded)


def sample_slice(record: LayerRecord, lo: int, hi: int) -> tuple[Tensor, ...]:
    """Row tensors of samples ``lo <= i < hi`` of a factored record, samples renumbered from 0.

    Returns ``(sample, prefix_or_ids, suffix)``.
    """
    sample = record.tensors["sample"].long()  # (R,)
    first = record.tensors["prefix" if record.kind == "outer" else "ids"]
    suffix = record.tensors["suffix"]
    if lo == 0 and hi >= record.batch_size:
        return sample, first, suffix
    rows = ((sample >= lo) & (sample < hi)).nonzero().squeeze(1)  # (R_chunk,)
    return sample[rows] - lo, first[rows], suffix[rows]


def weight_groups(grad: Tensor, layout: str, groups: int, d_out: int, d_in: int) -> Tensor:
    """A dense weight gradient ``(n, *shape)`` viewed as ``(n, G, d_out, d_in)`` (inverse of restore)."""
    n = grad.shape[0]
    if layout == "in_out":
        grad = grad.reshape(n, d_in, d_out).transpose(1, 2)  # (n, d_out, d_in)
    return grad.reshape(n, groups, d_out, d_in)


def rebuild_outer(prefix: Tensor, suffix: Tensor, sample: Tensor, batch: int) -> Tensor:
    """Per-sample weight gradients ``(B, G, d_out, d_in) = sum_{r in i} D_r^T A_r`` by padded bmm."""
    pa, pd = pad_by_sample(sample, batch, prefix, suffix)  # (B, T, G, d_in), (B, T, G, d_out)
    return pd.permute(0, 2, 3, 1) @ pa.permute(0, 2, 1, 3)  # (B, G, d_out, d_in)


def restore_chunk(record: LayerRecord, lo: int, hi: int, names: Collection[str]) -> dict[str, Tensor]:
    """Per-sample gradients ``name -> (hi - lo, *shape)`` of samples ``lo..hi-1`` (chunked restore)."""
    need_gradients(record, "rebuilding per-sample gradients")
    hi = min(hi, record.batch_size)
    n, roles = hi - lo, roles_of(record, names)
    out: dict[str, Tensor] = {}
    if record.kind == "dense":
        for role in roles:
            out[record.params[role]] = record.dense_grad(role)[lo:hi]
        return out
    sample, first, suffix = sample_slice(record, lo, hi)
    if record.kind == "embedding":
        vocab, dim = record.param_shapes["weight"]
        flat = suffix.new_zeros(n * vocab, dim).index_add_(0, sample * vocab + first.long(), suffix)  # (n*V, d)
        return {record.params["weight"]: flat.view(n, vocab, dim)}
    if "weight" in roles:
        weight = rebuild_outer(first, suffix, sample, n)  # (n, G, d_out, d_in)
        weight = weight.reshape(n, -1, weight.shape[-1])  # (n, G*d_out, d_in)
        if record.layout == "in_out":
            weight = weight.transpose(1, 2)  # (n, d_in, d_out)
        out[record.params["weight"]] = weight.reshape(n, *record.param_shapes["weight"])
    if "bias" in roles:
        out[record.params["bias"]] = segment_sum(suffix.reshape(suffix.shape[0], -1), sample, n)  # (n, G*d_out)
    return out


def chunks(total: int, size: int) -> Iterator[tuple[int, int]]:
    """``(lo, hi)`` ranges of at most ``size`` (at least 1) covering ``range(total)``."""
    size = max(1, int(size))
    for lo in range(0, total, size):
        yield lo, min(total, lo + size)


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts`` that is the same in every process (unlike ``hash()``)."""
    key = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)
