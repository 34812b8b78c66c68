"""The report pass on every rank of a process group: which rank writes, and what every rank agrees on first.

A report built from a :class:`~metastore_plugins.core.distributed.DistributedStore` runs on every
rank of its group: its scanning queries (self-influence, influence, norms, sketches) are collectives
that split the scoring by shard, and rank 0 alone writes files and TensorBoard events. Every rank
makes the same queries in the same order (:func:`~metastore_plugins.core.reports.tensorboard.report_run`
says which). A plain store is one process, which writes. See docs/distributed.md.
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

from metastore_plugins.core.analysis import GradientStore, open_store
from metastore_plugins.core.distributed import DistributedStore, open_distributed_store
from metastore_plugins.core.process_group import world_size

T = TypeVar("T")


def distributed() -> bool:
    """Whether a ``torch.distributed`` process group of more than one rank is initialised."""
    return world_size() > 1


def report_store(path: str | os.PathLike[str]) -> GradientStore:
    """The store a report pass reads: partitioned over the default group when one of several ranks is up."""
    return open_distributed_store(path) if distributed() else open_store(path)


def writes(store: GradientStore) -> bool:
    """Whether this process writes the reports of ``store``: rank 0 of a partitioned store's group, or the one."""
    return store.scan.leader


def agreed(store: GradientStore, value: T, what: str) -> T:
    """Rank 0's ``value`` on every rank of a partitioned store's group (a collective); ``value`` otherwise."""
    return store.scan.first(lambda: value, what)


def share_of(store: GradientStore, since: int = 0) -> dict[str, Any] | None:
    """What this rank scored in the partitioned queries since ``since`` (an index into ``store.shares``).

    ``{"rank", "world", "rows", "total", "queries": [{"query", "rows", "total"}]}``: ``rows`` of the
    ``total`` sample occurrences the queries scored; over the ranks, ``rows`` add up to ``total``.
    ``None`` for a plain store.
    """
    if not isinstance(store, DistributedStore):
        return None
    shares = store.shares[since:]
    return {
        "rank": store.rank,
        "world": world_size(store.group),
        "rows": sum(s.rows for s in shares),
        "total": sum(s.total for s in shares),
        "queries": [{"query": s.query, "rows": s.rows, "total": s.total} for s in shares],
    }
