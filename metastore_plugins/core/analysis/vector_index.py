"""Top-k at any scale: a nearest-gradient index over a capture point's sketches, exact where it matters.

``store.influence(train, test, k=10)`` and ``store.similar(query, candidates, k=10)`` ask for a
few rows out of millions. The index answers *which rows could be among them*; the store then
scores only those rows:

1. **Candidates.** Each training row's vector is its per-layer Kronecker sketches side by side
   (``sketches(..., combine="concat")``; for layers kept projected ``k x k``, the stored projections
   themselves), times its batch's learning rate: its inner product with a test sample's vector is
   the sketched TracIn score, and on projected records exactly the estimate ``influence`` reports.
   Per test sample and direction (proponents: ``+t``, opponents: ``-t``) the ``candidates`` rows
   of largest inner product are taken, over every paired pass; their union is rescored.
2. **Estimated scores.** :func:`~metastore_plugins.core.analysis.queries.influence` on the union only
   (exact for layers kept as factors); where every record of the layers is projected, the same
   estimates from the index's vectors, without reading a shard.
3. **Exact scores.** Given a ``recompute`` function, the existing refinement
   (:func:`~metastore_plugins.core.analysis.refine.refine_influence`) recomputes the strongest rows.

The result is a :class:`Scores` whose rows are the union of the candidates: ``.top(k)`` is the
answer. The search structure is chosen from the rows ``N`` and width ``D`` (:func:`choose_plan`):
an exhaustive scan of the vectors (flat) up to :data:`FLAT_MAX_VALUES` numbers, FAISS IVF above
(``faiss-cpu``, the ``index`` extra; :func:`build_ivf`). Without FAISS every index is flat: the same candidates,
slower. ``similar`` always scans its vectors (cosine is not the inner product IVF is built for).

**Files** (``<store>/vector_index/``, :mod:`metastore_plugins.core.store.vector_files`): one part per
shard holding batches of the capture point (its vectors, sample ids and learning rates), bound to
the shard's file name and sha256 from the store's index; the FAISS index bound to the parts it
was built over; a CRC'd manifest listing both with their sha256. A shard that changed or went away
makes its part stale: it is rebuilt from the shard (new shards get new parts). A part or FAISS file
that does not match its sha256, a damaged manifest, a link where a file or the folder belongs: not
used, said in one warning line, rebuilt (in memory where the store cannot be written).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from metastore_plugins.core.analysis import queries
from metastore_plugins.core.analysis.refine import RecomputeFn, refine_influence
from metastore_plugins.core.analysis.results import Scores
from metastore_plugins.core.analysis.scan import scan_of
from metastore_plugins.core.analysis.sketches import check_seed, compute_sketches, sketch_layers
from metastore_plugins.core.ops import DEFAULT_MAX_BYTES

from metastore_plugins.core.store import StoreError, StoreReader
from metastore_plugins.core.store import vector_files as vf
from metastore_plugins.core.store.journal import KIND_CODES
#: A flat index scans ``N * D`` numbers per query; above this many, FAISS IVF (when installed).
FLAT_MAX_VALUES = 1 << 23
#: The sketch size of a capture point whose records are factors (a projected one uses its own ``k``).
DEFAULT_DIM = 16


@dataclass(frozen=True)
class Plan:
    """How an index searches: ``"flat"`` (every row), or ``"ivf"`` with ``nlist`` lists, ``nprobe`` probed."""

    kind: str = "flat"
    nlist: int = 0
    nprobe: int = 0


def choose_plan(rows: int, width: int, have_faiss: bool) -> Plan:
    """Flat up to :data:`FLAT_MAX_VALUES` numbers (or without FAISS); IVF above, ``nlist ~ 4 sqrt(N)``
    (a power of two in 64..65536) and ``nprobe = nlist / 4`` (recall@10 >= 0.95 in benchmarks/index_bench.py)."""
    if rows * width <= FLAT_MAX_VALUES or not have_faiss:
        return Plan()
    nlist = int(min(65536, max(64, 2 ** round(math.log2(4 * math.sqrt(rows))))))
    return Plan("ivf", nlist, max(1, nlist // 4))


def load_faiss() -> Any | None:
    """The ``faiss`` module, or ``None`` where it is not installed (then every index is flat)."""
    try:
        import faiss
    except ImportError:
        return None
    return faiss


@dataclass
class VectorIndex:
    """The vectors of one capture point, in selection order (``store.sample_ids(capture_point)``)."""

    capture_point: str
    dim: int
    sample_ids: np.ndarray  # (N,) int64
    lr: np.ndarray  # (N,) float64, 1 where none was recorded
    vectors: np.ndarray  # (N, D) float32: per-layer sketches side by side, D = L dim^2
    plan: Plan
    ann: Any = None  # build_ivf of lr * vectors, for plan.kind == "ivf"
    rebuilt: list[str] = field(default_factory=list)  # files (re)built by this open
    _weighted: np.ndarray | None = field(default=None, repr=False)

    def weighted(self) -> np.ndarray:
        """``(N, D)`` ``lr_i * vector_i``: inner products with a test sketch are sketched TracIn scores (kept)."""
        if self._weighted is None:
            same = bool(np.all(self.lr == 1.0))
            self._weighted = self.vectors if same else (self.vectors * self.lr[:, None]).astype(np.float32)
        return self._weighted

    def search(self, queries_: np.ndarray, count: int) -> np.ndarray:
        """``(M, c)`` rows of the ``c = min(count, N)`` largest ``<lr_i v_i, q>`` per query (no order among them)."""
        count = min(count, len(self.sample_ids))
        q = np.ascontiguousarray(queries_, dtype=np.float32)  # (M, D)
        if count == 0:
            return np.zeros((len(q), 0), dtype=np.int64)
        if self.ann is not None:
            self.ann.nprobe = self.plan.nprobe
            q = np.hstack([q, np.zeros((len(q), 1), np.float32)])  # (M, D + 1): see build_ivf
            return np.asarray(self.ann.search(q, count)[1], dtype=np.int64)
        return _largest(self.weighted() @ q.T, count)

    def search_cosine(self, queries_: np.ndarray, count: int) -> np.ndarray:
        """``(M, c)`` rows of the largest cosines between ``v_i`` and each query (a scan of every row)."""
        norms = np.linalg.norm(self.vectors, axis=1)  # (N,)
        cosines = (self.vectors @ np.asarray(queries_, np.float32).T) / np.maximum(norms, 1e-30)[:, None]  # (N, M)
        return _largest(cosines, min(count, len(self.sample_ids)))


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


def _largest(scores: np.ndarray, count: int) -> np.ndarray:
    """``(M, count)`` rows of the largest entries of each column of ``(N, M)`` scores."""
    if count == 0:
        return np.zeros((scores.shape[1], 0), dtype=np.int64)
    return np.argpartition(-scores, count - 1, axis=0)[:count].T.astype(np.int64)


def default_dim(store: StoreReader, capture_point: str, layers: Sequence[str]) -> int:
    """The ``k`` of the capture point's projected records (their own sketch), else :data:`DEFAULT_DIM`."""
    for batch in store.select(capture_point, layers=list(layers)).batches():
        for record in batch.records:
            if record.kind == "projected":
                return int(record.tensors["projected"].shape[1])
        return DEFAULT_DIM
    return DEFAULT_DIM


def open_index(
    store: StoreReader,
    capture_point: str,
    *,
    dim: int | None = None,
    seed: int = 0,
    layers: Sequence[str] | None = None,
    build: bool = True,
    plan: Plan | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> VectorIndex | None:
    """The capture point's index, its stale or missing parts (re)built and kept; ``None`` when ``build`` is
    False and none was ever built. ``plan`` overrides :func:`choose_plan` (tests, benchmarks)."""
    order, seed = sketch_layers(store, layers), check_seed(seed)
    dim = default_dim(store, capture_point, order) if dim is None else int(dim)
    key = vf.key_hash(capture_point, dim, seed, order)
    head = {"format": vf.FORMAT, "version": vf.VERSION, "capture_point": capture_point, "dim": dim, "seed": seed}
    head["layers"] = list(order)
    try:
        manifest = vf.read_manifest(store.path, key)
    except StoreError as exc:
        _warn(f"{exc}; the index is rebuilt")
        manifest = None
    if manifest is None and not build:
        return None
    if manifest is not None and {k: manifest.get(k) for k in head} != head:
        manifest = None
    known = {str(p.get("shard")): p for p in (manifest or {}).get("parts", [])}
    selection = store.select(capture_point, layers=order)
    shard_rows: dict[str, list[int]] = {}
    for row, ref in zip(selection.batch_rows.tolist(), selection.refs):
        shard_rows.setdefault(ref.file.name, []).append(row)
    shards = tuple((shard, store.shard_sha256(shard)) for shard in shard_rows)
    cached = _OPENED.get((str(store.path), key))
    if (
        plan is None
        and manifest is not None
        and cached is not None
        and cached[0] == _signature(store, manifest, shards)
    ):
        cached[1].rebuilt = []
        return cached[1]  # nothing changed since it was opened in this process
    pieces, rebuilt, writable = [], [], True
    if build:
        vf.remove_temporaries(store.path)  # what a build killed mid-write left
    parts: list[dict[str, Any]] = []
    for shard, rows in shard_rows.items():
        sha, sub = store.shard_sha256(shard), replace(selection, batch_rows=np.asarray(rows, dtype=np.int64))
        entry: dict[str, Any] | None = known.get(shard)
        piece = _load_part(store, entry, head, shard, sha) if entry is not None else None
        if piece is None:
            ids, sketch = compute_sketches(sub, order, dim, seed, "concat", max_bytes)  # (n,), (n, L dim^2)
            lr = np.concatenate([np.full(ref.size, ref.lr_weight) for ref in sub.refs])  # (n,)
            piece = (ids, lr, sketch.numpy().astype(np.float32))
            name = f"part-{key}-{shard.removesuffix('.safetensors')}.safetensors"
            data = save_bytes(
                {"vector": torch.from_numpy(piece[2]), "sample_id": torch.from_numpy(ids), "lr": torch.from_numpy(lr)},
                metadata={**{k: str(v) for k, v in head.items()}, "shard": shard, "shard_sha256": sha},
            )
            entry = {"file": name, "shard": shard, "shard_sha256": sha, "rows": len(ids), "sha256": vf.sha256(data)}
            writable = writable and _write(store, name, data)
            rebuilt.append(name)
        pieces.append(piece)
        parts.append(entry or {})
    ids = np.concatenate([p[0] for p in pieces]) if pieces else np.zeros(0, np.int64)
    lr = np.concatenate([p[1] for p in pieces]) if pieces else np.zeros(0)
    width = len(order) * dim * dim
    vectors = np.concatenate([p[2] for p in pieces]) if pieces else np.zeros((0, width), np.float32)
    faiss, kept = load_faiss(), (manifest or {}).get("ann")
    if plan is None and isinstance(kept, dict) and kept.get("parts") == vf.parts_digest(parts):
        plan = Plan("ivf", int(kept.get("nlist", 0)), int(kept.get("nprobe", 0)))  # a plan asked for once, kept
    plan = plan or choose_plan(len(ids), width, faiss is not None)
    if faiss is None:
        plan = Plan()
    index = VectorIndex(capture_point, dim, ids, lr, vectors, plan, rebuilt=rebuilt)
    ann_entry = None
    if plan.kind == "ivf":
        ann_entry = _open_ann(store, index, key, parts, kept, faiss)
        writable = writable and ann_entry is not None
    new = {**head, "parts": parts, "ann": ann_entry}
    if writable and (rebuilt or new != manifest):
        writable = _write(store, vf.manifest_name(key), vf.encode_manifest(new))
    if writable:
        _OPENED.pop((str(store.path), key), None)
        _OPENED[(str(store.path), key)] = (_signature(store, new, shards), index)
        while len(_OPENED) > MAX_OPENED:
            _OPENED.pop(next(iter(_OPENED)))
    return index


#: Indexes opened in this process, reused while their manifest, shards and files are unchanged.
_OPENED: dict[tuple[str, str], tuple[Any, VectorIndex]] = {}
MAX_OPENED = 4


def _signature(store: StoreReader, manifest: dict[str, Any], shards: tuple[tuple[str, str], ...]) -> Any:
    """What an opened index depends on: its manifest, the shards' sha256, its files' identity (None: unknown)."""
    ann = manifest.get("ann")
    names = [str(p.get("file")) for p in manifest["parts"]] + ([str(ann.get("file"))] if isinstance(ann, dict) else [])
    files = vf.identities(store.path, names)
    return None if files is None else (vf.encode_manifest(manifest), shards, files)


def _load_part(
    store: StoreReader, entry: dict[str, Any], head: dict[str, Any], shard: str, sha: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """A part's ``(ids, lr, vectors)`` when it is current and sound, else None (said once when damaged)."""
    if entry.get("shard_sha256") != sha or not isinstance(entry.get("file"), str):
        return None  # stale: its shard changed
    rows = sum(ref.size for ref in store.batch_refs(head["capture_point"]) if ref.file.name == shard)
    width = len(head["layers"]) * head["dim"] ** 2
    try:
        data = vf.read_checked(
            store.path, entry["file"], str(entry.get("sha256")), rows * (4 * width + 16) + 4096, "part"
        )
        tensors = load_bytes(data)
    except (StoreError, ValueError, RuntimeError) as exc:
        _warn(f"{exc}; rebuilt from {shard}")
        return None
    vector, ids, lr = tensors.get("vector"), tensors.get("sample_id"), tensors.get("lr")
    if vector is None or ids is None or lr is None or tuple(vector.shape) != (rows, width) or ids.shape != (rows,):
        return None
    if vector.dtype != torch.float32 or ids.dtype != torch.int64 or lr.dtype != torch.float64 or lr.shape != (rows,):
        return None
    return ids.numpy(), lr.numpy(), vector.numpy()


def _open_ann(
    store: StoreReader, index: VectorIndex, key: str, parts: list[dict[str, Any]], entry: Any, faiss: Any
) -> dict[str, Any] | None:
    """Set ``index.ann``: the kept FAISS index when it was built over these parts with this plan, else a new one.
    Returns its manifest entry, or None when it could not be written (the index is then kept in memory)."""
    plan, digest = index.plan, vf.parts_digest(parts)
    wanted = {"kind": plan.kind, "metric": "l2-augmented", "nlist": plan.nlist, "nprobe": plan.nprobe}
    wanted["rows"] = len(index.sample_ids)
    if isinstance(entry, dict) and entry.get("parts") == digest and {k: entry.get(k) for k in wanted} == wanted:
        try:
            cap = index.vectors.nbytes + 64 * len(index.sample_ids) + (64 << 20)
            data = vf.read_checked(store.path, str(entry.get("file")), str(entry.get("sha256")), cap, "FAISS index")
            index.ann = faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
            return dict(entry)
        except StoreError as exc:
            _warn(f"{exc}; rebuilt")
    ann = index.ann = build_ivf(index.weighted(), plan, faiss)
    name = f"ann-{key}.faiss"
    data = faiss.serialize_index(ann).tobytes()
    index.rebuilt.append(name)
    if not _write(store, name, data):
        return None
    return {**wanted, "file": name, "sha256": vf.sha256(data), "parts": digest}


def _write(store: StoreReader, name: str, data: bytes) -> bool:
    try:
        vf.write(store.path, name, data)
    except (OSError, StoreError):  # read-only store, a link where the folder belongs: kept in memory
        return False
    return True


def _warn(message: str) -> None:
    warnings.warn(message.splitlines()[0] if message else message, stacklevel=3)


def build_vector_index(
    store: StoreReader,
    capture_point: str,
    *,
    dim: int | None = None,
    seed: int = 0,
    layers: Sequence[str] | None = None,
) -> VectorIndex:
    """Build (or bring up to date) and keep the capture point's index; later ``k=`` queries use it."""
    index = open_index(store, capture_point, dim=dim, seed=seed, layers=layers, build=True)
    assert index is not None  # build=True always gives one
    return index


def _test_sketches(
    store: StoreReader,
    capture_point: str,
    ids: Sequence[int] | None,
    index: VectorIndex,
    layers: Sequence[str],
    seed: int,
) -> tuple[np.ndarray, np.ndarray]:
    """``(sample ids (M,), sketches (M, D))`` of the query side, laid out as the index's vectors."""
    selection = store.select(capture_point, sample_ids=ids, layers=list(layers))
    found, sketch = compute_sketches(selection, list(layers), index.dim, seed, "concat", DEFAULT_MAX_BYTES)
    return found, sketch.numpy()


def projected_only(store: StoreReader, layers: Sequence[str]) -> bool:
    """Whether every stored record of these layers is ``projected``: then the index's vectors are the records."""
    record = store.index.record
    names = np.asarray(store.index.layer_names, dtype=object)
    mine = np.isin(names[record["layer"]], list(layers)) if len(record["layer"]) else np.zeros(0, bool)
    return bool(mine.any()) and bool(np.all(record["kind"][mine] == KIND_CODES.index("projected")))


def influence(
    store: StoreReader,
    train: str | Sequence[str],
    test: str | Sequence[str],
    *,
    k: int | None = None,
    index: bool | None = None,
    candidates: int | None = None,
    recompute: RecomputeFn | None = None,
    layers: Sequence[str] | None = None,
    train_ids: Sequence[int] | None = None,
    test_ids: Sequence[int] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Scores:
    """:func:`~metastore_plugins.core.analysis.queries.influence`; with ``k``, through the nearest-gradient index.

    ``k``: the rows ``.top(k)`` will show; the index then gives each test sample's ``candidates``
    (default ``max(4 k, 50)``) proponent and opponent candidates per pass, and only their union is
    scored (the result's rows): from the index's vectors where every record of the layers is
    projected (they are those records: the same estimates), from the shards otherwise. ``index``:
    ``None`` uses a kept index (brought up to date), ``True`` builds one when missing, ``False``
    scans every row. ``recompute``: exact refinement of the estimates
    (:func:`~metastore_plugins.core.analysis.refine.refine_influence`). ``train_ids`` scans every row.
    """
    full: Callable[..., Scores] = queries.influence
    if scan_of(store).partitioned and recompute is not None:
        raise ValueError("recompute= is not supported by partitioned queries; refine the result with refine_influence")
    if k is None or index is False or train_ids is not None or scan_of(store).partitioned:
        return full(store, train, test, layers=layers, train_ids=train_ids, test_ids=test_ids, max_bytes=max_bytes)
    count = candidates or max(4 * k, 50)
    order = sketch_layers(store, layers)
    found: set[int] = set()
    passes = []
    for train_cp, test_cp in queries.paired_points(train, test):
        opened = open_index(store, train_cp, layers=order, build=bool(index), max_bytes=max_bytes)
        if opened is None:
            return full(store, train, test, layers=layers, test_ids=test_ids, max_bytes=max_bytes)
        tested, sketch = _test_sketches(store, test_cp, test_ids, opened, order, 0)  # (M,), (M, D)
        rows = opened.search(np.concatenate([sketch, -sketch]), count)
        found.update(opened.sample_ids[rows[rows >= 0]].tolist())
        passes.append((opened, tested, sketch))
    if projected_only(store, order):
        row_parts, col_parts = [], []
        for opened, tested, sketch in passes:
            rows = np.flatnonzero(np.isin(opened.sample_ids, sorted(found)))  # (n,) every occurrence
            matrix = opened.weighted()[rows].astype(np.float64) @ sketch.astype(np.float64).T  # (n, M)
            row_parts.append((opened.sample_ids[rows], matrix))
            col_parts.append((tested, matrix))
        scores = queries.summed_scores(row_parts, col_parts)
    else:
        scores = full(
            store, train, test, layers=layers, train_ids=sorted(found), test_ids=test_ids, max_bytes=max_bytes
        )
    if recompute is not None:
        return refine_influence(store, scores, train, test, recompute)
    return scores


def similar(
    store: StoreReader,
    query: str,
    candidates: str,
    *,
    k: int | None = None,
    index: bool | None = None,
    count: int | None = None,
    query_ids: Sequence[int] | None = None,
    cosine: bool = True,
    layers: Sequence[str] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Scores:
    """:func:`~metastore_plugins.core.analysis.queries.similar`; with ``k``, only the ``count`` (default
    ``max(4 k, 50)``) most and least similar candidates per query by sketch (cosine, or inner product) are
    scored: a scan of the index's vectors, not of the shards."""

    def scan(found: Sequence[int] | None) -> Scores:
        return queries.similar(
            store,
            query,
            candidates,
            query_ids=query_ids,
            cosine=cosine,
            layers=layers,
            max_bytes=max_bytes,
            candidate_ids=found,
        )

    if k is None or index is False or scan_of(store).partitioned:
        return scan(None)
    order = sketch_layers(store, layers)
    opened = open_index(store, candidates, layers=order, build=bool(index), max_bytes=max_bytes)
    if opened is None:
        return scan(None)
    sketch = _test_sketches(store, query, query_ids, opened, order, 0)[1]  # (M, D)
    wanted = count or max(4 * k, 50)
    both = np.concatenate([sketch, -sketch])  # the most similar, and the least (what .top calls opponents)
    if cosine:
        rows = opened.search_cosine(both, wanted)
    else:
        rows = _largest(opened.vectors @ both.T, min(wanted, len(opened.sample_ids)))
    return scan(sorted(set(opened.sample_ids[rows.ravel()].tolist())))
