"""``open_store`` and ``GradientStore``: a store's reader with every query as a method.

Example::

    store = open_store("runs/demo/store")
    store.capture_points()                      # ['epoch-0/train', 'epoch-0/val', 'train']
    ids = store.sample_ids("epoch-0/val")       # aligned with every per-sample result
    scores = store.influence("epoch-0/train", "epoch-0/val")
    every = store.influence(test=["epoch-0/val", "epoch-1/val"], method="auto")  # every training sample
    grads = store.restore(ids[0], capture_point="epoch-0/val", layer="classifier")
    records = store.recompute(model, val_set, [3, 17], snapshot="epoch-0")  # exact, at the pass's weights
    assert store.verify() == []
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from torch import Tensor, nn

from metastore_plugins.core.analysis import (
    curvature,
    default_answer,
    dynamics,
    in_run,
    methods,
    queries,
    sequence_influence,
    vector_index,
)
from metastore_plugins.core.analysis import sketches as sketch_queries
from metastore_plugins.core.analysis.scan import LOCAL, Scan
from metastore_plugins.core.errors import RepresentationError
from metastore_plugins.core.model import recompute as recompute_module
from metastore_plugins.core.records import LayerRecord
from metastore_plugins.core.store import StoreReader, find_store_dir
from metastore_plugins.core.store.shards.journal_batch import gc_paused
from metastore_plugins.core.store.snapshots.weights import list_snapshots
from metastore_plugins.core.store.tags.tag_cache import find_columns
from metastore_plugins.core.store.writing.run_log import noted_once


class GradientStore(StoreReader):
    """A :class:`~metastore_plugins.core.store.StoreReader` that also answers queries.

    Each query is a function of :mod:`.queries`, :mod:`.dynamics`, :mod:`.sketches` or :mod:`.methods`
    whose first argument is the store; here it is bound as a method, with the same signature and
    docstring (``store.influence(...)`` is ``methods.influence(store, ...)``: one ``method=`` for
    TracIn, K-FAC, EK-FAC and TRAK). Each reads the store through :attr:`scan` (:mod:`.scan`).
    """

    #: how queries read the store: every batch here (a ``DistributedStore``: this rank's shards)
    scan: Scan = LOCAL
    # norms; influence and self-influence by method= (TracIn with k=: top-k candidates from the
    # nearest-gradient index); similarity. Each warns at most once that the store is incomplete (noted_once).
    norms = noted_once(queries.norms)
    self_influence = noted_once(methods.self_influence)
    self_influence_ids = noted_once(queries.self_influence_ids)
    influence = noted_once(default_answer.influence)  # methods.influence; train left out: the default answer
    similar = noted_once(methods.similar)
    in_run_influence = noted_once(in_run.in_run_influence)
    influence_of_sequences = noted_once(sequence_influence.influence_of_sequences)
    # training dynamics
    batch_gradient = noted_once(dynamics.batch_gradient)
    changed_most = noted_once(dynamics.changed_most)
    top_contributors = noted_once(dynamics.top_contributors)
    exceed_fractions = noted_once(dynamics.exceed_fractions)
    spikes = noted_once(dynamics.spikes)
    compare = noted_once(dynamics.compare)
    # sketches, curvature, the index
    sketches = noted_once(sketch_queries.sketches)
    build_sketches = noted_once(sketch_queries.build_sketches)
    clusters = noted_once(sketch_queries.clusters)
    sketched_influence = noted_once(sketch_queries.sketched_influence)
    kernel_influence = noted_once(sketch_queries.kernel_influence)
    kfac_influence = noted_once(curvature.kfac_influence)
    build_vector_index = noted_once(vector_index.build_vector_index)

    def recompute(
        self, model: nn.Module, dataset: Any, sample_ids: Sequence[int], *, snapshot: str | None, **options: Any
    ) -> list[LayerRecord]:
        """Exact records of ``dataset[i]`` for ``i`` in ``sample_ids``, at this store's weight snapshot ``snapshot``.

        :func:`~metastore_plugins.core.model.recompute.recompute` with ``store_dir`` this store
        (``options``: its keyword arguments: ``rank``, ``loss_fn``, ``collate_fn``, ``batch_size``, ...).
        ``snapshot=None`` takes the model's live weights. What a projected or norms-only layer
        cannot give back (:meth:`restore`, exact dots), this gives exactly.
        """
        return recompute_module.recompute(model, dataset, sample_ids, store_dir=self.path, snapshot=snapshot, **options)

    def restore(
        self, sample_id: int, *, capture_point: str | None = None, step: int | None = None, layer: str | None = None
    ) -> dict[str, Tensor]:
        """:meth:`StoreReader.restore <metastore_plugins.core.store.StoreReader.restore>`; a layer kept projected or
        as norms raises a ``RepresentationError`` naming the :meth:`recompute` call that gives it exactly."""
        try:
            return super().restore(sample_id, capture_point=capture_point, step=step, layer=layer)
        except RepresentationError as exc:
            raise RepresentationError(f"{exc}: {self._recompute_call(sample_id, capture_point, step)}") from None

    def _recompute_call(self, sample_id: int, capture_point: str | None, step: int | None) -> str:
        """How to get the sample's exact gradient: the :meth:`recompute` call, with the snapshot of its pass."""
        snapshots = list_snapshots(self.path)
        prefix = (capture_point or "").split("/")[0]
        named = [s.name for s in snapshots if s.name == prefix or (step is not None and s.step == step)]
        snapshot = (
            repr(named[0])
            if named
            else "NAME" + (f" (one of {sorted({s.name for s in snapshots})})" if snapshots else "")
        )
        return (
            f"open_store(RUN).recompute(model, dataset, [{sample_id}], snapshot={snapshot}) in Python "
            "(the command line has no model to run)"
        )

    def find(self, tag: str | None = None, **attributes: Any) -> list[dict[str, Any]]:
        """The tagged moments named ``tag`` (any when None) whose attributes include ``attributes``.

        Each: the tag's ``name``, ``steps`` ``(first, last)``, ``keep``, ``attributes``, ``automatic``,
        ``rank``, the ``capture_points`` holding batches at those steps, and the weight ``snapshots``
        taken there (names).
        """
        tags = find_columns(self.path, tag, attributes)  # the tag cache's columns, the lines after them parsed
        first, last = np.array(tags["first_step"], np.int64), np.array(tags["last_step"], np.int64)  # (T,) each
        held_at = {}  # capture point -> (T,) whether it holds batches at the tag's steps: sorted-array lookups
        for cp in self.capture_points():
            held = np.asarray(self.steps(cp))
            held_at[cp] = (np.searchsorted(held, first) < np.searchsorted(held, last, side="right")).tolist()
        snapshots = list_snapshots(self.path)
        rank = np.array(tags["rank"], np.int64)  # (T,)
        taken: dict[int, list[str]] = {}  # each tag's snapshots (none: left out): its rank's, at its steps
        for r in {s.rank for s in snapshots}:
            order = sorted((i for i, s in enumerate(snapshots) if s.rank == r), key=lambda i: snapshots[i].step)
            steps = np.array([snapshots[i].step for i in order], dtype=np.int64)  # (S_r,) sorted
            lo, hi = np.searchsorted(steps, first), np.searchsorted(steps, last, side="right")  # (T,) each
            for i in np.flatnonzero((rank == r) & (lo < hi)).tolist():
                taken[i] = [snapshots[j].name for j in sorted(order[lo[i] : hi[i]])]  # in list_snapshots' order
        found = []
        with gc_paused():  # a million dicts: the cyclic collector would walk them again and again
            fields = zip(tags["name"], first.tolist(), last.tolist(), tags["keep"], tags["attributes"],
                         tags["automatic"], tags["rank"], tags["capture_point"])  # fmt: skip
            for i, (name, a, b, keep, values, automatic, r, point) in enumerate(fields):
                found.append(
                    {
                        "name": name,
                        "steps": (a, b),
                        "keep": keep,
                        "attributes": dict(values),
                        "automatic": automatic,
                        "rank": r,
                        "capture_points": [cp for cp, hit in held_at.items() if hit[i] and point in (None, cp)],
                        "snapshots": taken.get(i, []),
                    }
                )
        return found


def open_store(path: str | os.PathLike[str], *, checksums: bool = True) -> GradientStore:
    """Open a run's gradient store (the directory holding ``manifest-rank*.json``).

    A run directory whose ``store/`` subdirectory holds the manifests is accepted too.
    ``checksums=False`` skips the sha256 check of each shard on its first read (sizes are
    still checked).
    """
    return GradientStore(find_store_dir(path), checksums=checksums)
