"""The collectives of the partitioned queries: gathers and broadcasts that fail loudly, naming the rank.

A :class:`Comm` wraps a ``torch.distributed`` process group (gloo on CPU, NCCL on GPUs), or no
group at all (one process: every collective is the identity). Each collective is announced
first in the group's rendezvous store (``metastore/<query>/<n>/<rank>``). When it fails
(a peer closed its connection because it died, or the group's timeout passed because it is
stuck) the surviving ranks read which ranks never announced it and raise
:class:`DistributedQueryError` naming them, instead of hanging or printing a socket error.

The timeout is the process group's: ``init_process_group(..., timeout=timedelta(seconds=60))``.
Under NCCL, a collective that times out aborts the process (``TORCH_NCCL_ASYNC_ERROR_HANDLING``,
on by default); gloo raises, and the error names the missing ranks.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from metastore_plugins.core.errors import ConfigError, DistributedQueryError
from metastore_plugins.core.process_group import group_up

T = TypeVar("T")

#: How long a surviving rank waits for late announcements before naming the ranks that are missing.
GRACE_S = 2.0
_QUERIES = itertools.count()  # every rank opens the same queries in the same order


def _default_store() -> Any:
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except Exception:  # no store: errors then cannot name the missing rank, but still raise
        return None


@dataclass
class Comm:
    """This rank's view of a process group for one partitioned query.

    Attributes:
        rank, world: this rank and the group's size (0 and 1 without a process group).
        group: the ``torch.distributed`` group (``None``: the default group, or one process).
        device: where collectives move tensors: the local GPU under NCCL, else the CPU.
    """

    rank: int = 0
    world: int = 1
    group: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    query: int = 0
    _seq: itertools.count = field(default_factory=itertools.count)
    _store: Any = None

    @classmethod
    def of(cls, group: Any = None) -> Comm:
        """The communicator of ``group`` (the default group), or of one process when none is initialised."""
        if not group_up():
            if group is not None:
                raise ConfigError("a process group was given but torch.distributed is not initialised")
            return cls()
        backend = str(dist.get_backend(group)).lower()
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        return cls(
            rank=dist.get_rank(group),
            world=dist.get_world_size(group),
            group=group,
            device=device,
            query=next(_QUERIES),
            _store=_default_store(),
        )

    # -- failure handling -----------------------------------------------------------------

    def _run(self, what: str, op: Callable[[], T]) -> T:
        """Announce collective ``what``, run it, and turn a failure into an error naming the missing ranks."""
        key = f"metastore/{self.query}/{next(self._seq)}"
        if self._store is not None:
            try:
                self._store.set(f"{key}/{self.rank}", "1")
            except Exception as exc:
                raise DistributedQueryError(
                    f"rank {self.rank}: cannot reach the rendezvous store before {what!r} (the rank hosting it, "
                    f"rank 0 unless torchrun hosts it, died?): {exc}"
                ) from exc
        try:
            return op()
        except Exception as exc:
            raise DistributedQueryError(self._explain(key, what, exc)) from exc

    def _explain(self, key: str, what: str, exc: Exception) -> str:
        head = f"rank {self.rank}: collective {what!r} of a partitioned query failed"
        if self._store is None:
            return f"{head} (no rendezvous store to tell which rank is missing): {exc}"
        missing: list[int] = []
        deadline = time.monotonic() + GRACE_S
        try:
            while True:
                missing = [r for r in range(self.world) if not self._store.check([f"{key}/{r}"])]
                if not missing or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        except Exception:
            return f"{head}; the rendezvous store is gone too (rank 0 died?): {exc}"
        if missing:
            names = ", ".join(map(str, missing))
            return (
                f"{head}: rank(s) {names} never reached it (died or stuck mid-query; see their logs). "
                f"The group's timeout bounds the wait: init_process_group(timeout=...). ({type(exc).__name__}: {exc})"
            )
        return f"{head} after every rank reached it (a rank died inside it?): {exc}"

    # -- collectives ----------------------------------------------------------------------

    def all_gather_rows(self, block: np.ndarray, what: str) -> list[np.ndarray]:
        """Every rank's ``(n_r, ...)`` block (``n_r`` may differ, the other dims must not), on every rank."""
        if self.world == 1:
            return [block]
        sizes = self._all_gather(torch.tensor([block.shape[0]], dtype=torch.int64), f"{what} (sizes)")
        counts = [int(s) for s in torch.cat(sizes).tolist()]
        padded = np.zeros((max(counts), *block.shape[1:]), dtype=block.dtype)  # (max n_r, ...)
        padded[: block.shape[0]] = block
        gathered = self._all_gather(torch.from_numpy(padded), what)
        return [part[:n].numpy() for part, n in zip(gathered, counts)]

    def _all_gather(self, tensor: torch.Tensor, what: str) -> list[torch.Tensor]:
        local = tensor.to(self.device)
        out = [torch.empty_like(local) for _ in range(self.world)]
        self._run(what, lambda: dist.all_gather(out, local, group=self.group))
        return [part.cpu() for part in out]

    def gather_rows(self, block: np.ndarray, what: str, dst: int) -> list[np.ndarray] | None:
        """Every rank's block on rank ``dst`` only (``None`` elsewhere): what the caller keeps is a full matrix."""
        if self.world == 1:
            return [block]
        parts = self.all_gather_objects(block.shape[0], f"{what} (sizes)")
        padded = np.zeros((max(parts), *block.shape[1:]), dtype=block.dtype)
        padded[: block.shape[0]] = block
        local = torch.from_numpy(padded).to(self.device)
        out = [torch.empty_like(local) for _ in range(self.world)] if self.rank == dst else None
        global_dst = dst if self.group is None else dist.get_global_rank(self.group, dst)
        self._run(what, lambda: dist.gather(local, out, dst=global_dst, group=self.group))
        if out is None:
            return None
        return [part[:n].cpu().numpy() for part, n in zip(out, parts)]

    def all_sum(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """The sum over ranks of every rank's ``tensor`` (same shape and dtype on each), on every rank."""
        if self.world == 1:
            return tensor
        local = tensor.to(self.device).clone()
        self._run(what, lambda: dist.all_reduce(local, group=self.group))
        return local.cpu()

    def all_gather_objects(self, value: T, what: str) -> list[T]:
        """Every rank's (picklable, small) ``value``, on every rank."""
        if self.world == 1:
            return [value]
        out: list[Any] = [None] * self.world
        self._run(what, lambda: dist.all_gather_object(out, value, group=self.group))
        return out

    def broadcast(self, value: T | None, what: str, src: int = 0) -> T:
        """Rank ``src``'s (picklable) ``value`` on every rank; other ranks pass ``None``."""
        if self.world == 1:
            return value  # type: ignore[return-value]
        box: list[Any] = [value if self.rank == src else None]
        global_src = src if self.group is None else dist.get_global_rank(self.group, src)
        self._run(what, lambda: dist.broadcast_object_list(box, src=global_src, group=self.group))
        return box[0]

    def check_same(self, value: Any, what: str) -> None:
        """Raise naming the ranks whose ``value`` differs from rank 0's (they opened another store or query)."""
        values = self.all_gather_objects(value, what)
        odd = [r for r, v in enumerate(values) if v != values[0]]
        if odd:
            raise DistributedQueryError(
                f"rank(s) {', '.join(map(str, odd))} disagree with rank 0 on {what}: {values[odd[0]]!r} against "
                f"{values[0]!r}; every rank must open the same store and run the same query"
            )
