"""``DistributedStore``: a ``GradientStore`` whose queries read through a partitioned scan of a process group.

Code written against a store (the report tables, the ``metastore`` command) runs partitioned
unchanged when it is handed one: every query (``store.influence(...)``, ``store.self_influence(...)``,
``store.norms(...)``, ``store.similar(...)``, the sketches, the training-dynamics queries,
``store.in_run_influence(...)``, ...) is the :class:`~metastore_plugins.core.analysis.GradientStore`
query read through a :class:`~.scan.PartitionedScan`, returning the full result on every rank.
Every rank must make the same calls in the same order.

Example (under ``torchrun --nproc-per-node 2 script.py``)::

    init_from_env()                              # gloo on CPU, NCCL when CUDA is there
    store = open_distributed_store("runs/demo")  # every rank opens the same store
    scores = store.influence("epoch-1/train", "epoch-1/val")  # each rank reads its shards only
    if rank_of() == 0:
        print(scores.top(5))
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

import torch

from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.distributed.partition import Share
from metastore_plugins.core.distributed.scan import PartitionedScan
from metastore_plugins.core.process_group import rank_of
from metastore_plugins.core.store import find_store_dir

T = TypeVar("T")

__all__ = ["DistributedStore", "open_distributed_store", "rank_of"]


class DistributedStore(GradientStore):
    """A :class:`~metastore_plugins.core.analysis.GradientStore` whose scans are split across ``group``'s ranks.

    Top-k queries (``k=``) score every row (each rank its shards) instead of the nearest-gradient
    index's candidates; ``recompute=`` is refused (refine with ``refine_influence``).

    Args:
        path: the store (or run) directory; every rank opens the same one.
        group: the ``torch.distributed`` process group (the default one when ``None``).
        device: where ops run (the local GPU under NCCL by default, else the CPU).
        checksums: as :func:`~metastore_plugins.core.analysis.open_store`.

    Attributes:
        scan: the :class:`~.scan.PartitionedScan` every query reads through.
        shares: what this rank scored, one :class:`~.partition.Share` per partitioned query, in call order.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        group: Any = None,
        device: torch.device | str | None = None,
        checksums: bool = True,
    ) -> None:
        super().__init__(path, checksums=checksums)
        self.group, self.device = group, device
        scan = PartitionedScan(group, device)
        self.scan = scan
        self.shares: list[Share] = scan.shares

    @property
    def rank(self) -> int:
        """This process's rank in the group (0 without a process group)."""
        return rank_of(self.group)

    def from_rank_zero(self, value: T, what: str) -> T:
        """Rank 0's ``value`` (small, picklable) on every rank: a collective, named ``what`` in its errors."""
        return self.scan.first(lambda: value, what)


def open_distributed_store(
    path: str | os.PathLike[str],
    *,
    group: Any = None,
    device: torch.device | str | None = None,
    checksums: bool = True,
) -> DistributedStore:
    """Open a store on every rank of ``group``; its queries run partitioned (:class:`DistributedStore`)."""
    return DistributedStore(find_store_dir(path), group=group, device=device, checksums=checksums)
