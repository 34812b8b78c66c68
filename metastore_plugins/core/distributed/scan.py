"""``PartitionedScan``: the scan of :mod:`metastore_plugins.core.analysis.scan` split by shard across a process group.

Every rank reads the batches of its shards (:mod:`.partition`, balanced by rows) and each combine
step is a collective (:mod:`.collectives`): rows are gathered and put back in selection order,
partial sums all-reduced, the column side of a product read by rank 0, chunk by chunk, and
broadcast. Every rank must run the same queries in the same order; each query's results equal
the one-process ones (the same op calls on the same blocks; sums over ranks to float rounding).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from metastore_plugins.core.analysis.scan import ColumnBatch, Device, Part, Scan
from metastore_plugins.core.distributed.collectives import Comm
from metastore_plugins.core.distributed.partition import Share, place, split
from metastore_plugins.core.records import LayerRecord
from metastore_plugins.core.store import Selection

T = TypeVar("T")


class PartitionedScan(Scan):
    """A :class:`~metastore_plugins.core.analysis.scan.Scan` over the ranks of ``group`` (the default group).

    Args:
        group: the ``torch.distributed`` process group; without one initialised, one process.
        device: where ops run (the local GPU under NCCL by default, else the CPU).
        shares: the ledger :meth:`part` notes each query's rows in (a new list by default).
    """

    partitioned = True

    def __init__(self, group: Any = None, device: Device = None, shares: list[Share] | None = None) -> None:
        self.comm = Comm.of(group)
        super().__init__(
            device if device is not None else (self.comm.device if self.comm.device.type != "cpu" else None)
        )
        self.group = group
        #: what this rank scored, one :class:`~.partition.Share` per partitioned read, in call order
        self.shares: list[Share] = [] if shares is None else shares

    @property
    def leader(self) -> bool:
        return self.comm.rank == 0

    def part(self, selection: Selection, what: str) -> Part:
        part = split(selection, self.comm.world)[self.comm.rank]
        self.shares.append(Share(what, len(part.positions), part.total))
        return part

    def gather(self, block: np.ndarray, part: Part, what: str) -> np.ndarray:
        return self._placed(self.comm.all_gather_rows(block, what), part)

    def gather_on(self, block: np.ndarray, part: Part, what: str, dst: int | None) -> np.ndarray | None:
        if dst is None:
            return self.gather(block, part, what)
        gathered = self.comm.gather_rows(block, what, dst)
        return None if gathered is None else self._placed(gathered, part)

    def _placed(self, blocks: list[np.ndarray], part: Part) -> np.ndarray:
        owners = part.owners if part.owners is not None else np.zeros(part.total, np.int64)
        return place(blocks, [np.flatnonzero(owners == r) for r in range(len(blocks))], part.total)

    def columns(
        self, read: Callable[[], Iterable[Sequence[ColumnBatch]]], what: str
    ) -> Iterator[Sequence[ColumnBatch]]:
        source = iter(read()) if self.comm.rank == 0 else None
        while True:
            chunk: list[ColumnBatch] | None = None
            if source is not None:
                found = next(source, None)
                one = self.comm.world == 1
                chunk = None if found is None else [(size, r if one else _portable(r)) for size, r in found]
            chunk = self.comm.broadcast(chunk, what)
            if chunk is None:  # rank 0 has read every chunk
                return
            yield chunk

    def first(self, compute: Callable[[], T], what: str) -> T:
        return self.comm.broadcast(compute() if self.comm.rank == 0 else None, what)

    def every(self, value: T, what: str) -> list[T]:
        return self.comm.all_gather_objects(value, what)

    def sum(self, tensors: dict[str, Tensor], what: str) -> dict[str, Tensor]:
        shapes = self.every({name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}, f"{what} (names)")
        names = dict.fromkeys(name for kept in shapes for name in kept)
        out = {}
        for name in names:
            shape, dtype = next(kept[name] for kept in shapes if name in kept)
            local = tensors[name] if name in tensors else torch.zeros(shape, dtype=dtype)
            out[name] = self.comm.all_sum(local, f"{what} ({name})")
        return out


def _portable(records: list[LayerRecord]) -> list[LayerRecord]:
    """Records whose tensors own just their bytes (a view would send its whole shard when pickled)."""
    return [replace(r, tensors={k: v.clone() for k, v in r.tensors.items()}) for r in records]
