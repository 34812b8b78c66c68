"""The preconditioned nearest-gradient index: a train pass's rows whitened by its curvature, then sketched.

K-FAC and EK-FAC score ``lr_i g_i^T (F + delta I)^-1 g_j``. With ``S = (F + delta I)^-1/2`` (per layer, the symmetric
square root: ``Q [(Q^T g) / sqrt(Lambda + delta)]``, :func:`~metastore_plugins.core.ops.precondition.precondition`
with ``power = 1/2``) the score is ``lr_i <S g_i, S g_j>``: an inner product of the same map on both sides. Its
sketches (the per-layer Kronecker sketches of ``S g``, side by side) estimate the score with an error of the order
of ``|S g_i| |S g_j| / dim``, where the TracIn index's (raw ``g_i`` against ``(F + delta I)^-1 g_j``) errs by
``|g_i| |(F + delta I)^-1 g_j| / dim``: far larger where the curvature is small, which is where the method's score
lives. On a curvature eigenbasis (records ``projected``) ``S`` divides each record in place, and the sketch of a
``k x k`` record at ``dim = k`` is the record: the vectors are exact, ``<lr_i v_i, q_j>`` is the score.

The index depends on the fitted curvature, so it is kept in this process (:data:`MAX_KEPT` of them, each at most
:data:`MAX_INDEX_BYTES`: a larger pass is scored row by row) while the pass's batches and shards are unchanged, not
on disk: the reports (one process) build it once for all their test samples; each ``metastore influence -k``
command builds its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from metastore_plugins.core import ops
from metastore_plugins.core.analysis import curvature
from metastore_plugins.core.analysis.vector_search import (
    Plan,
    VectorIndex,
)
from metastore_plugins.core.ops import DEFAULT_MAX_BYTES
from metastore_plugins.core.ops._common import chunks
from metastore_plugins.core.ops.curvature import CurvatureMethod, LayerCurvature, layer_groups
from metastore_plugins.core.ops.curvature_rotated import rotated, sample_chunk
from metastore_plugins.core.ops.precondition import precondition
from metastore_plugins.core.records import LayerRecord
from metastore_plugins.core.store import StoreReader

Curvature = dict[str, LayerCurvature]

#: The sketch size (``dim x dim`` per layer) of the preconditioned index for layers kept as factors (a projected
#: layer uses its own ``k``). Whitened gradients spread over thousands of directions (an effective dimension
#: ``sum Lambda / (Lambda + delta)`` of 6,900 on the benchmark's MLP 32-128-128-10), so the sketch is wider than the
#: TracIn index's 16 (metastore_bench/index_methods_bench.py).
PRECONDITIONED_DIM = 32


def pass_key(store: StoreReader, capture_point: str, *rest: Any) -> tuple[Any, ...]:
    """What a curvature or index of a train pass depends on: the store, the pass, its batches and their shards'
    sha256, and ``rest`` (the method, layers, damping...)."""
    refs = store.batch_refs(capture_point)
    binding = tuple((ref.file.name, ref.batch, store.shard_sha256(ref.file.name)) for ref in refs)
    return (str(store.path), capture_point, *rest, binding)


def fitted_curvature(
    store: StoreReader,
    capture_point: str,
    method: CurvatureMethod,
    layers: Sequence[str] | None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Curvature:
    """The K-FAC / EK-FAC curvature of a train pass (:func:`.curvature.fit_curvature` on all of its samples), kept in
    this process while its batches and their shards' sha256 are unchanged: a query per test sample fits once."""
    key = pass_key(store, capture_point, method, None if layers is None else tuple(layers), max_bytes)
    kept = _FITTED.get(key)
    if kept is None:
        selection = store.select(capture_point, layers=layers)
        kept = curvature.fit_curvature(selection, method, max_bytes, what=f"curvature of {capture_point!r}")
        _keep(_FITTED, key, kept)
    return kept


def index_dim(store: StoreReader, capture_point: str, order: Sequence[str]) -> int:
    """The largest ``k`` of the pass's projected records (their sketch is the record), else
    :data:`PRECONDITIONED_DIM`."""
    for batch in store.select(capture_point, layers=list(order)).batches():
        kept = [max(r.tensors["projected"].shape[1:]) for r in batch.records if r.kind == "projected"]
        return int(max(kept)) if kept else PRECONDITIONED_DIM
    return PRECONDITIONED_DIM


#: The most bytes a preconditioned index may hold in memory (``N x L dim^2`` float32, the flat scan's rows): a larger
#: train pass is scored row by row instead (10^5 rows of the benchmark's MLP take 1.2 GB; 10^6 would take 12 GB).
MAX_INDEX_BYTES = 2 << 30


def index_fits(store: StoreReader, capture_point: str, order: Sequence[str]) -> bool:
    """Whether the pass's preconditioned index stays within :data:`MAX_INDEX_BYTES`."""
    rows = sum(ref.size for ref in store.batch_refs(capture_point))
    return rows * len(order) * index_dim(store, capture_point, order) ** 2 * 4 <= MAX_INDEX_BYTES


def whitened_sketches(
    records: Sequence[LayerRecord],
    fitted: Curvature,
    options: dict[str, Any],
    order: Sequence[str],
    dim: int,
    power: float,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> np.ndarray:
    """``(B, L dim^2)`` float32: each sample's gradient times ``(F + delta I)^-power`` per layer, sketched (seed 0) and
    laid side by side in ``order``; ``power = 1/2`` for the index's rows and a query.

    A Kronecker layer is whitened in its eigenbasis and sketched through projections that hold the rotation back
    (:func:`_eigen_sketch`: no ``d_out d_in (d_out + d_in)`` products per sample to rotate it); other layers are
    preconditioned (:func:`~metastore_plugins.core.ops.precondition.precondition`) and sketched by ``ops.sketch``.
    """
    batch = records[0].batch_size
    block = torch.zeros(batch, len(order), dim * dim)  # (B, L, dim^2)
    draw = ops.Projections()
    for layer, group in layer_groups(records).items():
        c = fitted.get(layer)
        slot = order.index(layer)
        if c is not None and c.kind == "outer":
            delta = c.damping(options["damping"], options["relative_damping"])
            block[:, slot] = _eigen_sketch(group, c, delta, power, dim, draw, max_bytes)
            continue
        whitened = precondition(group, fitted, options["damping"], options["relative_damping"], max_bytes, power)
        for record in whitened:
            block[:, slot] += ops.sketch(record, dim, dim, 0, max_bytes=max_bytes, projections=draw)
    return block.reshape(batch, -1).numpy().astype(np.float32)


def _eigen_sketch(
    group: Sequence[LayerRecord],
    c: LayerCurvature,
    delta: float,
    power: float,
    dim: int,
    draw: ops.Projections,
    max_bytes: int,
) -> Tensor:
    """``(B, dim^2)`` sketches ``sum_g P_out,g Q_D,g X_g Q_A,g^T P_in^T`` of one Kronecker layer's gradients whitened
    in its eigenbasis (``X = (Q_D^T G Q_A) / (Lambda + delta)^power``): the rotations are folded into the
    projections (``P Q``, once), so each sample costs a projection of ``X``, not a rotation of it. The sketch is then
    of the whitened gradient in the weights' basis, where it is spread evenly; sketched in the eigenbasis, where a
    few entries hold most of it, the Kronecker sketch was noisier (on the benchmark's MLP, 20,000 rows, 200
    candidates searched by the ``"reduced"`` plan: recall@10 0.55 against 0.62)."""
    groups, d_out, d_in = c.eigenvalues.shape
    assert c.q_in is not None and c.q_out is not None
    layer, cpu = group[0].layer, torch.device("cpu")
    scale = ((c.eigenvalues + delta) ** -power).float()  # (G, d_out, d_in')
    p_out = draw("whitened-out", layer, 0, (dim, groups * d_out), dim, cpu).reshape(dim, groups, d_out)
    p_out = p_out.transpose(0, 1) @ c.q_out.float()  # (G, dim, d_out)
    p_in = draw("whitened-in", layer, 0, (dim, d_in), dim, cpu) @ c.q_in.float()  # (G, dim, d_in')
    parts = []
    for lo, hi in chunks(group[0].batch_size, sample_chunk(c, max_bytes)):
        x = rotated(group, c, lo, hi).float() * scale  # (n, G, d_out, d_in')
        sketch = (p_out @ x @ p_in.transpose(1, 2)).sum(1)  # (n, dim, dim)
        parts.append(sketch.reshape(hi - lo, dim * dim))
    return torch.cat(parts)


def query_sketches(
    store: StoreReader,
    capture_point: str,
    ids: Sequence[int] | None,
    fitted: Curvature,
    options: dict[str, Any],
    order: Sequence[str],
    dim: int,
    power: float = 0.5,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> tuple[np.ndarray, np.ndarray]:
    """``(sample ids (M,), q (M, L dim^2))``: the test side of :func:`whitened_sketches`."""
    found, parts = [], []
    for batch in store.select(capture_point, sample_ids=ids, layers=list(order)).batches():
        parts.append(whitened_sketches(batch.records, fitted, options, order, dim, power, max_bytes))
        found.append(batch.meta["sample_id"].numpy())
    if not parts:
        return np.zeros(0, np.int64), np.zeros((0, len(order) * dim * dim), np.float32)
    return np.concatenate(found), np.concatenate(parts)


def preconditioned_index(
    store: StoreReader,
    capture_point: str,
    method: CurvatureMethod,
    fitted: Curvature,
    options: dict[str, Any],
    order: Sequence[str],
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> VectorIndex:
    """The train pass's index of ``lr_i`` times the sketches of ``S g_i`` (module docstring), kept in this process
    while the pass is unchanged. Searched flat (every row): whitened rows have no few principal directions to reduce
    them to (the TracIn index's ``"reduced"`` plan, 64 of them, found recall@10 0.62 at 200 candidates of 20,000 rows
    where the flat scan finds 0.89), and ``N x 3 x 32^2`` float32 of 10^5 rows (1.2 GB) scan in about 0.1 s."""
    damping = (options["damping"], options["relative_damping"])
    key = pass_key(store, capture_point, method, tuple(order), damping, max_bytes)
    kept = _INDEXES.get(key)
    if kept is not None:
        return kept
    dim = index_dim(store, capture_point, order)
    ids, lrs, parts = [], [], []
    for batch in store.select(capture_point, layers=list(order)).batches():
        parts.append(whitened_sketches(batch.records, fitted, options, order, dim, 0.5, max_bytes))
        ids.append(batch.meta["sample_id"].numpy())
        lrs.append(np.full(batch.size, batch.ref.lr_weight))
    width = len(order) * dim * dim
    vectors = np.concatenate(parts) if parts else np.zeros((0, width), np.float32)  # (N, D)
    sample_ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    lr = np.concatenate(lrs) if lrs else np.zeros(0)
    index = VectorIndex(capture_point, dim, sample_ids, lr, vectors, Plan())  # flat: every row scanned
    _keep(_INDEXES, key, index)
    return index


def _keep(kept: dict[tuple[Any, ...], Any], key: tuple[Any, ...], value: Any) -> None:
    kept[key] = value
    while len(kept) > MAX_KEPT:
        kept.pop(next(iter(kept)))


#: Curvatures fitted and preconditioned indexes built in this process, the oldest dropped beyond :data:`MAX_KEPT`.
_FITTED: dict[tuple[Any, ...], Curvature] = {}
_INDEXES: dict[tuple[Any, ...], VectorIndex] = {}
MAX_KEPT = 2
