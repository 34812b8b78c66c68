"""The preconditioned nearest-gradient index: a train pass's rows whitened by its curvature, then sketched.

K-FAC and EK-FAC score ``lr_i g_i^T (F + delta I)^-1 g_j``. With ``S = (F + delta I)^-1/2`` (per layer, the symmetric
square root: ``Q [(Q^T g) / sqrt(Lambda + delta)]``, :func:`~metastore_plugins.core.ops.precondition.precondition`
with ``power = 1/2``) the score is ``lr_i <S g_i, S g_j>``: an inner product of the same map on both sides. Its
sketches (the per-layer Kronecker sketches of ``S g``, side by side) estimate the score with an error of the order
of ``|S g_i| |S g_j| / dim``, where the TracIn index's (raw ``g_i`` against ``(F + delta I)^-1 g_j``) errs by
``|g_i| |(F + delta I)^-1 g_j| / dim``: far larger where the curvature is small, which is where the method's score
lives. On a curvature eigenbasis (records ``projected``) ``S`` divides each record in place, and the sketch of a
``k x k`` record at ``dim = k`` is the record: the vectors are exact, ``<lr_i v_i, q_j>`` is the score.

Beside the sketches the index keeps, where every record is a one-row Kronecker record, the rows' rotated factors
(:mod:`.index_factors`): the candidates' exact scores without a shard. Above :data:`COMPRESS_ABOVE` sketch numbers
(with FAISS) the sketches are projected on their leading principal directions and kept as product-quantization
codes: the scan of 10^5 rows takes about 1 ms, not 0.12 s.

The index depends on the fitted curvature, so it is kept in this process (:data:`MAX_KEPT` of them, each at most
:data:`MAX_INDEX_BYTES`: a larger pass is scored row by row) while the pass's batches and shards are unchanged, not
on disk: the reports (one process) build it once for all their test samples; each ``metastore influence -k``
command builds its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from metastore_plugins.core import ops
from metastore_plugins.core.analysis import curvature
from metastore_plugins.core.analysis.index_factors import (
    KeptFactors,
    factor_rows,
    factor_shapes,
    query_blocks,
    query_rotations,
)
from metastore_plugins.core.analysis.vector_index import projected_only
from metastore_plugins.core.analysis.vector_search import (
    PQ_SPAN,
    REDUCED_DIM,
    Plan,
    ProjectedCodes,
    VectorIndex,
    ann_search,
    load_faiss,
)
from metastore_plugins.core.ops import DEFAULT_MAX_BYTES
from metastore_plugins.core.ops._common import chunks
from metastore_plugins.core.ops.curvature import CurvatureMethod, LayerCurvature, augmented_prefix, layer_groups
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
    return (str(store.path), capture_point, *rest, _binding(store, capture_point))


def _binding(store: StoreReader, capture_point: str) -> tuple[tuple[str, int, str], ...]:
    """The pass's batches and their shards' sha256, kept per reader index (a reader's index does not change; a
    pass of 10^6 rows has about 2,000 batches: 5 ms a query, twice, otherwise)."""
    kept = _BINDINGS.get(id(store.index))
    if kept is None or kept[0] is not store.index:
        kept = (store.index, {})
        _keep(_BINDINGS, id(store.index), kept)
    found = kept[1].get(capture_point)
    if found is None:
        refs = store.batch_refs(capture_point)
        found = tuple((ref.file.name, ref.batch, store.shard_sha256(ref.file.name)) for ref in refs)
        kept[1][capture_point] = found
    return found


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
    """The largest ``k`` of the pass's projected records (each its own sketch), else :data:`PRECONDITIONED_DIM`."""
    for batch in store.select(capture_point, layers=list(order)).batches():
        kept = [max(r.tensors["projected"].shape[1:]) for r in batch.records if r.kind == "projected"]
        return int(max(kept)) if kept else PRECONDITIONED_DIM
    return PRECONDITIONED_DIM


#: The most bytes a preconditioned index may hold in memory (its sketches, float32 or product-quantized, and its
#: rotated factors): a larger train pass is scored row by row instead. 10^5 rows of the benchmark's MLP take 1.4 GB
#: flat (``N x 3 x 32^2`` float32 and 557 factors a row); 10^6 take 2.4 GB with FAISS (:data:`COMPRESS_ABOVE`).
MAX_INDEX_BYTES = 4 << 30

#: Above this many sketch numbers (``N x L dim^2``), where FAISS is installed and the records are not projected, the
#: whitened sketches are projected on their :data:`~.vector_search.REDUCED_DIM` leading uncentred principal
#: directions and kept product-quantized (:class:`~.vector_search.ProjectedCodes`: 128 bytes a row), scanned by table
#: lookups: at 10^5 rows of the benchmark's MLP the candidates' recall of the exhaustive top-10 went from 0.98 to 0.95
#: at 2,400 candidates, the scan from 123 ms to 1.2 ms (docs/benchmarks.md). Without FAISS they stay float32, flat.
COMPRESS_ABOVE = 1 << 26


def index_bytes(store: StoreReader, capture_point: str, order: Sequence[str], compress: bool) -> int:
    """The bytes of the pass's preconditioned index: its sketches (float32, or projected and product-quantized)
    and the rotated factors of its Kronecker records (``sum G (d_out + d_in')`` float32 a row; counted for every
    record, whether or not they are kept)."""
    rows, width = _rows_and_width(store, capture_point, order)
    factors = 0
    for batch in store.select(capture_point, layers=list(order)).batches():
        outer = [r for r in batch.records if r.kind == "outer"]
        factors = sum(r.tensors["suffix"][0].numel() + augmented_prefix(r)[0].numel() for r in outer)
        break
    return rows * ((min(REDUCED_DIM, width) // (2 * PQ_SPAN) if compress else 4 * width) + 4 * factors)


def compresses(store: StoreReader, capture_point: str, order: Sequence[str]) -> bool:
    """Whether the pass's index is product-quantized (:data:`COMPRESS_ABOVE`)."""
    rows, width = _rows_and_width(store, capture_point, order)
    return rows * width > COMPRESS_ABOVE and load_faiss() is not None and not projected_only(store, order)


def _rows_and_width(store: StoreReader, capture_point: str, order: Sequence[str]) -> tuple[int, int]:
    """The pass's rows and its index's sketch numbers a row (``L dim^2``)."""
    rows = sum(ref.size for ref in store.batch_refs(capture_point))
    return rows, len(order) * index_dim(store, capture_point, order) ** 2


def index_fits(store: StoreReader, capture_point: str, order: Sequence[str]) -> bool:
    """Whether the pass's preconditioned index stays within :data:`MAX_INDEX_BYTES`."""
    return index_bytes(store, capture_point, order, compresses(store, capture_point, order)) <= MAX_INDEX_BYTES


def whitened_sketches(
    records: Sequence[LayerRecord],
    fitted: Curvature,
    options: dict[str, Any],
    order: Sequence[str],
    dim: int,
    power: float,
    max_bytes: int = DEFAULT_MAX_BYTES,
    draw: ops.Projections | None = None,
    rotations: dict[str, Tensor] | None = None,
) -> np.ndarray:
    """``(B, L dim^2)`` float32: each sample's gradient times ``(F + delta I)^-power`` per layer, sketched (seed 0) and
    laid side by side in ``order``; ``power = 1/2`` for the index's rows and a query. ``draw`` keeps the projections
    across calls (an index's build and its queries: drawn once, not per batch or query); ``rotations`` the Kronecker
    layers' gradients in their eigenbasis where already at hand (:func:`.index_factors.query_rotations`).

    A Kronecker layer is whitened in its eigenbasis and sketched through projections that hold the rotation back
    (:func:`_eigen_sketch`: no ``d_out d_in (d_out + d_in)`` products per sample to rotate it); other layers are
    preconditioned (:func:`~metastore_plugins.core.ops.precondition.precondition`) and sketched by ``ops.sketch``.
    """
    batch = records[0].batch_size
    block = torch.zeros(batch, len(order), dim * dim)  # (B, L, dim^2)
    draw = draw or ops.Projections()
    for layer, group in layer_groups(records).items():
        c = fitted.get(layer)
        slot = order.index(layer)
        if c is not None and c.kind == "outer":
            delta = c.damping(options["damping"], options["relative_damping"])
            given = None if rotations is None else rotations[layer]
            block[:, slot] = _eigen_sketch(group, c, delta, power, dim, draw, max_bytes, given)
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
    given: Tensor | None = None,
) -> Tensor:
    """``(B, dim^2)`` sketches ``sum_g P_out,g Q_D,g X_g Q_A,g^T P_in^T`` of one Kronecker layer's gradients whitened
    in its eigenbasis (``X = (Q_D^T G Q_A) / (Lambda + delta)^power``): the rotations are folded into the
    projections (``P Q``, once), so each sample costs a projection of ``X``, not a rotation of it. The sketch is then
    of the whitened gradient in the weights' basis, where it is spread evenly; sketched in the eigenbasis, where a
    few entries hold most of it, the Kronecker sketch was noisier (on the benchmark's MLP, 20,000 rows, 200
    candidates searched by the ``"reduced"`` plan: recall@10 0.55 against 0.62). ``given``: ``Q_D^T G Q_A``, if
    computed already."""
    groups, d_out, d_in = c.eigenvalues.shape
    assert c.q_in is not None and c.q_out is not None
    layer, cpu = group[0].layer, torch.device("cpu")
    scale = ((c.eigenvalues + delta) ** -power).float()  # (G, d_out, d_in')
    p_out = draw("whitened-out", layer, 0, (dim, groups * d_out), dim, cpu).reshape(dim, groups, d_out)
    p_out = p_out.transpose(0, 1) @ c.q_out.float()  # (G, dim, d_out)
    p_in = draw("whitened-in", layer, 0, (dim, d_in), dim, cpu) @ c.q_in.float()  # (G, dim, d_in')
    parts = []
    for lo, hi in chunks(group[0].batch_size, sample_chunk(c, max_bytes)):
        x = (rotated(group, c, lo, hi) if given is None else given[lo:hi]).float() * scale  # (n, G, d_out, d_in')
        sketch = (p_out @ x @ p_in.transpose(1, 2)).sum(1)  # (n, dim, dim)
        parts.append(sketch.reshape(hi - lo, dim * dim))
    return torch.cat(parts)


@dataclass
class WhitenedIndex:
    """A train pass's preconditioned index, in selection order: ``lr_i`` times the whitened sketches, float32 and
    scanned flat (``flat``) or projected and product-quantized (``codes``, a FAISS ``IndexPreTransform`` of an
    ``IndexPQFastScan`` of the weighted rows: :data:`COMPRESS_ABOVE`), and
    the rows' rotated factors where every record is rank one (``factors``: exact scores without a shard);
    ``norms``: each row's ``lr_i |sketch of S g_i|``, the scale of its sketch's error."""

    capture_point: str
    dim: int
    sample_ids: np.ndarray  # (N,) int64
    lr: np.ndarray  # (N,) float64
    flat: VectorIndex | None
    codes: Any = None
    factors: KeptFactors | None = None
    draw: ops.Projections = field(default_factory=ops.Projections, repr=False)  # its sketches' projections
    norms: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # (N,)
    _sorted: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)
    _heaviest: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    def heaviest(self, count: int) -> np.ndarray:
        """``(c,)`` ascending: the rows of the ``c = min(count, N)`` largest :attr:`norms` (kept per count)."""
        count = min(count, len(self.norms))
        if count not in self._heaviest:
            top = np.argpartition(-self.norms, count - 1)[:count] if count else np.zeros(0, np.int64)
            self._heaviest[count] = np.sort(top)
        return self._heaviest[count]

    def rows_of(self, ids: Sequence[int]) -> np.ndarray:
        """``(n,)`` ascending: every row holding one of the sample ``ids`` (a binary search in the sorted sample ids,
        kept: not a pass over all ``N``)."""
        if self._sorted is None:
            order = np.argsort(self.sample_ids, kind="stable")  # (N,)
            self._sorted = (order, self.sample_ids[order])
        order, ordered = self._sorted
        wanted = np.asarray(ids, dtype=np.int64)  # (m,)
        lo, hi = np.searchsorted(ordered, wanted, "left"), np.searchsorted(ordered, wanted, "right")  # (m,)
        counts = hi - lo
        firsts = np.repeat(lo - np.cumsum(counts) + counts, counts)  # (n,) each run's start, less its offset
        return np.sort(order[firsts + np.arange(int(counts.sum()))])

    def search(self, queries_: np.ndarray, count: int) -> np.ndarray:
        """``(M, c)`` rows of the ``c = min(count, N)`` largest (estimated) ``<lr_i v_i, q>`` per query."""
        if self.flat is not None:
            return self.flat.search(queries_, count)
        q = np.ascontiguousarray(queries_, dtype=np.float32)  # (M, D)
        return ann_search(self.codes, q, min(count, len(self.sample_ids)))


@dataclass
class QuerySide:
    """A test pass's queries against a preconditioned index: ``ids`` ``(M,)``, ``sketches`` ``(M, L dim^2)`` (the
    test side of :func:`whitened_sketches`) and, for an index with rotated factors, ``blocks``
    (:func:`.index_factors.query_blocks`, else ``None``)."""

    ids: np.ndarray
    sketches: np.ndarray
    blocks: dict[str, np.ndarray] | None


def query_side(
    store: StoreReader,
    capture_point: str,
    ids: Sequence[int] | None,
    fitted: Curvature,
    options: dict[str, Any],
    order: Sequence[str],
    index: WhitenedIndex,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> QuerySide:
    """The queries of ``capture_point``'s samples ``ids`` (all: ``None``) against ``index``."""
    found, parts, blocks = [], [], []
    for batch in store.select(capture_point, sample_ids=ids, layers=list(order)).batches():
        turned = None if index.factors is None else query_rotations(batch.records, fitted, order, max_bytes)
        sketched = whitened_sketches(
            batch.records, fitted, options, order, index.dim, 0.5, max_bytes, index.draw, turned
        )
        parts.append(sketched)
        found.append(batch.meta["sample_id"].numpy())
        if index.factors is not None:
            blocks.append(None if turned is None else query_blocks(turned, fitted, options))
    if not parts:
        return QuerySide(np.zeros(0, np.int64), np.zeros((0, len(order) * index.dim**2), np.float32), None)
    joined = None
    if blocks and all(b is not None for b in blocks):
        joined = {layer: np.concatenate([b[layer] for b in blocks if b is not None]) for layer in order}
    return QuerySide(np.concatenate(found), np.concatenate(parts), joined)


def preconditioned_index(
    store: StoreReader,
    capture_point: str,
    method: CurvatureMethod,
    fitted: Curvature,
    options: dict[str, Any],
    order: Sequence[str],
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> WhitenedIndex:
    """The train pass's index of ``lr_i`` times the sketches of ``S g_i`` (module docstring), its rotated factors
    (:mod:`.index_factors`) and its rows' norms, kept in this process while the pass is unchanged. Searched flat or,
    above :data:`COMPRESS_ABOVE`, through product-quantized codes (no clusters to partition whitened rows by: IVF, a
    quarter of its lists probed, recalled 0.4 of 10^5 rows' top-10)."""
    key = index_key(store, capture_point, method, options, order, max_bytes)
    kept = _INDEXES.get(key)
    if kept is not None:
        return kept
    dim = index_dim(store, capture_point, order)
    width = len(order) * dim * dim
    quantizer = ProjectedCodes(load_faiss(), width) if compresses(store, capture_point, order) else None
    ids, lrs, parts, norms, draw = [], [], [], [], ops.Projections()
    factors: list[np.ndarray] | None = []
    for batch in store.select(capture_point, layers=list(order)).batches():
        part = whitened_sketches(batch.records, fitted, options, order, dim, 0.5, max_bytes, draw)  # (B, D)
        norms.append(np.linalg.norm(part, axis=1) * np.float32(batch.ref.lr_weight))  # (B,)
        if quantizer is None:
            parts.append(part)
        else:
            quantizer.add(part * np.float32(batch.ref.lr_weight))
        if factors is not None:
            found = factor_rows(batch.records, fitted, order)  # (B, W), None: not rank one
            if found is None:
                factors = None
            else:
                factors.append(found)
        ids.append(batch.meta["sample_id"].numpy())
        lrs.append(np.full(batch.size, batch.ref.lr_weight))
    sample_ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    lr = np.concatenate(lrs) if lrs else np.zeros(0)
    flat = None
    if quantizer is None:
        vectors = np.concatenate(parts) if parts else np.zeros((0, width), np.float32)  # (N, D)
        flat = VectorIndex(capture_point, dim, sample_ids, lr, vectors, Plan())  # flat: every row scanned
    kept_factors = KeptFactors(list(order), np.concatenate(factors), factor_shapes(fitted, order)) if factors else None
    codes = quantizer and quantizer.finish()
    index = WhitenedIndex(capture_point, dim, sample_ids, lr, flat, codes, kept_factors, draw,
                          np.concatenate(norms) if norms else np.zeros(0, np.float32))  # fmt: skip
    _keep(_INDEXES, key, index)
    return index


def kept_index(key: tuple[Any, ...]) -> WhitenedIndex | None:
    """The preconditioned index of ``key`` (:func:`index_key`) where this process keeps it
    (:func:`preconditioned_index`), else ``None``."""
    return _INDEXES.get(key)


def index_key(
    store: StoreReader,
    capture_point: str,
    method: CurvatureMethod,
    options: dict[str, Any],
    order: Sequence[str],
    max_bytes: int,
) -> tuple[Any, ...]:
    """What a pass's preconditioned index is kept under: the pass (its shards), the method, the damping, the layers
    and ``max_bytes``."""
    damping = (options["damping"], options["relative_damping"])
    return pass_key(store, capture_point, method, tuple(order), damping, max_bytes)


def _keep(kept: dict[Any, Any], key: Any, value: Any) -> None:
    kept[key] = value
    while len(kept) > MAX_KEPT:
        kept.pop(next(iter(kept)))


#: Curvatures fitted and preconditioned indexes built in this process, the oldest dropped beyond :data:`MAX_KEPT`.
_FITTED: dict[tuple[Any, ...], Curvature] = {}
_INDEXES: dict[tuple[Any, ...], WhitenedIndex] = {}
MAX_KEPT = 2
#: :func:`_binding`'s, per reader index (the index itself kept beside them: its ``id`` is not reused while kept).
_BINDINGS: dict[int, tuple[Any, dict[str, tuple[tuple[str, int, str], ...]]]] = {}
