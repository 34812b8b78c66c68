"""Training-dynamics queries: batch gradients, accumulated |gradients|, per-weight top contributors.

From factors, without rebuilding per-sample gradients where the maths allows:

- batch gradient: ``sum_i grad W_i = sum_r D_r^T A_r`` (one matrix product over all rows);
- one weight entry ``(o, i)`` of group ``g``: ``grad W_s[g, o, i] = sum_{r in s} D[r, g, o] A[r, g, i]``;
- an embedding entry ``(v, j)``: ``sum_{r in s, id_r = v} D[r, j]``.

``sum_i |grad W_i|`` is not linear in the factors: it rebuilds chunks of samples
(embedding records only need their rows grouped by ``(sample, id)``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from metastore_plugins.core.errors import ConfigError
from metastore_plugins.core.ops._common import (
    DEFAULT_MAX_BYTES,
    chunks,
    need_gradients,
    outer_dims,
    param_numel,
    restore_chunk,
    segment_sum,
    selected_roles,
)
from metastore_plugins.core.ops.norms import sq_norms
from metastore_plugins.core.records import LayerRecord

Entries = Sequence[int] | Sequence[Sequence[int]] | Tensor


def _summed_gradient(record: LayerRecord, roles: dict[str, str]) -> dict[str, Tensor]:
    """``sum_i g_i`` per parameter, straight from the factors."""
    need_gradients(record, "summed gradients")
    out: dict[str, Tensor] = {}
    if record.kind == "dense":
        return {name: record.dense_grad(role).sum(0) for role, name in roles.items()}
    suffix = record.tensors["suffix"]
    if record.kind == "embedding":
        vocab, dim = record.param_shapes["weight"]
        table = suffix.new_zeros(vocab, dim).index_add_(0, record.tensors["ids"].long(), suffix)  # (V, d)
        return {roles["weight"]: table} if "weight" in roles else {}
    prefix = record.tensors["prefix"]  # (R, G, d_in)
    if "weight" in roles:
        weight = torch.einsum("rgo,rgi->goi", suffix, prefix)  # (G, d_out, d_in)
        weight = weight.reshape(-1, weight.shape[-1])  # (G d_out, d_in)
        if record.layout == "in_out":
            weight = weight.T  # (d_in, d_out)
        out[roles["weight"]] = weight.reshape(record.param_shapes["weight"])
    if "bias" in roles:
        out[roles["bias"]] = suffix.sum(0).reshape(record.param_shapes["bias"])  # (G d_out,)
    return out


def batch_gradient(
    records: Sequence[LayerRecord], reduction: Literal["sum", "mean"] = "mean", params: Collection[str] | None = None
) -> dict[str, Tensor]:
    """The mini-batch gradient restored from per-sample records: ``name -> param-shaped tensor``.

    ``"sum"`` gives ``sum_i g_i``; ``"mean"`` divides by the batch size ``B``, which is the
    ``.grad`` of a loss that averaged the per-sample losses. Records that share a
    parameter (a module called twice) are added.

    Raises:
        ValueError: on an unknown reduction or records of different batch sizes.
    """
    if reduction not in ("sum", "mean"):
        raise ConfigError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    sizes = {r.batch_size for r in records}
    if len(sizes) > 1:
        raise ConfigError(f"records of one batch are expected, got batch sizes {sorted(sizes)}")
    total: dict[str, Tensor] = {}
    for record in records:
        for name, grad in _summed_gradient(record, selected_roles(record, params)).items():
            total[name] = total[name] + grad if name in total else grad
    if reduction == "mean" and sizes:
        batch = sizes.pop()
        total = {name: grad / batch for name, grad in total.items()}
    return total


def abs_grad_accumulate(
    record: LayerRecord, signed: bool = False, params: Collection[str] | None = None, max_bytes: int = DEFAULT_MAX_BYTES
) -> dict[str, Tensor]:
    """``sum_i |g_i|`` (elementwise) per parameter, or ``sum_i g_i`` with ``signed=True``.

    Accumulated over steps, ``sum |g_i|`` shows which weights samples pushed hardest
    (in either direction); the signed sum is the batch gradient times ``B``.
    """
    need_gradients(record, "per-weight dynamics")
    roles = selected_roles(record, params)
    if signed:
        return _summed_gradient(record, roles)
    if record.kind == "embedding" and "weight" in roles:
        vocab, dim = record.param_shapes["weight"]
        keys = record.tensors["sample"].long() * vocab + record.tensors["ids"].long()  # (R,)
        unique, inverse = torch.unique(keys, return_inverse=True)  # (U,), (R,)
        suffix = record.tensors["suffix"]  # (R, d)
        rows = suffix.new_zeros(unique.numel(), dim).index_add_(0, inverse, suffix).abs_()  # (U, d)
        return {roles["weight"]: suffix.new_zeros(vocab, dim).index_add_(0, unique % vocab, rows)}
    names = list(roles.values())
    per_sample = 8 * param_numel(record, names) + 1
    out: dict[str, Tensor] = {}
    for lo, hi in chunks(record.batch_size, max_bytes // per_sample):
        for name, grad in restore_chunk(record, lo, hi, names).items():
            part = grad.abs().sum(0)  # (*shape)
            out[name] = out[name] + part if name in out else part
    return out


def _flat_entries(entries: Entries, shape: tuple[int, ...]) -> Tensor:
    """Entries given as one index tuple, a list of tuples or an ``(E, ndim)`` tensor -> flat ``(E,)``."""
    index = torch.as_tensor(entries, dtype=torch.long)
    if index.dim() == 1:
        index = index.unsqueeze(0)  # (1, ndim)
    if index.dim() != 2 or index.shape[1] != len(shape):
        raise ConfigError(f"entries must index a parameter of shape {shape} with {len(shape)} numbers each")
    bounds = torch.tensor(shape, dtype=torch.long)
    if bool(((index < 0) | (index >= bounds)).any()):
        raise ConfigError(f"an entry is out of range for a parameter of shape {shape}")
    strides = torch.tensor([math.prod(shape[k + 1 :]) for k in range(len(shape))], dtype=torch.long)
    return (index * strides).sum(1)  # (E,)


def entry_gradients(record: LayerRecord, role: str, entries: Entries, max_bytes: int = DEFAULT_MAX_BYTES) -> Tensor:
    """Per-sample gradient of chosen entries of one parameter, ``(B, E)``, from the factors.

    Args:
        record: the layer's record.
        role: ``"weight"``, ``"bias"`` (or a dense record's role).
        entries: index tuple(s) into the parameter's own shape, e.g. ``(o, i)`` for a
            Linear weight, ``(c_out, c_in, kh, kw)`` for a convolution.
    """
    if role not in record.params:
        raise ConfigError(
            f"layer '{record.layer}' has no captured parameter role {role!r}; it has {sorted(record.params)}"
        )
    need_gradients(record, "per-weight gradients")
    shape = tuple(record.param_shapes[role])
    flat = _flat_entries(entries, shape)  # (E,)
    if record.kind == "dense":
        grad = record.dense_grad(role).reshape(record.batch_size, -1)  # (B, P)
        return grad[:, flat.to(grad.device)]
    suffix, sample = record.tensors["suffix"], record.tensors["sample"].long()
    flat = flat.to(suffix.device)
    width = suffix.reshape(suffix.shape[0], -1).shape[1] + 1
    out = suffix.new_zeros(record.batch_size, flat.numel())  # (B, E)
    for lo, hi in chunks(sample.numel(), max_bytes // (8 * flat.numel() + 4 * width)):
        d = suffix[lo:hi]  # (r, G, d_out) or (r, d)
        if record.kind == "embedding":
            dim = shape[1]
            hit = record.tensors["ids"][lo:hi].long().unsqueeze(1) == (flat // dim)  # (r, E)
            values = d[:, flat % dim] * hit  # (r, E)
        else:
            groups, d_in, d_out = outer_dims(record)
            if role == "bias":
                values = d[:, flat // d_out, flat % d_out]  # (r, E)
            else:
                if record.layout == "in_out":
                    g, o, i = torch.zeros_like(flat), flat % d_out, flat // d_out
                else:
                    g, o, i = flat // (d_out * d_in), (flat // d_in) % d_out, flat % d_in
                values = d[:, g, o] * record.tensors["prefix"][lo:hi][:, g, i]  # (r, E)
        out += segment_sum(values, sample[lo:hi], record.batch_size)
    return out


@dataclass(frozen=True)
class BatchContributors:
    """Per entry, the samples of one batch whose gradient on it is largest in magnitude.

    Attributes:
        indices: ``(E, k)`` batch-local sample indices, largest ``|g|`` first.
        values: ``(E, k)`` their signed per-sample gradients on the entry.
    """

    indices: Tensor
    values: Tensor


def top_contributors(
    record: LayerRecord, role: str, entries: Entries, k: int, max_bytes: int = DEFAULT_MAX_BYTES
) -> BatchContributors:
    """The ``k`` samples with the largest ``|grad_s[entry]|`` for each entry (see :func:`entry_gradients`)."""
    values = entry_gradients(record, role, entries, max_bytes).T  # (E, B)
    k = max(0, min(int(k), record.batch_size))
    order = torch.sort(values.abs(), dim=1, descending=True, stable=True).indices[:, :k]  # (E, k)
    return BatchContributors(order, values.gather(1, order))


def exceed_fraction(record: LayerRecord, threshold: float, params: Collection[str] | None = None) -> float:
    """Fraction of the record's samples whose gradient norm ``||g_i||`` exceeds ``threshold``."""
    if record.batch_size == 0:
        return 0.0
    norms = sq_norms(record, params).clamp_min(0).sqrt()  # (B,)
    return float((norms > threshold).double().mean())


def step_exceed_fractions(norms: Tensor, steps: Tensor, threshold: float) -> tuple[Tensor, Tensor]:
    """Per distinct step, ascending, the fraction of per-sample ``norms (N,)`` above ``threshold``.

    ``steps (N,)`` is each sample's step. Returns ``(steps, fractions)``, both ``(S,)``.
    """
    unique, inverse = torch.unique(steps, return_inverse=True)  # (S,), (N,)
    above = torch.zeros(len(unique), dtype=torch.float64).index_add_(0, inverse, (norms > threshold).double())  # (S,)
    seen = torch.bincount(inverse, minlength=len(unique))  # (S,)
    return unique, above / seen


def weight_exceed_fraction(grads: dict[str, Tensor], threshold: float) -> float:
    """Fraction of entries of ``grads`` (e.g. from :func:`batch_gradient`) with ``|g| > threshold``."""
    total = sum(g.numel() for g in grads.values())
    if total == 0:
        return 0.0
    above = sum(int((g.abs() > threshold).sum()) for g in grads.values())
    return above / total
