"""Influence through K-FAC / EK-FAC curvature fitted on the checkpoint passes' stored factors.

For each paired checkpoint pass ``c`` (train and test gradients at the same weights), the curvature
``F_c`` is fitted on that pass's training records (:mod:`metastore_plugins.core.ops.curvature`),
each test gradient is preconditioned, ``(F_c + delta I)^-1 g_test``, and scored against every
training gradient on its factors. Passes are summed with TracIn's learning-rate weights:
``sum_c lr_c g_train_i(w_c)^T (F_c + delta_c I)^-1 g_test_j(w_c)``. Under a partitioned scan every
rank adds the K-FAC sums of its shards to the others', one rank preconditions the test gradients
(the broadcast side), every rank scores its shards.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from metastore_plugins.core.analysis.per_batch import positive_number
from metastore_plugins.core.analysis.queries import Pair, scored_pairs, selected_pairs, whole
from metastore_plugins.core.analysis.results import Scores
from metastore_plugins.core.analysis.scan import LOCAL, ColumnBatch, Scan, scan_of
from metastore_plugins.core.errors import ConfigError
from metastore_plugins.core.ops import DEFAULT_MAX_BYTES
from metastore_plugins.core.ops.curvature import (
    CURVATURE_METHODS,
    DEFAULT_RELATIVE_DAMPING,
    CurvatureMethod,
    CurvatureSums,
    LayerCurvature,
    LayerSums,
    layer_groups,
)
from metastore_plugins.core.ops.curvature_rotated import EigenvalueCorrection
from metastore_plugins.core.ops.precondition import precondition
from metastore_plugins.core.store import Selection, StoreReader


def fit_curvature(
    selection: Selection,
    method: CurvatureMethod = "ekfac",
    max_bytes: int = DEFAULT_MAX_BYTES,
    scan: Scan = LOCAL,
    what: str = "curvature",
) -> dict[str, LayerCurvature]:
    """Per layer, the K-FAC (one read of the selection) or EK-FAC (two reads) curvature of its samples.

    Each process reads its part of the selection (``scan``, a read named ``what``); the sums are
    added over the processes before each fit, so every process fits the same curvature.
    """
    part = scan.part(selection, what)
    sums = CurvatureSums(token_basis=True)
    for batch in part.selection.batches():
        sums.add(batch.records)
    curvature = _added_sums(sums, scan, what).fit()
    if method == "ekfac":
        correction = EigenvalueCorrection(curvature)
        for batch in part.selection.batches():
            correction.add(batch.records, max_bytes)
        correction.sums = scan.sum(correction.sums, f"{what} (eigenvalues)")
        counts = scan.every(correction.samples, f"{what} (samples)")
        correction.samples = {layer: sum(c[layer] for c in counts) for layer in correction.samples}
        curvature = correction.fit()
    return curvature


def _added_sums(sums: CurvatureSums, scan: Scan, what: str) -> CurvatureSums:
    """Every process's K-FAC sums added (a layer some process saw no batch of counts as zero there)."""
    heads = scan.every(
        {
            layer: (s.params, s.layout, s.rows, s.factored_samples, s.dense_samples, s.block)
            for layer, s in sums.layers.items()
        },
        f"{what} (layers)",
    )
    kept = {
        (layer, name): getattr(s, name)
        for layer, s in sums.layers.items()
        for name in ("inputs", "outputs", "dense", "tokens")
    }
    tensors = scan.sum({f"{layer}\n{name}": t for (layer, name), t in kept.items() if t is not None}, what)
    out = CurvatureSums()
    for head in heads:
        for layer, (params, layout, rows, factored, dense, block) in head.items():
            added = out.layers.setdefault(layer, LayerSums(dict(params), layout=layout))
            added.rows, added.factored_samples = added.rows + rows, added.factored_samples + factored
            added.dense_samples, added.block = added.dense_samples + dense, block or added.block  # one basis on all
    for key, tensor in tensors.items():
        layer, name = key.split("\n")
        setattr(out.layers[layer], name, tensor)
    return out


def _preconditioned_chunks(
    cols: Selection,
    curvature: dict[str, LayerCurvature],
    damping: float | None,
    relative_damping: float,
    max_bytes: int,
) -> Iterator[list[ColumnBatch]]:
    """The column batches, preconditioned, grouped so that each group's dense gradients take about ``max_bytes``."""
    group: list[ColumnBatch] = []
    used = 0
    for batch in cols.batches():
        records = precondition(batch.records, curvature, damping, relative_damping, max_bytes)
        size = sum(r.nbytes for r in records)
        if group and used + size > max_bytes:
            yield group
            group, used = [], 0
        group.append((batch.size, records))
        used += size
    if group:
        yield group


def kfac_influence(
    store: StoreReader,
    train: str | Sequence[str],
    test: str | Sequence[str],
    *,
    method: CurvatureMethod = "ekfac",
    damping: float | None = None,
    relative_damping: float = DEFAULT_RELATIVE_DAMPING,
    max_bytes: int = DEFAULT_MAX_BYTES,
    layers: Sequence[str] | None = None,
    train_ids: Sequence[int] | None = None,
    test_ids: Sequence[int] | None = None,
) -> Scores:
    """Influence ``sum_c lr_c g_train_i(w_c)^T (F_c + delta I)^-1 g_test_j(w_c)`` with K-FAC or EK-FAC ``F_c``.

    Args:
        train, test: capture points paired in order, as :meth:`influence` pairs them; ``F_c`` is fitted
            on all of the train pass's samples (whatever ``train_ids``), ``lr_c`` is its batches' rate.
        method: ``"ekfac"`` (eigenvalues corrected to the per-sample gradients' second moments in the
            Kronecker eigenbasis; two reads of each train pass) or ``"kfac"`` (one read).
        damping: one absolute ``delta`` for every layer; by default each layer's is ``relative_damping``
            times the mean eigenvalue of its curvature (Kronfluence's rule, 0.1).
        layers: restrict to these layers (all by default: factored, embedding and dense layers).
        train_ids, test_ids: restrict the scored samples.

    Raises:
        ValueError: for an unknown method, a non-positive damping, or a layer K-FAC cannot fit.
    """
    if method not in CURVATURE_METHODS:
        raise ConfigError(f"method must be one of {CURVATURE_METHODS}, got {method!r}")
    positive_number("damping", damping)
    positive_number("relative_damping", relative_damping)

    pairs = selected_pairs(store, train, test, layers=layers, train_ids=train_ids, test_ids=test_ids)
    fitted_on = {cp: store.select(cp, layers=layers) for cp, _, _, _ in pairs}  # all of each train pass
    return preconditioned_scores(store, pairs, fitted_on, method, damping, relative_damping, max_bytes)


def preconditioned_scores(
    store: StoreReader,
    pairs: Sequence[Pair],
    fitted_on: dict[str, Selection],
    method: CurvatureMethod,
    damping: float | None,
    relative_damping: float,
    max_bytes: int = DEFAULT_MAX_BYTES,
    fitted: dict[str, dict[str, LayerCurvature]] | None = None,
) -> Scores:
    """``sum_p lr g_i^T (F_p + delta I)^-1 g_j`` over ``pairs``, ``F_p`` fitted on ``fitted_on[train label of p]``.

    A train label shared by several pairs is fitted once; every process fits the same curvature. ``fitted``: the
    curvatures already fitted, per train label (the nearest-gradient index's top-k fits once for its search).
    """
    scan = scan_of(store)
    curvatures = dict(fitted or {})
    for label, selection in fitted_on.items():
        if label not in curvatures:
            curvatures[label] = fit_curvature(selection, method, max_bytes, scan, f"curvature of {label!r}")

    def preconditioned(train_label: str, cols: Selection) -> Iterator[list[ColumnBatch]]:
        return _preconditioned_chunks(cols, curvatures[train_label], damping, relative_damping, max_bytes // 2)

    return whole(scored_pairs(store, pairs, columns=preconditioned, max_bytes=max_bytes))


def curvature_refusal(
    store: StoreReader, capture_points: Sequence[str], layers: Sequence[str] | None = None
) -> str | None:
    """Why K-FAC / EK-FAC cannot precondition these capture points (``None``: they can).

    The one check is :func:`~metastore_plugins.core.ops.curvature.layer_groups`, asked of one stored batch of
    each kind of records a capture point holds (of ``layers``; a capture policy may have lowered a pass part way,
    its later batches projected): what it refuses (projected or norms-only records, layers it cannot fit, tied
    weights) is the answer, in its own words. A point with batches kept as metadata only is refused too.
    """
    chosen = None if layers is None else tuple(layers)
    for point in capture_points:
        refs = store.batch_refs(point)
        bare = sum(not ref.info["records"] for ref in refs)
        if bare == len(refs):
            return f"{point!r} holds no per-sample records"
        if bare:
            return f"{point!r} holds {bare} batch(es) kept as metadata only (no per-sample records)"
        kinds = {tuple((r.get("layer"), r.get("kind")) for r in ref.info["records"]): ref for ref in refs}
        for ref in kinds.values():
            try:
                layer_groups(ref.read_records(chosen))
            except ValueError as exc:  # a RepresentationError is one too
                return f"{point!r}: {exc}"
    return None


def untied_layers(
    store: StoreReader, capture_points: Sequence[str], layers: Sequence[str] | None = None
) -> tuple[list[str], list[str]] | None:
    """``(kept, left_out)``: ``layers`` (every layer when ``None``, in the store's order) with each group of layers
    that share a parameter (tied weights: an embedding and its LM head) cut to one layer (an embedding where the
    group has one: a vocabulary-sized LM head would need a vocabulary-squared curvature factor; else the first),
    or ``None`` when no layers are tied. Read from one stored batch of the first capture point that holds records."""
    chosen = store.layers() if layers is None else list(layers)
    for point in capture_points:
        ref = next((ref for ref in store.batch_refs(point) if ref.info["records"]), None)
        if ref is None:
            continue
        owners: dict[str, set[str]] = {}
        kinds: dict[str, str] = {}
        for record in ref.read_records(tuple(chosen)):
            kinds[record.layer] = record.kind
            for name in record.params.values():
                owners.setdefault(name, set()).add(record.layer)

        order = {layer: (kind != "embedding", chosen.index(layer)) for layer, kind in kinds.items()}  # embedding first
        left_out = {
            layer for group in owners.values() if len(group) > 1 for layer in sorted(group, key=order.__getitem__)[1:]
        }
        if not left_out:
            return None
        return [layer for layer in chosen if layer not in left_out], [layer for layer in chosen if layer in left_out]
    return None


def preconditionable(store: StoreReader, capture_points: Sequence[str], layers: Sequence[str] | None = None) -> bool:
    """Whether K-FAC / EK-FAC can precondition every layer of these capture points (:func:`curvature_refusal`)."""
    return curvature_refusal(store, capture_points, layers) is None
