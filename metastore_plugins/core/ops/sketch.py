"""Seeded Kronecker random projections of per-sample gradients, computed on the factors.

A layer's weight gradient is viewed as a matrix ``M_i`` of ``rows x cols``: ``(G d_out) x d_in``
for Linear/Conv (a dense record of the same layer uses the same view: ``(C_out, rest)`` of
the parameter, or its transpose for the ``"in_out"`` layout) and ``V x d`` for an
embedding. With Gaussian ``P_out (k_out, rows)`` and ``P_in (k_in, cols)`` of entry
variance ``1 / k_out`` and ``1 / k_in``, the sketch is ``P_out M_i P_in^T`` flattened to
``k = k_out k_in`` numbers (entries scaled by ``1/sqrt(k)`` overall). On factors::

    outer:      P_out M_i P_in^T = sum_{r in i} sum_g (P_out[:, g] D_r[g]) (P_in A_r[g])^T
    embedding:  P_out M_i P_in^T = sum_{r in i} P_out[:, id_r] (P_in D_r)^T

costing ``O(R (d_in k_in + d_out k_out) + B T k)`` instead of rebuilding ``M_i``.
``E[P^T P] = I`` for both, so ``E <S(M), S(N)> = <M, N>``: inner products are unbiased.

**Bias**: appended as an extra input column, ``[W | b]``: the prefix gets a constant 1
and ``P_in`` an extra column drawn from its own seed, so a sketch with and without bias
share the weight part. Parameters of a dense record that are neither a weight matrix
nor its bias (norm weights, ...) are flattened and sketched with a plain Gaussian
``(k, n)`` matrix; the parts add up.

Projections depend only on ``(layer name, seed, shapes)`` through a stable hash, so a
dense record of the same layer, another process or another run gets the same ones.

**Error.** Unbiased; the spread depends on how aligned the two gradients are. Relative
to ``||g_i|| ||g_j||``, the error of a sketched inner product has RMS about ``1/sqrt(k)``
for unrelated gradients (like a dense Johnson-Lindenstrauss projection) and up to
``sqrt(2/k_out + 2/k_in)`` for a squared norm of a rank-one gradient (one kept row, e.g.
a classifier head: the Kronecker structure is noisier there); more rows per sample
average it down. Measured on a 384 x 384 Linear with Gaussian factors (B = 16, 5 seeds),
RMS of the inner-product error / of the relative squared-norm error:

==========  =============  =============  =============
rows/sample k = 16 x 16    k = 32 x 32    k = 64 x 64
==========  =============  =============  =============
T = 1       0.059 / 0.44   0.035 / 0.40   0.019 / 0.23
T = 8       0.063 / 0.19   0.034 / 0.12   0.016 / 0.095
T = 64      0.064 / 0.12   0.034 / 0.067  0.018 / 0.037
==========  =============  =============  =============

``tests/ops/test_sketch.py`` checks ``RMS <= 2/sqrt(k)`` for inner products and
``<= 1.5 sqrt(2/k_out + 2/k_in)`` for squared norms with fixed seeds.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection

import torch
from torch import Tensor

from metastore_plugins.core.errors import RepresentationError
from metastore_plugins.core.ops._common import (
    DEFAULT_MAX_BYTES,
    chunks,
    max_rows_per_sample,
    outer_dims,
    pad_by_sample,
    sample_slice,
    selected_roles,
    stable_seed,
    unsupported,
    whole_record,
)
from metastore_plugins.core.records import PROJECTION_SEED, SUMMARY_KINDS, LayerRecord


@functools.lru_cache(maxsize=64)
def _gaussian(tag: str, layer: str, seed: int, shape: tuple[int, ...], scale_dim: int) -> Tensor:
    generator = torch.Generator().manual_seed(stable_seed("metastore-sketch", tag, layer, seed, *shape))
    return torch.randn(shape, generator=generator) / math.sqrt(scale_dim)  # CPU, float32


def projection(tag: str, layer: str, seed: int, shape: tuple[int, ...], scale_dim: int, device: torch.device) -> Tensor:
    """A Gaussian matrix of entry variance ``1/scale_dim``, a pure function of its arguments.

    ``tag`` names the role of the matrix (``"out"``, ``"in"``, ``"bias"``, ``"vector"``).
    Drawn on the CPU with a ``torch.Generator`` (same numbers on every device).
    """
    return _gaussian(tag, layer, int(seed), tuple(int(s) for s in shape), int(scale_dim)).to(device)


class Projections:
    """The projections of one sketching pass, each drawn once and kept until the pass ends.

    A pass over a store meets every layer once per batch; a model has more projections
    than :func:`projection`'s small cache holds, and drawing them again for every batch
    cost more than the sketches themselves. Call it like :func:`projection`.
    """

    def __init__(self) -> None:
        self._drawn: dict[tuple[object, ...], Tensor] = {}

    def __call__(
        self, tag: str, layer: str, seed: int, shape: tuple[int, ...], scale_dim: int, device: torch.device
    ) -> Tensor:
        key = (tag, layer, int(seed), tuple(int(s) for s in shape), int(scale_dim), str(device))
        drawn = self._drawn.get(key)
        if drawn is None:
            drawn = self._drawn[key] = projection(tag, layer, seed, shape, scale_dim, device)
        return drawn


def sketch(
    record: LayerRecord,
    dim_in: int = 16,
    dim_out: int = 16,
    seed: int = 0,
    params: Collection[str] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    projections: Projections | None = None,
) -> Tensor:
    """Sketch of each per-sample gradient of a record: ``(B, dim_out * dim_in)``.

    Args:
        record: a record of any kind.
        dim_in, dim_out: ``k_in`` and ``k_out``; the sketch has ``k = k_out k_in`` entries.
        seed: selects the projections (with the layer name and shapes).
        params: parameter names to include (all of the record's by default).
        max_bytes: bound on the largest intermediate.
        projections: where to keep the drawn matrices across calls (one per pass over a
            store); each call draws its own by default.

    Returns:
        ``(B, k)`` float32; ``<sketch_i, sketch_j>`` estimates ``<g_i, g_j>`` without bias.
    """
    roles = selected_roles(record, params)
    if record.kind in SUMMARY_KINDS:
        return _kept_sketch(record, params, dim_in, dim_out, seed)
    device = next(iter(record.tensors.values())).device
    draw = Projections() if projections is None else projections
    out = torch.zeros(record.batch_size, dim_out, dim_in, device=device)  # (B, k_out, k_in)
    if record.kind == "outer":
        _outer_sketch(record, roles, out, seed, max_bytes, draw)
    elif record.kind == "embedding" and "weight" in roles:
        _embedding_sketch(record, out, seed, max_bytes, draw)
    elif record.kind == "dense":
        _dense_sketch(record, roles, out, seed, draw)
    return out.reshape(record.batch_size, dim_out * dim_in)


def _kept_sketch(record: LayerRecord, params: Collection[str] | None, dim_in: int, dim_out: int, seed: int) -> Tensor:
    """The sketch a ``"projected"`` record already is, when asked with its own size and seed.

    A record on a curvature eigenbasis is its own sketch too (its coordinates in the top block, zero-padded
    to the size asked where a narrow layer's block is smaller: the padding is zero in every record of the
    layer, so inner products are kept), comparable only with the records of its checkpoint's passes: the
    queries that pair two capture points check that
    (:func:`~metastore_plugins.core.analysis.sketches.same_projection`)."""
    if record.kind == "norms":
        raise unsupported(record, "sketches")
    whole_record(record, params, "sketches")
    stored = record.tensors["projected"]  # (B, k_out, k_in)
    rows, cols = stored.shape[1:]
    if record.basis is not None and rows <= dim_out and cols <= dim_in and seed == PROJECTION_SEED:
        stored = torch.nn.functional.pad(stored, (0, dim_in - cols, 0, dim_out - rows))  # (B, dim_out, dim_in)
    if tuple(stored.shape[1:]) != (dim_out, dim_in) or seed != PROJECTION_SEED:
        raise RepresentationError(
            f"layer '{record.layer}' is kept projected to {tuple(stored.shape[1:])} (k_out, k_in) with seed "
            f"{PROJECTION_SEED}; ask for sketches of that size and seed (dim_out={stored.shape[1]}, "
            f"dim_in={stored.shape[2]}, seed={PROJECTION_SEED}), or capture with policy='exact'"
        )
    return stored.reshape(stored.shape[0], -1)


def _in_projection(
    draw: Projections, layer: str, seed: int, cols: int, k_in: int, weight: bool, bias: bool, device: torch.device
) -> Tensor:
    """``P_in`` of the ``[W | b]`` view, ``(k_in, cols + 1)`` with bias, ``(k_in, 0 + 1)`` for bias alone."""
    parts = []
    if weight:
        parts.append(draw("in", layer, seed, (k_in, cols), k_in, device))  # (k_in, cols)
    if bias:
        parts.append(draw("bias", layer, seed, (k_in, 1), k_in, device))  # (k_in, 1)
    return torch.cat(parts, dim=1)


def _outer_sketch(
    record: LayerRecord, roles: dict[str, str], out: Tensor, seed: int, max_bytes: int, draw: Projections
) -> None:
    groups, d_in, d_out = outer_dims(record)
    k_out, k_in = out.shape[1], out.shape[2]
    with_weight, with_bias = "weight" in roles, "bias" in roles
    if not (with_weight or with_bias):
        return
    p_out = draw("out", record.layer, seed, (k_out, groups * d_out), k_out, out.device)  # (k_out, G d_out)
    p_out = p_out.view(k_out, groups, d_out).permute(1, 2, 0)  # (G, d_out, k_out)
    p_in = _in_projection(draw, record.layer, seed, d_in, k_in, with_weight, with_bias, out.device)  # (k_in, d_in [+1])
    tokens = max_rows_per_sample(record)
    per_sample = 4 * tokens * groups * (k_in + k_out + d_in + d_out) + 1
    for lo, hi in chunks(record.batch_size, max_bytes // per_sample):
        sample, prefix, suffix = sample_slice(record, lo, hi)
        proj_d = torch.einsum("rgo,gok->rgk", suffix, p_out)  # (R, G, k_out)
        if with_weight:
            proj_a = prefix @ p_in[:, :d_in].T  # (R, G, k_in)
            if with_bias:
                proj_a = proj_a + p_in[:, -1]  # (R, G, k_in): the constant-1 input column
        else:
            proj_a = p_in[:, -1].expand(prefix.shape[0], groups, k_in)  # (R, G, k_in)
        pd, pa = pad_by_sample(sample, hi - lo, proj_d, proj_a)  # (n, T, G, k_out), (n, T, G, k_in)
        n = hi - lo
        out[lo:hi] = pd.reshape(n, -1, k_out).transpose(1, 2) @ pa.reshape(n, -1, k_in)  # (n, k_out, k_in)


def _embedding_sketch(record: LayerRecord, out: Tensor, seed: int, max_bytes: int, draw: Projections) -> None:
    vocab, dim = record.param_shapes["weight"]
    k_out, k_in = out.shape[1], out.shape[2]
    p_out = draw("out", record.layer, seed, (k_out, vocab), k_out, out.device)  # (k_out, V)
    p_in = draw("in", record.layer, seed, (k_in, dim), k_in, out.device)  # (k_in, d)
    tokens = max_rows_per_sample(record)
    per_sample = 4 * tokens * (k_in + k_out + dim) + 1
    for lo, hi in chunks(record.batch_size, max_bytes // per_sample):
        sample, ids, suffix = sample_slice(record, lo, hi)
        proj_out = p_out[:, ids.long()].T  # (R, k_out)
        proj_in = suffix @ p_in.T  # (R, k_in)
        pd, pa = pad_by_sample(sample, hi - lo, proj_out, proj_in)  # (n, T, k_out), (n, T, k_in)
        out[lo:hi] = pd.transpose(1, 2) @ pa  # (n, k_out, k_in)


def _matrix_view(record: LayerRecord, roles: dict[str, str]) -> tuple[Tensor | None, Tensor | None]:
    """The dense ``(B, rows, cols)`` weight matrix and ``(B, rows)`` bias of a dense record, if it has them."""
    if "weight" not in roles or len(record.param_shapes["weight"]) < 2:
        return None, None
    grad = record.dense_grad("weight")  # (B, *shape)
    batch = grad.shape[0]
    if record.layout == "in_out":
        matrix = grad.reshape(batch, grad.shape[1], -1).transpose(1, 2)  # (B, d_out, d_in)
    else:
        matrix = grad.reshape(batch, grad.shape[1], -1)  # (B, rows, cols)
    bias = record.dense_grad("bias") if "bias" in roles else None
    if bias is not None and bias.reshape(batch, -1).shape[1] != matrix.shape[1]:
        bias = None
    return matrix, None if bias is None else bias.reshape(batch, -1)


def _dense_sketch(record: LayerRecord, roles: dict[str, str], out: Tensor, seed: int, draw: Projections) -> None:
    k_out, k_in = out.shape[1], out.shape[2]
    matrix, bias = _matrix_view(record, roles)
    rest = dict(roles)
    if matrix is not None:
        rest.pop("weight")
        rows, cols = matrix.shape[1], matrix.shape[2]
        p_out = draw("out", record.layer, seed, (k_out, rows), k_out, out.device)  # (k_out, rows)
        p_in = _in_projection(
            draw, record.layer, seed, cols, k_in, True, bias is not None, out.device
        )  # (k_in, cols [+1])
        out += p_out @ matrix @ p_in[:, :cols].T  # (B, k_out, k_in)
        if bias is not None:
            rest.pop("bias")
            out += (bias @ p_out.T).unsqueeze(2) * p_in[:, -1]  # (B, k_out, k_in)
    if rest:
        flat = torch.cat([record.dense_grad(role).reshape(record.batch_size, -1) for role in sorted(rest)], 1)
        k = k_out * k_in
        p_vec = draw("vector:" + ",".join(sorted(rest)), record.layer, seed, (k, flat.shape[1]), k, out.device)
        out += (flat @ p_vec.T).view(-1, k_out, k_in)  # (B, k_out, k_in)
