"""``DistributedStore``: a ``GradientStore`` whose scanning queries run partitioned over a process group.

Code written against a store (the report tables, the ``metastore`` command) runs partitioned
unchanged when it is handed one: ``store.influence(...)``, ``store.self_influence(...)``,
``store.norms(...)``, ``store.similar(...)``, ``store.sketches(...)`` and ``store.build_sketches(...)``
are the functions of :mod:`metastore_plugins.core.distributed.queries`, returning the full
gathered result on every rank. Every rank must make the same calls in the same order.

Example (under ``torchrun --nproc-per-node 2 script.py``)::

    init_from_env()                              # gloo on CPU, NCCL when CUDA is there
    store = open_distributed_store("runs/demo")  # every rank opens the same store
    scores = store.influence("epoch-1/train", "epoch-1/val")  # each rank reads its shards only
    if rank_of() == 0:
        print(scores.top(5))
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed

from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.analysis.results import Scores
from metastore_plugins.core.analysis.sketches import Combine, check_seed, sketch_key, sketch_layers
from metastore_plugins.core.distributed import queries as dq
from metastore_plugins.core.distributed.collectives import Comm
from metastore_plugins.core.distributed.partition import Share
from metastore_plugins.core.ops import DEFAULT_MAX_BYTES
from metastore_plugins.core.store import find_store_dir, sketch_cache

T = TypeVar("T")


class DistributedStore(GradientStore):
    """A :class:`~metastore_plugins.core.analysis.GradientStore` whose scans are split across ``group``'s ranks.

    Args:
        path: the store (or run) directory; every rank opens the same one.
        group: the ``torch.distributed`` process group (the default one when ``None``).
        device: where ops run (the local GPU under NCCL by default, else the CPU).
        checksums: as :func:`~metastore_plugins.core.analysis.open_store`.

    Attributes:
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
        self.shares: list[Share] = []

    @property
    def rank(self) -> int:
        """This process's rank in the group (0 without a process group)."""
        return rank_of(self.group)

    def from_rank_zero(self, value: T, what: str) -> T:
        """Rank 0's ``value`` (small, picklable) on every rank: a collective, named ``what`` in its errors."""
        comm = Comm.of(self.group)
        return comm.broadcast(value if comm.rank == 0 else None, what)

    def _on(self) -> dict[str, Any]:
        return {"group": self.group, "device": self.device}

    def norms(self, capture_point: str | None = None, *, by_layer: bool = False, **where: Any) -> Any:
        return dq.partitioned_norms(self, capture_point, by_layer=by_layer, **self._on(), **where)

    def self_influence(self, capture_point: str | Sequence[str] | None = None, **where: Any) -> np.ndarray:
        return dq.partitioned_self_influence(self, capture_point, **self._on(), **where)

    def influence(
        self,
        train: str | Sequence[str],
        test: str | Sequence[str],
        *,
        layers: Sequence[str] | None = None,
        train_ids: Sequence[int] | None = None,
        test_ids: Sequence[int] | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        **top_k: Any,  # k=, index=, ... of GradientStore's: a partitioned scan scores every row (exact)
    ) -> Scores:
        _no_refinement(top_k)
        scores = dq.partitioned_influence(
            self,
            train,
            test,
            layers=layers,
            train_ids=train_ids,
            test_ids=test_ids,
            max_bytes=max_bytes,
            group=self.group,
            device=self.device,
        )
        return _gathered(scores)

    def similar(
        self,
        query: str,
        candidates: str,
        *,
        query_ids: Sequence[int] | None = None,
        cosine: bool = True,
        layers: Sequence[str] | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        **top_k: Any,  # k=, index=, ... of GradientStore's: a partitioned scan scores every row (exact)
    ) -> Scores:
        _no_refinement(top_k)
        scores = dq.partitioned_similar(
            self,
            query,
            candidates,
            query_ids=query_ids,
            cosine=cosine,
            layers=layers,
            max_bytes=max_bytes,
            group=self.group,
            device=self.device,
        )
        return _gathered(scores)

    def sketches(
        self,
        capture_point: str,
        dim: int = 16,
        seed: int = 0,
        layers: Sequence[str] | None = None,
        *,
        combine: Combine = "sum",
        cache: bool = True,
        max_bytes: int = DEFAULT_MAX_BYTES,
        **where: Any,
    ) -> np.ndarray:
        """Summed sketches of a whole capture point are built partitioned; filtered or concatenated ones are not."""
        if combine == "sum" and not any(value is not None for value in where.values()):
            return dq.partitioned_sketches(
                self,
                capture_point,
                dim,
                seed,
                layers,
                cache=cache,
                max_bytes=max_bytes,
                group=self.group,
                device=self.device,
            )
        return super().sketches(capture_point, dim, seed, layers, combine=combine, cache=cache, **where)

    def build_sketches(
        self,
        capture_point: str,
        dim: int = 64,
        seed: int = 0,
        layers: Sequence[str] | None = None,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> Path | None:
        """Build the cache file partitioned (rank 0 writes it); returns it, or ``None`` for a read-only store."""
        dq.partitioned_sketches(self, capture_point, dim, seed, layers, max_bytes=max_bytes, **self._on())
        key = sketch_key(self, capture_point, dim, check_seed(seed), sketch_layers(self, layers))
        path = sketch_cache.cache_path(self.path, key)
        return path if path.is_file() else None


def _gathered(scores: Scores | None) -> Scores:
    if scores is None:  # dst=None gathers on every rank
        raise RuntimeError("a partitioned query gathered its scores on another rank; call it with dst=None")
    return scores


def open_distributed_store(
    path: str | os.PathLike[str],
    *,
    group: Any = None,
    device: torch.device | str | None = None,
    checksums: bool = True,
) -> DistributedStore:
    """Open a store on every rank of ``group``; its scanning queries run partitioned (:class:`DistributedStore`)."""
    return DistributedStore(find_store_dir(path), group=group, device=device, checksums=checksums)


def rank_of(group: Any = None) -> int:
    """This process's rank in ``group`` (0 without a process group): the one that prints or writes results."""
    initialised = torch.distributed.is_available() and torch.distributed.is_initialized()
    return torch.distributed.get_rank(group) if initialised else 0


def _no_refinement(top_k: dict[str, Any]) -> None:
    """``k``/``index``/``candidates`` need nothing here (every row is scored); a ``recompute`` is refused by name."""
    unknown = set(top_k) - {"k", "index", "candidates", "count", "recompute"}
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {', '.join(sorted(unknown))}")
    if top_k.get("recompute") is not None:
        raise ValueError("recompute= is not supported by partitioned queries; refine the result with refine_influence")
