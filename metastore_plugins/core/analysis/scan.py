"""How a query reads a store: every batch in this process (:class:`Scan`), or this rank's shards (partitioned).

Each query of :mod:`metastore_plugins.core.analysis` is written once, over the scan its store holds
(``store.scan``; :data:`LOCAL` for a plain reader):

1. ``part = scan.part(selection, what)``: the batches this process reads (here: all of them);
2. the query computes on ``part.selection`` only, on ``scan.device``;
3. it combines: :meth:`Scan.gather` puts every process's rows back in selection order,
   :meth:`Scan.sum` adds partial sums, :meth:`Scan.every` lists each process's value,
   :meth:`Scan.first` is one value computed by one process alone, and :meth:`Scan.columns`
   is the column side of a product, read by one process and handed to all.

Here every combine step is the identity, so a query is its plain loop. The partitioned scan
(:class:`metastore_plugins.core.distributed.PartitionedScan`) splits selections by shard across the
ranks of a process group and makes each step a collective: results equal the one-process ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from metastore_plugins.core.records import LayerRecord
from metastore_plugins.core.store import Selection

T = TypeVar("T")

#: One stored batch of the column side of a product: its sample count and its records.
ColumnBatch = tuple[int, list[LayerRecord]]
Device = torch.device | str | None


@dataclass(frozen=True)
class Part:
    """One process's share of a selection.

    Attributes:
        selection: the batches it reads, in selection order (rows keep their filter).
        positions: ``(n,)`` where each of its sample occurrences stands in the whole selection.
        total: ``N``, the whole selection's sample occurrences.
        owners: ``(N,)`` the process that reads each occurrence (``None``: this one reads all).
    """

    selection: Selection
    positions: np.ndarray
    total: int
    owners: np.ndarray | None = None


class Scan:
    """The local scan: this process reads every batch, and every combine step is the identity.

    Attributes:
        device: where the ops of a query run (``None``: where the records are read, the CPU).
    """

    #: whether the batches are split across processes (then top-k through an index scores every row instead)
    partitioned = False

    def __init__(self, device: Device = None) -> None:
        self.device = device

    @property
    def leader(self) -> bool:
        """Whether this process writes what the query keeps (a cache file): the one, or rank 0."""
        return True

    def part(self, selection: Selection, what: str) -> Part:
        """The batches of ``selection`` this process reads (a query named ``what``)."""
        return Part(selection, np.arange(len(selection)), len(selection))

    def gather(self, block: np.ndarray, part: Part, what: str) -> np.ndarray:
        """Every process's ``(n, ...)`` rows of ``part`` put back in selection order: ``(N, ...)``."""
        return block

    def gather_on(self, block: np.ndarray, part: Part, what: str, dst: int | None) -> np.ndarray | None:
        """:meth:`gather` on process ``dst`` only (``None`` elsewhere); ``dst=None``: on every process."""
        return block

    def columns(
        self, read: Callable[[], Iterable[Sequence[ColumnBatch]]], what: str
    ) -> Iterator[Sequence[ColumnBatch]]:
        """The column chunks ``read()`` yields, read by one process and handed to every one."""
        return iter(read())

    def first(self, compute: Callable[[], T], what: str) -> T:
        """``compute()`` run by one process, its value on every process."""
        return compute()

    def every(self, value: T, what: str) -> list[T]:
        """Every process's (small, picklable) ``value``, in process order."""
        return [value]

    def sum(self, tensors: dict[str, Tensor], what: str) -> dict[str, Tensor]:
        """Named partial sums added over the processes (a name one process lacks counts as zero)."""
        return tensors


#: The scan of a store that is not partitioned.
LOCAL = Scan()


def scan_of(store: Any) -> Scan:
    """The scan ``store`` holds (``store.scan``), else :data:`LOCAL`."""
    scan = getattr(store, "scan", None)
    return scan if isinstance(scan, Scan) else LOCAL


def chunked(selection: Selection, max_bytes: int) -> Iterator[list[ColumnBatch]]:
    """A selection's batches as column chunks of about ``max_bytes / 2`` of records each."""
    return ([(b.size, b.records) for b in chunk] for chunk in selection.chunks(max_bytes // 2))
