"""``open_store`` and ``GradientStore``: a store's reader with every query as a method.

Example::

    store = open_store("runs/demo/store")
    store.capture_points()                      # ['epoch-0/train', 'epoch-0/val', 'train']
    ids = store.sample_ids("epoch-0/val")       # aligned with every per-sample result
    scores = store.influence("epoch-0/train", "epoch-0/val")
    grads = store.restore(ids[0], capture_point="epoch-0/val", layer="classifier")
    assert store.verify() == []
"""

from __future__ import annotations

import os
from typing import Any

from metastore_plugins.core.analysis import dynamics, queries
from metastore_plugins.core.analysis import sketches as sketch_queries
from metastore_plugins.core.policy.tags import find_tags, read_tags
from metastore_plugins.core.store import StoreReader, find_store_dir
from metastore_plugins.core.store.snapshots import list_snapshots


class GradientStore(StoreReader):
    """A :class:`~metastore_plugins.core.store.StoreReader` that also answers queries.

    Each query is a function of :mod:`.queries`, :mod:`.dynamics` or :mod:`.sketches` whose
    first argument is the store; here it is bound as a method, with the same signature and
    docstring (``store.influence(...)`` is ``queries.influence(store, ...)``).
    """

    # norms, influence, similarity
    norms = queries.norms
    self_influence = queries.self_influence
    self_influence_ids = queries.self_influence_ids
    influence = queries.influence
    in_run_influence = queries.in_run_influence
    similar = queries.similar
    # training dynamics
    batch_gradient = dynamics.batch_gradient
    changed_most = dynamics.changed_most
    top_contributors = dynamics.top_contributors
    exceed_fractions = dynamics.exceed_fractions
    spikes = dynamics.spikes
    compare = dynamics.compare
    # sketches
    sketches = sketch_queries.sketches
    build_sketches = sketch_queries.build_sketches
    sketched_influence = sketch_queries.sketched_influence
    kernel_influence = sketch_queries.kernel_influence
    clusters = sketch_queries.clusters

    def find(self, tag: str | None = None, **attributes: Any) -> list[dict[str, Any]]:
        """The tagged moments named ``tag`` (any when None) whose attributes include ``attributes``.

        Each: the tag's ``name``, ``steps`` ``(first, last)``, ``keep``, ``attributes``, ``automatic``,
        ``rank``, the ``capture_points`` holding batches at those steps, and the weight ``snapshots``
        taken there (names).
        """
        snapshots = list_snapshots(self.path)
        found = []
        for t in find_tags(read_tags(self.path), tag, **attributes):
            points = [
                cp for cp in self.capture_points() if any(t.first_step <= s <= t.last_step for s in self.steps(cp))
            ]
            if t.capture_point is not None:
                points = [cp for cp in points if cp == t.capture_point]
            names = [s.name for s in snapshots if t.first_step <= s.step <= t.last_step and s.rank == t.rank]
            found.append(
                {
                    "name": t.name,
                    "steps": (t.first_step, t.last_step),
                    "keep": t.keep,
                    "attributes": dict(t.attributes),
                    "automatic": t.automatic,
                    "rank": t.rank,
                    "capture_points": points,
                    "snapshots": names,
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
