"""The nearest-gradient index in memory: a capture point's vectors and how they are searched (flat, IVF, reduced).

The vectors are per-layer Kronecker sketches side by side, times each row's learning rate: their
inner product with a test sample's vector is its sketched TracIn score. :func:`choose_plan` picks an
exhaustive scan (flat), FAISS IVF (:func:`build_ivf`) or, for wide rows, a scan of their principal
directions whose candidates are rescored on the full rows (:func:`build_reduced`) from the rows and
width; the index's files are :mod:`.index_files`, its queries :mod:`.vector_index`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: A flat index scans ``N * D`` numbers per query; above this many, FAISS IVF (when installed).
FLAT_MAX_VALUES = 1 << 23


@dataclass(frozen=True)
class Plan:
    """How an index searches: ``"flat"`` (every row); ``"ivf"`` (FAISS IVF, ``nlist`` lists, ``nprobe`` probed);
    ``"reduced"``: a scan of the rows projected on their ``reduced`` principal directions gives ``candidates`` rows
    per query, rescored exactly on the full rows (:func:`build_reduced`)."""

    kind: str = "flat"
    nlist: int = 0
    nprobe: int = 0
    reduced: int = 0
    candidates: int = 0


#: Rows wider than this are searched through their principal directions (:func:`build_reduced`), not IVF over them.
REDUCE_ABOVE = 256


def choose_plan(rows: int, width: int, have_faiss: bool) -> Plan:
    """Flat up to :data:`FLAT_MAX_VALUES` numbers (or without FAISS). Above, rows up to :data:`REDUCE_ABOVE` wide:
    IVF, ``nlist ~ 4 sqrt(N)`` (a power of two in 64..65536), ``nprobe = nlist / 4``; wider rows: ``"reduced"``
    to 64 principal directions, 256 candidates rescored (both chosen in metastore_bench/index_bench.py)."""
    if rows * width <= FLAT_MAX_VALUES or not have_faiss:
        return Plan()
    if width > REDUCE_ABOVE:
        return Plan("reduced", reduced=64, candidates=256)
    nlist = int(min(65536, max(64, 2 ** round(math.log2(4 * math.sqrt(rows))))))
    return Plan("ivf", nlist, max(1, nlist // 4))


def load_faiss() -> Any | None:
    """The ``faiss`` module, or ``None`` where it is not installed (then every index is flat)."""
    try:
        import faiss
    except ImportError:
        return None
    return faiss


class RowStack:
    """Arrays of one width (an index's parts, read from their files as rows are asked for) seen as their ``(N, D)``
    concatenation, never built: ``stack[rows]`` and ``stack[a:b]`` read those rows only, ``stack @ m`` goes part
    by part."""

    def __init__(self, parts: Sequence[Any], width: int) -> None:
        self.parts = list(parts)
        self.starts = np.cumsum([0, *(len(p) for p in self.parts)])  # (P + 1,) first row of each part
        self.shape = (int(self.starts[-1]), int(width))
        self.dtype = np.dtype(np.float32)
        self.nbytes = self.shape[0] * self.shape[1] * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: slice | np.ndarray) -> np.ndarray:
        rows = np.arange(*key.indices(len(self))) if isinstance(key, slice) else np.asarray(key, dtype=np.int64)
        part = np.searchsorted(self.starts, rows, side="right") - 1  # (n,)
        out = np.empty((len(rows), self.shape[1]), self.dtype)  # (n, D)
        for p in np.unique(part).tolist():
            mine = part == p
            out[mine] = self.parts[p][rows[mine] - self.starts[p]]
        return out

    def __matmul__(self, other: np.ndarray) -> np.ndarray:
        if not self.parts:
            return np.zeros((0, *other.shape[1:]), np.float32)
        return np.concatenate([np.asarray(p) @ other for p in self.parts])  # (N, ...)


@dataclass
class VectorIndex:
    """The vectors of one capture point, in selection order (``store.sample_ids(capture_point)``)."""

    capture_point: str
    dim: int
    sample_ids: np.ndarray  # (N,) int64
    lr: np.ndarray  # (N,) float64, 1 where none was recorded
    vectors: np.ndarray | RowStack  # (N, D) float32: per-layer sketches side by side, D = L dim^2
    plan: Plan
    ann: Any = None  # build_ivf of lr * vectors, for plan.kind == "ivf"
    rebuilt: list[str] = field(default_factory=list)  # files (re)built by this open
    _weighted: np.ndarray | None = field(default=None, repr=False)

    def weighted(self) -> np.ndarray:
        """``(N, D)`` ``lr_i * vector_i``: inner products with a test sketch are sketched TracIn scores (kept)."""
        if self._weighted is None:
            vectors = np.asarray(self.vectors)  # (N, D): a RowStack's rows read whole
            same = bool(np.all(self.lr == 1.0))
            self._weighted = vectors if same else (vectors * self.lr[:, None]).astype(np.float32)
        return self._weighted

    def weighted_rows(self, rows: np.ndarray) -> np.ndarray:
        """``(n, D)`` ``lr_i * vector_i`` of these rows only (others are not read: memory-mapped vectors)."""
        if self._weighted is not None:
            return np.asarray(self._weighted[rows])
        found = np.array(self.vectors[rows], dtype=np.float32)  # (n, D)
        found *= self.lr[rows, None].astype(np.float32)
        return found

    def search(self, queries_: np.ndarray, count: int) -> np.ndarray:
        """``(M, c)`` rows of the ``c = min(count, N)`` largest ``<lr_i v_i, q>`` per query (no order among them)."""
        count = min(count, len(self.sample_ids))
        q = np.ascontiguousarray(queries_, dtype=np.float32)  # (M, D)
        if count == 0:
            return np.zeros((len(q), 0), dtype=np.int64)
        if self.ann is None:
            return largest(self.weighted() @ q.T, count)
        if self.plan.kind != "reduced":
            self.ann.nprobe = self.plan.nprobe
            q = np.hstack([q, np.zeros((len(q), 1), np.float32)])  # (M, D + 1): see build_ivf
            return ann_search(self.ann, q, count)
        found = ann_search(self.ann, q, max(count, self.plan.candidates))  # (M, C)
        return np.stack([self._rescored(rows[rows >= 0], query, count) for rows, query in zip(found, q)])

    def _rescored(self, rows: np.ndarray, query: np.ndarray, count: int) -> np.ndarray:
        """``(count,)`` of ``rows``, the largest ``<lr_i v_i, query>`` on the full rows (read in row order)."""
        rows = np.unique(rows)  # sorted: a memory-mapped file is read forward
        if len(rows) < count:  # fewer candidates than asked: every row instead
            return largest((self.vectors @ query[:, None]) * self.lr[:, None], count)[0]
        exact = (np.asarray(self.vectors[rows]) @ query) * self.lr[rows]  # (C,): lr_i <v_i, q>
        return rows[largest(exact[:, None], count)[0]]

    def search_cosine(self, queries_: np.ndarray, count: int) -> np.ndarray:
        """``(M, c)`` rows of the largest cosines between ``v_i`` and each query (a scan of every row)."""
        norms = row_norms(self.vectors)  # (N,)
        cosines = (self.vectors @ np.asarray(queries_, np.float32).T) / np.maximum(norms, 1e-30)[:, None]  # (N, M)
        return largest(cosines, min(count, len(self.sample_ids)))


#: Fewer queries than this are searched by FAISS on one thread (FAISS's own threshold for its BLAS path).
ONE_THREAD_BELOW = 20


def ann_search(ann: Any, queries_: np.ndarray, count: int) -> np.ndarray:
    """``(M, count)`` row numbers from ``ann.search``; a few queries on one OpenMP thread (on the shared 2-core
    machine one query took 1.5 ms so and 16-28 ms on two, their threads waiting on each other under load)."""
    faiss = load_faiss()
    if faiss is None or len(queries_) >= ONE_THREAD_BELOW:
        return np.asarray(ann.search(queries_, count)[1], dtype=np.int64)
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        return np.asarray(ann.search(queries_, count)[1], dtype=np.int64)
    finally:
        faiss.omp_set_num_threads(threads)


def build_ivf(weighted: np.ndarray, plan: Plan, faiss: Any) -> Any:
    """An IVF index (``IndexIVFFlat``, L2) whose nearest neighbours of ``[q, 0]`` are the largest ``<x, q>``.

    Inner-product search is reduced to distance search (Bachrach et al. 2014): each row ``x`` gets one more
    coordinate ``sqrt(M^2 - |x|^2)`` (``M`` the largest norm), so that ``|x' - [q, 0]|^2 = M^2 + |q|^2 - 2 <x, q>``.
    IVF clusters the augmented rows by distance; on the benchmark's 10^5 rows this found the whole
    exhaustive top-10 for 90% of queries at ``nprobe = nlist / 4``, against 82% with IVF on the inner product.
    """
    norms = np.linalg.norm(weighted, axis=1)  # (N,)
    top = float(norms.max()) if len(norms) else 0.0
    extra = np.sqrt(np.maximum(top * top - norms * norms, 0.0))[:, None]  # (N, 1)
    rows = np.ascontiguousarray(np.hstack([weighted, extra]), dtype=np.float32)  # (N, D + 1)
    ann = faiss.IndexIVFFlat(faiss.IndexFlatL2(rows.shape[1]), rows.shape[1], plan.nlist, faiss.METRIC_L2)
    ann.train(rows[np.random.default_rng(0).permutation(len(rows))[: 40 * plan.nlist]])
    ann.add(rows)
    return ann


def principal_directions(sample: np.ndarray, count: int) -> np.ndarray:
    """``(D, count)`` float32: the top eigenvectors of ``sample^T sample`` (uncentred: inner products, not distances,
    are what they keep), ``sample`` ``(n, D)``. Per-sample gradients have low effective rank: a few dozen
    directions carry most of a row's norm, and ``<x P, q P>`` ranks nearly as ``<x, q>`` does."""
    rows = np.asarray(sample, dtype=np.float64)  # (n, D)
    values, vectors = np.linalg.eigh(rows.T @ rows)  # ascending
    return np.ascontiguousarray(vectors[:, ::-1][:, :count], dtype=np.float32)  # (D, count)


def projection(basis: np.ndarray, faiss: Any) -> Any:
    """A FAISS ``LinearTransform`` ``y = basis^T x`` (``basis`` ``(D, r)``), trained."""
    transform = faiss.LinearTransform(basis.shape[0], basis.shape[1], False)
    faiss.copy_array_to_vector(np.ascontiguousarray(basis.T, dtype=np.float32).ravel(), transform.A)  # A (r, D)
    transform.is_trained = True
    return transform


def build_reduced(
    vectors: np.ndarray | RowStack,
    lr: np.ndarray,
    plan: Plan,
    faiss: Any,
    sample: int = 1 << 15,
    block: int = 1 << 14,
) -> Any:
    """A FAISS index (``IndexPreTransform``: projection on ``plan.reduced`` :func:`principal_directions` of ``sample``
    seeded rows, then ``IndexFlatIP``) whose search gives the rows of largest ``<(lr_i v_i) P, q P>``: the
    candidates :meth:`VectorIndex.search` rescores on the full rows. ``block`` rows are read at a time, so
    ``vectors`` may be a memory-mapped array larger than memory; the index holds ``N x plan.reduced`` numbers."""
    picked = np.sort(np.random.default_rng(0).permutation(len(vectors))[:sample])  # (s,)
    basis = principal_directions(np.asarray(vectors[picked]) * lr[picked, None], plan.reduced)  # (D, r)
    ann = faiss.IndexPreTransform(projection(basis, faiss), faiss.IndexFlatIP(plan.reduced))
    for start in range(0, len(vectors), block):
        rows = np.asarray(vectors[start : start + block]) * lr[start : start + block, None]  # (b, D)
        ann.add(np.ascontiguousarray(rows, dtype=np.float32))
    return ann


#: The principal directions the rows are projected on before they are product-quantized (:class:`ProjectedCodes`).
REDUCED_DIM = 512
#: Projected numbers per product-quantizer code (4 bits).
PQ_SPAN = 2
#: Rows the projection and the product quantizer are fitted on (the pass's first ones).
PQ_TRAIN_ROWS = 1 << 15


class ProjectedCodes:
    """Rows projected and product-quantized as they come (``add``; ``finish`` gives the FAISS index, an
    ``IndexPreTransform`` of an ``IndexPQFastScan``): the first :data:`PQ_TRAIN_ROWS` fit the projection on their
    :data:`REDUCED_DIM` leading principal directions and the quantizer (4 bits per :data:`PQ_SPAN` numbers)."""

    def __init__(self, faiss: Any, width: int) -> None:
        self.faiss, self.width = faiss, width
        self.waiting: list[np.ndarray] = []
        self.codes: Any = None

    def add(self, rows: np.ndarray) -> None:
        if self.codes is not None:
            self.codes.add(rows)
            return
        self.waiting.append(rows)
        if sum(len(w) for w in self.waiting) >= PQ_TRAIN_ROWS:
            self.finish()

    def finish(self) -> Any:
        if self.codes is None:
            first = np.concatenate(self.waiting)  # (n, D)
            reduced = min(REDUCED_DIM, self.width)
            quantized = self.faiss.IndexPQFastScan(reduced, reduced // PQ_SPAN, 4, self.faiss.METRIC_INNER_PRODUCT)
            basis = principal_directions(first, reduced)  # (D, r)
            self.codes = self.faiss.IndexPreTransform(projection(basis, self.faiss), quantized)
            self.codes.train(first)
            self.codes.add(first)
            self.waiting = []
        return self.codes


def row_norms(vectors: np.ndarray | RowStack, block: int = 1 << 14) -> np.ndarray:
    """``(N,)`` float32 Euclidean norms of the rows, read ``block`` rows at a time."""
    found = [np.linalg.norm(np.asarray(vectors[s : s + block]), axis=1) for s in range(0, len(vectors), block)]
    return np.concatenate(found) if found else np.zeros(0, np.float32)


def largest(scores: np.ndarray, count: int) -> np.ndarray:
    """``(M, count)`` rows of the largest entries of each column of ``(N, M)`` scores."""
    if count == 0:
        return np.zeros((scores.shape[1], 0), dtype=np.int64)
    return np.argpartition(-scores, count - 1, axis=0)[:count].T.astype(np.int64)
