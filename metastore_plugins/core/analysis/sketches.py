"""Sketch queries of a store: Kronecker sketches, kept on disk once computed, and what uses them.

``<sketch_i, sketch_j>`` estimates ``<g_i, g_j>`` without bias (error in
:mod:`metastore_plugins.core.ops.sketch`). Summed sketches of a whole capture point are
cached under ``<store>/sketches/`` (:mod:`~metastore_plugins.core.store.vectors.sketch_cache`), so
that sketched influence costs one ``(N, k) x (k, M)`` product once they are built.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from metastore_plugins.core import ops
from metastore_plugins.core.analysis.per_batch import positive_int, positive_number
from metastore_plugins.core.analysis.queries import influence, on_device, paired_points, summed_scores
from metastore_plugins.core.analysis.results import Clusters, Scores
from metastore_plugins.core.analysis.scan import Scan, scan_of
from metastore_plugins.core.errors import ConfigError, RepresentationError
from metastore_plugins.core.ops import DEFAULT_MAX_BYTES
from metastore_plugins.core.ops.leverage import kernel_solve
from metastore_plugins.core.store import Selection, StoreReader
from metastore_plugins.core.store.vectors import sketch_cache

Combine = Literal["sum", "concat"]
#: the kernel's ridge when none is given: this fraction of the mean eigenvalue of ``S^T S`` (:func:`kernel_influence`)
DEFAULT_REGULARIZATION = 1.0


def compute_sketches(
    selection: Selection,
    order: Sequence[str],
    dim: int,
    seed: int,
    combine: Combine,
    max_bytes: int,
    device: torch.device | str | None = None,
    *,
    scan: Scan | None = None,
    what: str = "sketches",
) -> tuple[np.ndarray, Tensor]:
    """``(sample ids (N,), sketches)`` of a selection: ``(N, dim^2)`` summed, or ``(N, L dim^2)`` side by side.

    The projections are drawn once for the pass (:class:`~metastore_plugins.core.ops.Projections`,
    on the CPU, then moved: the same on every device); each batch is sketched on its own
    (on ``device`` when given), so a sample's sketch does not depend on the other batches.
    With ``scan``, each process sketches its part (on ``scan.device``) and the rows are gathered
    (a read named ``what``).
    """
    if scan is not None:
        part = scan.part(selection, what)
        local = compute_sketches(part.selection, order, dim, seed, combine, max_bytes, scan.device)[1]  # (n, width)
        return selection.sample_ids(), torch.from_numpy(scan.gather(local.numpy(), part, what))  # (N,), (N, width)
    k, draw = dim * dim, ops.Projections()
    ids, parts = [], []
    for batch in selection.batches():
        block = torch.zeros(batch.size, 1 if combine == "sum" else len(order), k)  # (B, 1 or L, k)
        for record in on_device(batch.records, device):
            slot = 0 if combine == "sum" else order.index(record.layer)
            block[:, slot] += ops.sketch(record, dim, dim, seed, max_bytes=max_bytes, projections=draw).cpu()  # (B, k)
        parts.append(block.reshape(batch.size, -1))
        ids.append(batch.meta["sample_id"].numpy())
    width = k if combine == "sum" else len(order) * k
    if not parts:
        return np.zeros(0, dtype=np.int64), torch.zeros(0, width)
    return np.concatenate(ids), torch.cat(parts)


def check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ConfigError(f"seed must be an integer, got {seed!r}")
    return int(seed)


def sketch_layers(store: StoreReader, layers: Sequence[str] | str | None) -> list[str]:
    order = list(store.layers()) if layers is None else ([layers] if isinstance(layers, str) else list(layers))
    store.check_layers(order)
    return order


def sketch_key(
    store: StoreReader, capture_point: str, dim: int, seed: int, layers: Sequence[str]
) -> sketch_cache.SketchKey:
    refs = store.batch_refs(capture_point)
    batches = [(ref.file.name, ref.batch, store.shard_sha256(ref.file.name)) for ref in refs]
    return sketch_cache.SketchKey(
        capture_point, dim, seed, tuple(sorted(set(layers))), sketch_cache.binding(batches), sum(r.size for r in refs)
    )


def _summed_sketches(
    store: StoreReader,
    capture_point: str,
    dim: int,
    seed: int,
    layers: Sequence[str] | str | None,
    cache: bool,
    max_bytes: int,
    scan: Scan,
) -> tuple[np.ndarray, Tensor]:
    """``(sample ids (N,), summed sketches (N, dim^2) float32)`` of a whole capture point, from the cache if sound.

    One process reads the cache (its value handed to all), or writes it once the sketches are gathered.
    """
    order = sketch_layers(store, layers)
    key = sketch_key(store, capture_point, dim, seed, order) if cache else None
    found = scan.first(lambda: sketch_cache.load(store.path, key) if key is not None else None, "sketches: the cache")
    if found is not None:
        return found
    selection, what = store.select(capture_point, layers=order), f"sketches of {capture_point!r}"
    ids, summed = compute_sketches(selection, order, dim, seed, "sum", max_bytes, scan=scan, what=what)
    if key is not None and scan.leader:
        sketch_cache.save(store.path, key, ids, summed)
    return ids, summed


def sketches(
    store: StoreReader,
    capture_point: str,
    dim: int = 16,
    seed: int = 0,
    layers: Sequence[str] | None = None,
    *,
    combine: Combine = "sum",
    cache: bool = True,
    max_bytes: int = DEFAULT_MAX_BYTES,
    scan: Scan | None = None,
    **where: Any,
) -> np.ndarray:
    """Kronecker sketches of per-sample gradients, aligned with ``sample_ids(capture_point, **where)``.

    Each layer's sketch has ``k = dim * dim`` entries (``P_out G P_in^T`` with ``dim x dim``
    Gaussian projections, see :mod:`metastore_plugins.core.ops.sketch`). ``combine="sum"``
    adds the layers' sketches: ``(N, k)``; ``"concat"`` puts them side by side in the order
    of ``layers`` (``store.layers()`` by default): ``(N, L k)``. Both give unbiased
    estimates of whole-model inner products.

    Summed sketches of a whole capture point (no ``where``) are read from, or written to,
    the store's sketch cache unless ``cache=False`` (see :meth:`build_sketches`).
    """
    dim, seed, scan = positive_int("dim", dim), check_seed(seed), scan or scan_of(store)
    if combine not in ("sum", "concat"):
        raise ConfigError(f"combine must be 'sum' or 'concat', got {combine!r}")
    where = {name: value for name, value in where.items() if value is not None}
    if combine == "sum" and not where:
        return _summed_sketches(store, capture_point, dim, seed, layers, cache, max_bytes, scan)[1].double().numpy()
    order = sketch_layers(store, layers)
    selection = store.select(capture_point, layers=order, **where)
    what = f"sketches of {capture_point!r}"
    return compute_sketches(selection, order, dim, seed, combine, max_bytes, scan=scan, what=what)[1].double().numpy()


def build_sketches(
    store: StoreReader,
    capture_point: str,
    dim: int = 64,
    seed: int = 0,
    layers: Sequence[str] | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Path | None:
    """Compute the summed sketches of a capture point once and keep them in ``<store>/sketches/``.

    Later :meth:`sketches` and :meth:`sketched_influence` calls with the same capture point,
    ``dim``, ``seed`` and layer set read them instead of the shards, until the capture
    point's shards change (then they are recomputed). A sound cache file is kept as it is.

    Returns:
        The cache file, or ``None`` when the store cannot be written (queries then compute
        the sketches each time, without error).
    """
    dim, seed, order = positive_int("dim", dim), check_seed(seed), sketch_layers(store, layers)
    _summed_sketches(store, capture_point, dim, seed, order, True, max_bytes, scan_of(store))
    path = sketch_cache.cache_path(store.path, sketch_key(store, capture_point, dim, seed, order))
    return path if path.is_file() else None


def sketched_influence(
    store: StoreReader,
    train: str | Sequence[str],
    test: str | Sequence[str],
    *,
    dim: int = 64,
    seed: int = 0,
    layers: Sequence[str] | None = None,
    cache: bool = True,
) -> Scores:
    """TracIn on Kronecker sketches (``dim * dim`` numbers per sample): fast, unbiased, approximate.

    ``sum_c lr_c <sketch_i, sketch_j>`` estimates the exact :meth:`influence` without bias
    (``docs/queries.md`` gives its error); capture points pair and ``lr_c`` is taken as in
    :meth:`influence`. Sketches come from the cache (built on first use) unless ``cache=False``.

    Where the sketch cannot compress (no captured parameter of ``layers`` has more than ``dim * dim``
    entries, a small MLP at the default 64 x 64), the exact :meth:`influence` is cheaper and is returned.
    """
    dim, seed = positive_int("dim", dim), check_seed(seed)
    if not sketch_compresses(store, sketch_layers(store, layers), dim):
        return influence(store, train, test, layers=layers)
    return _sketch_scores(store, train, test, dim, seed, layers, cache, lambda s, t: t.T)


def _sketch_scores(
    store: StoreReader,
    train: str | Sequence[str],
    test: str | Sequence[str],
    dim: int,
    seed: int,
    layers: Sequence[str] | None,
    cache: bool,
    against: Callable[[Tensor, Tensor], Tensor],
) -> Scores:
    """``sum_c (lr_c S_c) X_c`` over paired passes, ``X_c = against(S_c, T_c)`` ``(k, M)`` from the summed
    sketches ``S_c`` ``(N, k)`` of the train pass and ``T_c`` ``(M, k)`` of the test pass (float64)."""
    row_parts, col_parts, scan = [], [], scan_of(store)
    for train_cp, test_cp in paired_points(train, test):
        same_projection(store, train_cp, test_cp, layers)
        row_ids, rows = _summed_sketches(store, train_cp, dim, seed, layers, cache, DEFAULT_MAX_BYTES, scan)  # (N, k)
        col_ids, cols = _summed_sketches(store, test_cp, dim, seed, layers, cache, DEFAULT_MAX_BYTES, scan)  # (M, k)
        s = rows.double()  # (N, k)
        lr = torch.from_numpy(_learning_rates(store, train_cp))  # (N,)
        matrix = ((lr[:, None] * s) @ against(s, cols.double())).numpy()  # (N, M)
        row_parts.append((row_ids, matrix))
        col_parts.append((col_ids, matrix))
    return summed_scores(row_parts, col_parts)


def kept_bases(store: StoreReader, capture_point: str, layers: Sequence[str] | None) -> dict[str, int | None]:
    """Layer -> the curvature eigenbasis its first stored batch of ``capture_point`` is projected on (None: none)."""
    batch = next(iter(store.select(capture_point, layers=layers).batches()), None)
    return {} if batch is None else {r.layer: r.basis for r in batch.records}


def same_projection(store: StoreReader, train: str, test: str, layers: Sequence[str] | None) -> None:
    """Raise unless both capture points keep each layer on the same projection: a pass projected on a curvature
    eigenbasis is its own sketch, which only the passes of its checkpoint share."""
    a, b = kept_bases(store, train, layers), kept_bases(store, test, layers)
    for layer in sorted(set(a) & set(b)):
        if a[layer] != b[layer]:
            raise RepresentationError(
                f"layer '{layer}' is kept on the curvature eigenbasis of step {a[layer]} in {train!r} and of step "
                f"{b[layer]} in {test!r} (None: seeded or exact): their sketches do not compare; pair passes of "
                "one checkpoint"
            )


def sketch_compresses(store: StoreReader, layers: Sequence[str], dim: int) -> bool:
    """Whether a ``dim x dim`` sketch is smaller than some captured parameter of ``layers`` (else exact is cheaper)."""
    shapes = [shape for layer in layers for shape in store.layer_info(layer).get("param_shapes", {}).values()]
    return not shapes or any(math.prod(shape) > dim * dim for shape in shapes)


def kernel_influence(
    store: StoreReader,
    train: str | Sequence[str],
    test: str | Sequence[str],
    *,
    layers: Sequence[str] | None = None,
    dim: int = 32,
    seed: int = 0,
    regularization: float = DEFAULT_REGULARIZATION,
    cache: bool = True,
) -> Scores:
    """TracIn through a kernel inverse on Kronecker sketches (TRAK's estimator, on the loss gradients).

    Per paired checkpoint pass ``c``, with ``S_c`` the ``(N, k)`` sketches of the training samples and
    ``T_c`` the ``(M, k)`` sketches of the test samples (``k = dim^2``, as :meth:`sketched_influence`):
    ``sum_c lr_c S_c (S_c^T S_c + lambda_c I)^-1 T_c^T``, with the ridge ``lambda_c = regularization *
    tr(S_c^T S_c) / k`` relative to the mean eigenvalue. Where plain TracIn credits every similar
    training sample with the same effect, the inverse shares it out between them (its LDS: the
    ``metastore_bench.quality.lds`` harness). Costs one ``(k, k)`` solve per pass.
    """
    dim, seed = positive_int("dim", dim), check_seed(seed)
    ridge = positive_number("regularization", regularization)
    return _sketch_scores(store, train, test, dim, seed, layers, cache, partial(kernel_solve, regularization=ridge))


def _learning_rates(store: StoreReader, capture_point: str) -> np.ndarray:
    """``(N,)`` the learning rate recorded with each sample's batch (1 where none was), from the manifests."""
    refs = store.batch_refs(capture_point)
    return np.concatenate([np.full(ref.size, ref.lr_weight) for ref in refs])


def clusters(
    store: StoreReader,
    capture_point: str,
    k: int,
    *,
    layers: Sequence[str] | None = None,
    dim: int = 16,
    seed: int = 0,
    iters: int = 50,
    **where: Any,
) -> Clusters:
    """k-means (:func:`~metastore_plugins.core.ops.kmeans`, seeded) on :meth:`sketches`."""
    points = sketches(store, capture_point, dim, seed, layers, **where)
    result = ops.kmeans(torch.from_numpy(points), positive_int("k", k), seed=seed, iters=iters)
    ids = store.sample_ids(capture_point, **where)
    return Clusters(ids, result.labels.numpy(), result.centroids.numpy(), result.inertia)
