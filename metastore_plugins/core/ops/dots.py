"""Gradient inner products ``<g_a_i, g_b_j>`` between the samples of two records of one layer.

Factored forms (rows ``r`` of sample ``i`` in ``a``, ``s`` of sample ``j`` in ``b``):

- outer x outer: ``sum_g sum_{r,s} (A_a A_b^T + [bias])[r, s] * (D_a D_b^T)[r, s]`` --
  appending a constant 1 to every prefix adds ``<grad b_i, grad b_j>``;
- outer x dense ``H_j``: ``sum_{r in i} sum_g D_r[g]^T (H_j[g] A_r[g] + h_j[g])``;
- embedding x embedding: ``sum_{r,s: id_r = id_s} D_r . D_s`` after summing rows of
  the same ``(sample, id)``;
- embedding x dense ``H_j``: ``sum_{r in i} D_r . H_j[id_r]``;

each followed by a per-sample segment sum of the row-pair matrix. With a ``"projected"`` record
on either side the product is the estimate ``<S(g_a_i), S(g_b_j)>`` in its projection (the other
side sketched the same way); a ``"norms"`` record cannot give inner products. Anything else,
or whatever the cost model (:mod:`~metastore_plugins.core.ops.cost`) finds cheaper,
rebuilds dense gradients a chunk of samples at a time and multiplies them.
Every intermediate stays under ``max_bytes`` (row and sample chunks).
"""

from __future__ import annotations

import math
from collections.abc import Collection

import torch
from torch import Tensor

from metastore_plugins.core.errors import RepresentationError
from metastore_plugins.core.ops._common import (
    DEFAULT_MAX_BYTES,
    chunks,
    common_params,
    outer_dims,
    param_numel,
    restore_chunk,
    roles_of,
    segment_sum,
    unsupported,
    weight_groups,
    whole_record,
)
from metastore_plugins.core.ops.cost import Method, dots_method
from metastore_plugins.core.ops.sketch import sketch
from metastore_plugins.core.records import PROJECTION_SEED, LayerRecord

_FACTORED_FIRST = {"outer": 0, "embedding": 0, "dense": 1}


def dots(
    a: LayerRecord,
    b: LayerRecord,
    params: Collection[str] | None = None,
    method: Method = "auto",
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Tensor:
    """Inner products of per-sample gradients: ``out[i, j] = <g_a_i, g_b_j>``.

    Args:
        a, b: records of the same layer, of any kinds and row counts (e.g. a train
            batch and a test batch at the same weights).
        params: parameter names to include; by default all parameters both hold.
        method: ``"auto"`` (cost model, see :func:`~metastore_plugins.core.ops.cost.plan_dots`),
            ``"factored"`` or ``"dense"``. Every method is exact.
        max_bytes: bound on the largest intermediate.

    Returns:
        ``(B_a, B_b)`` float tensor.

    Raises:
        ValueError: if the records share no parameter.
    """
    names = common_params(a, b, params)
    if a.kind == "projected" or b.kind == "projected" or a.kind == "norms" or b.kind == "norms":
        return _projected_dots(a, b, names)
    if _FACTORED_FIRST[a.kind] > _FACTORED_FIRST[b.kind]:
        return dots(b, a, names, method, max_bytes).T
    if dots_method(a, b, names, method) == "factored":
        if a.kind == "outer" and b.kind == "outer" and _same_structure(a, b):
            return _outer_outer(a, b, roles_of(a, names), max_bytes)
        if a.kind == "outer" and b.kind == "dense":
            return _outer_dense(a, b, names, max_bytes)
        if a.kind == "embedding" and b.kind == "embedding":
            return _embedding_embedding(a, b, max_bytes)
        if a.kind == "embedding" and b.kind == "dense":
            return _embedding_dense(a, b, names[0], max_bytes)
    return _dense_dots(a, b, names, max_bytes)


def _projected_dots(a: LayerRecord, b: LayerRecord, names: list[str]) -> Tensor:
    """``<S(g_a_i), S(g_b_j)>``: an estimate, through the projection a ``"projected"`` record was kept in.

    The other side is sketched with the same seed and size (a ``"projected"`` record is used as it is).
    """
    for record in (a, b):
        if record.kind == "norms":
            raise unsupported(record, "inner products between samples")
        whole_record(record, names, "inner products")
    bases = {record.basis if record.kind == "projected" else None for record in (a, b)}
    if len(bases) > 1:
        steps = sorted(str(step) for step in bases if step is not None)
        raise RepresentationError(
            f"layer '{a.layer}' is projected on the curvature eigenbasis of step {' and '.join(steps)} on one side "
            "only (the other is exact, seeded or of another checkpoint): inner products need one projection; pair "
            "the passes of one checkpoint"
        )
    k_out, k_in = (a if a.kind == "projected" else b).tensors["projected"].shape[1:]
    sides = [_projection_of(record, k_in, k_out) for record in (a, b)]  # (B, k) each
    return sides[0] @ sides[1].T  # (B_a, B_b)


def _projection_of(record: LayerRecord, k_in: int, k_out: int) -> Tensor:
    if record.kind != "projected":
        return sketch(record, k_in, k_out, PROJECTION_SEED)  # (B, k)
    stored = record.tensors["projected"]  # (B, k_out', k_in')
    if tuple(stored.shape[1:]) != (k_out, k_in):
        raise RepresentationError(
            f"layer '{record.layer}' is projected to {tuple(stored.shape[1:])} in one record and ({k_out}, {k_in}) in "
            "the other; inner products need the same projection on both sides"
        )
    return stored.reshape(stored.shape[0], -1)


def _same_structure(a: LayerRecord, b: LayerRecord) -> bool:
    return outer_dims(a) == outer_dims(b) and a.layout == b.layout


#: Elements of one row-pair block: small enough to stay in cache and in the allocator's reuse.
BLOCK_ELEMENTS = 2**20


def _row_chunks(rows_a: int, rows_b: int, bytes_per_pair: int, max_bytes: int) -> tuple[int, int]:
    """Row chunk sizes ``(r_a, r_b)`` with ``r_a r_b`` pairs within the budget and one block (at least 1 each)."""
    budget = max(1, min(max_bytes // max(1, bytes_per_pair), BLOCK_ELEMENTS))
    if rows_a * rows_b <= budget:
        return max(1, rows_a), max(1, rows_b)
    r_b = max(1, min(rows_b, math.isqrt(budget)))
    return max(1, min(rows_a, budget // r_b)), r_b


def _pair_sum(out: Tensor, pairs: Tensor, sample_a: Tensor, sample_b: Tensor, scratch: Tensor) -> None:
    """``out[i, j] += sum_{r in i, s in j} pairs[r, s]`` for a ``(r_a, r_b)`` block."""
    by_a = scratch[: out.shape[0] * pairs.shape[1]].view(out.shape[0], pairs.shape[1]).zero_()  # (B_a, r_b)
    by_a.index_add_(0, sample_a, pairs)
    out.index_add_(1, sample_b, by_a)


def _outer_outer(a: LayerRecord, b: LayerRecord, roles: set[str], max_bytes: int) -> Tensor:
    """``sum_g (A_a A_b^T + 1[bias]) * (D_a D_b^T)`` summed per sample pair."""
    groups = outer_dims(a)[0]
    with_weight, with_bias = "weight" in roles, "bias" in roles
    rows_a, rows_b = a.tensors["sample"].shape[0], b.tensors["sample"].shape[0]
    if groups == 1 and rows_a * rows_b <= min(max_bytes // 12, BLOCK_ELEMENTS):
        return _outer_outer_block(a, b, with_weight, with_bias)
    pa = a.tensors["prefix"].transpose(0, 1).contiguous()  # (G, R_a, d_in)
    pb = b.tensors["prefix"].transpose(0, 1).contiguous()  # (G, R_b, d_in)
    da = a.tensors["suffix"].transpose(0, 1).contiguous()  # (G, R_a, d_out)
    db = b.tensors["suffix"].transpose(0, 1).contiguous()  # (G, R_b, d_out)
    sa, sb = a.tensors["sample"].long(), b.tensors["sample"].long()  # (R_a,), (R_b,)
    out = da.new_zeros(a.batch_size, b.batch_size)  # (B_a, B_b)
    r_a, r_b = _row_chunks(sa.numel(), sb.numel(), 12 * groups, max_bytes)
    # reused buffers: fresh large allocations cost page faults on every block
    pair_buf, gram_buf = da.new_empty(groups * r_a * r_b), da.new_empty(groups * r_a * r_b)
    scratch = da.new_empty(a.batch_size * r_b)
    for b_lo, b_hi in chunks(sb.numel(), r_b):
        for a_lo, a_hi in chunks(sa.numel(), r_a):
            shape = (groups, a_hi - a_lo, b_hi - b_lo)
            pairs = pair_buf[: math.prod(shape)].view(shape)  # (G, r_a, r_b)
            torch.matmul(da[:, a_lo:a_hi], db[:, b_lo:b_hi].transpose(1, 2), out=pairs)
            if with_weight:
                grams = gram_buf[: math.prod(shape)].view(shape)  # (G, r_a, r_b)
                torch.matmul(pa[:, a_lo:a_hi], pb[:, b_lo:b_hi].transpose(1, 2), out=grams)
                if with_bias:
                    grams.add_(1.0)
                pairs.mul_(grams)
            summed = pairs[0] if groups == 1 else pairs.sum(0)  # (r_a, r_b)
            _pair_sum(out, summed, sa[a_lo:a_hi], sb[b_lo:b_hi], scratch)
    return out


def _outer_outer_block(a: LayerRecord, b: LayerRecord, with_weight: bool, with_bias: bool) -> Tensor:
    """:func:`_outer_outer` of one group in one block: the fewest operations per call (a model's many small
    record pairs spend as much time dispatching operations as multiplying)."""
    da, db = a.tensors["suffix"][:, 0], b.tensors["suffix"][:, 0]  # (R_a, d_out), (R_b, d_out)
    pairs = torch.mm(da, db.T)  # (R_a, R_b)
    if with_weight:
        grams = torch.mm(a.tensors["prefix"][:, 0], b.tensors["prefix"][:, 0].T)  # (R_a, R_b)
        if with_bias:
            grams.add_(1.0)
        pairs.mul_(grams)
    by_a = pairs.new_zeros(a.batch_size, pairs.shape[1]).index_add_(0, a.tensors["sample"].long(), pairs)  # (B_a, R_b)
    return pairs.new_zeros(a.batch_size, b.batch_size).index_add_(1, b.tensors["sample"].long(), by_a)  # (B_a, B_b)


def _outer_dense(a: LayerRecord, b: LayerRecord, names: list[str], max_bytes: int) -> Tensor:
    """``sum_{r in i} sum_g D_r[g]^T (H_j[g] A_r[g] + h_j[g])`` for dense ``H_j`` of ``b``."""
    groups, d_in, d_out = outer_dims(a)
    roles_a, names_b = roles_of(a, names), {n: role for role, n in b.params.items()}
    weight = bias = None
    if "weight" in roles_a:
        grad = b.dense_grad(names_b[a.params["weight"]])
        weight = weight_groups(grad, a.layout, groups, d_out, d_in)  # (B_b, G, d_out, d_in)
    if "bias" in roles_a:
        bias = b.dense_grad(names_b[a.params["bias"]]).reshape(b.batch_size, groups, d_out)  # (B_b, G, d_out)
    prefix, suffix = a.tensors["prefix"], a.tensors["suffix"]  # (R_a, G, d_in), (R_a, G, d_out)
    sample = a.tensors["sample"].long()  # (R_a,)
    out = suffix.new_zeros(a.batch_size, b.batch_size)  # (B_a, B_b)
    width = min(d_in, d_out)
    r_a, n_b = _row_chunks(sample.numel(), b.batch_size, 8 * (width + 1), max_bytes)
    for j_lo, j_hi in chunks(b.batch_size, n_b):
        for lo, hi in chunks(sample.numel(), r_a):
            pairs = suffix.new_zeros(hi - lo, j_hi - j_lo)  # (r_a, n_b)
            for g in range(groups):
                a_g, d_g = prefix[lo:hi, g], suffix[lo:hi, g]  # (r_a, d_in), (r_a, d_out)
                if weight is not None:
                    h_g = weight[j_lo:j_hi, g]  # (n_b, d_out, d_in)
                    if d_out <= d_in:  # project A: (r_a, n_b, d_out), then dot with D
                        proj = (a_g @ h_g.reshape(-1, d_in).T).view(hi - lo, j_hi - j_lo, d_out)
                        pairs += torch.einsum("rjo,ro->rj", proj, d_g)
                    else:  # project D: (r_a, n_b, d_in), then dot with A
                        proj = (d_g @ h_g.transpose(1, 2).reshape(-1, d_out).T).view(hi - lo, j_hi - j_lo, d_in)
                        pairs += torch.einsum("rji,ri->rj", proj, a_g)
                if bias is not None:
                    pairs += d_g @ bias[j_lo:j_hi, g].T  # (r_a, n_b)
            out[:, j_lo:j_hi] += segment_sum(pairs, sample[lo:hi], a.batch_size)
    return out


def _grouped_embedding_rows(record: LayerRecord) -> tuple[Tensor, Tensor, Tensor]:
    """Rows of the same ``(sample, id)`` summed: ``(sample (U,), ids (U,), suffix (U, d))``."""
    vocab = record.param_shapes["weight"][0]
    keys = record.tensors["sample"].long() * vocab + record.tensors["ids"].long()  # (R,)
    unique, inverse = torch.unique(keys, return_inverse=True)  # (U,), (R,)
    suffix = record.tensors["suffix"]  # (R, d)
    summed = suffix.new_zeros(unique.shape[0], suffix.shape[1]).index_add_(0, inverse, suffix)  # (U, d)
    return torch.div(unique, vocab, rounding_mode="floor"), torch.remainder(unique, vocab), summed


def _embedding_embedding(a: LayerRecord, b: LayerRecord, max_bytes: int) -> Tensor:
    """``sum_{r,s: id_r = id_s} D_r . D_s`` per sample pair."""
    sa, ia, da = _grouped_embedding_rows(a)  # (U_a,), (U_a,), (U_a, d)
    sb, ib, db = _grouped_embedding_rows(b)  # (U_b,), (U_b,), (U_b, d)
    out = da.new_zeros(a.batch_size, b.batch_size)  # (B_a, B_b)
    r_a, r_b = _row_chunks(sa.numel(), sb.numel(), 12, max_bytes)
    scratch = da.new_empty(a.batch_size * r_b)
    for b_lo, b_hi in chunks(sb.numel(), r_b):
        for a_lo, a_hi in chunks(sa.numel(), r_a):
            match = ia[a_lo:a_hi, None] == ib[None, b_lo:b_hi]  # (r_a, r_b)
            pairs = (da[a_lo:a_hi] @ db[b_lo:b_hi].T).mul_(match)  # (r_a, r_b)
            _pair_sum(out, pairs, sa[a_lo:a_hi], sb[b_lo:b_hi], scratch)
    return out


def _embedding_dense(a: LayerRecord, b: LayerRecord, name: str, max_bytes: int) -> Tensor:
    """``sum_{r in i} D_r . H_j[id_r]``: gather the dense rows each token hit."""
    sample, ids, suffix = _grouped_embedding_rows(a)  # (U,), (U,), (U, d)
    role_b = next(role for role, n in b.params.items() if n == name)
    dense = b.dense_grad(role_b)  # (B_b, V, d)
    out = suffix.new_zeros(a.batch_size, b.batch_size)  # (B_a, B_b)
    r_a, n_b = _row_chunks(sample.numel(), b.batch_size, 8 * suffix.shape[1] + 8, max_bytes)
    for j_lo, j_hi in chunks(b.batch_size, n_b):
        for lo, hi in chunks(sample.numel(), r_a):
            rows = dense[j_lo:j_hi, ids[lo:hi]]  # (n_b, r_a, d)
            pairs = torch.einsum("jrd,rd->rj", rows, suffix[lo:hi])  # (r_a, n_b)
            out[:, j_lo:j_hi] += segment_sum(pairs, sample[lo:hi], a.batch_size)
    return out


def _dense_dots(a: LayerRecord, b: LayerRecord, names: list[str], max_bytes: int) -> Tensor:
    """Rebuild chunks of samples of both records and multiply (``b`` kept whole when it fits)."""
    per_sample = 8 * param_numel(a, names) + 1  # the gradient and a rebuild temporary
    n_b = max(1, min(b.batch_size, (max_bytes // 2) // per_sample))
    n_a = max(1, (max_bytes - n_b * per_sample) // (per_sample + 4 * n_b))
    out: Tensor | None = None
    for b_lo, b_hi in chunks(b.batch_size, n_b):
        grads_b = restore_chunk(b, b_lo, b_hi, names)
        for a_lo, a_hi in chunks(a.batch_size, n_a):
            grads_a = restore_chunk(a, a_lo, a_hi, names)
            for name in names:
                flat_a = grads_a[name].reshape(a_hi - a_lo, -1)  # (n_a, P)
                flat_b = grads_b[name].reshape(b_hi - b_lo, -1)  # (n_b, P)
                if out is None:
                    out = flat_a.new_zeros(a.batch_size, b.batch_size)  # (B_a, B_b)
                out[a_lo:a_hi, b_lo:b_hi] += flat_a @ flat_b.T
    if out is None:  # an empty batch
        return torch.zeros(a.batch_size, b.batch_size)
    return out
