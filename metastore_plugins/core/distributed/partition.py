"""Which rank scores which shards: a selection's shards assigned to ranks, balanced by rows.

Every rank computes the same assignment from the store's index alone (no communication and
no shard read): shards are sorted by the number of the selection's rows they hold (largest
first, the file name breaks ties) and each goes to the rank with the fewest rows so far
(the lowest rank breaks ties). This greedy "longest processing time" rule keeps the largest
load within ``4/3`` of the best possible one, and within one shard's rows of the mean.

A rank scores the batches of its shards in selection order, so its results are a
subsequence of the single-process result: :attr:`Part.positions
<metastore_plugins.core.analysis.scan.Part.positions>` says where they go.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from metastore_plugins.core.analysis.scan import Part
from metastore_plugins.core.errors import ConfigError, QueryError
from metastore_plugins.core.store import Selection

__all__ = ["Part", "Share", "assign_shards", "batch_owners", "batch_sizes", "place", "sample_owners", "split"]


def assign_shards(rows_per_shard: Mapping[str, int], world: int) -> dict[str, int]:
    """Shard file name -> rank, balanced by rows (greedy, largest shard first).

    Raises:
        ValueError: if ``world`` is not a positive number of ranks.
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ConfigError(f"world must be a positive number of ranks, got {world!r}")
    load = [0] * world
    owner: dict[str, int] = {}
    for name, rows in sorted(rows_per_shard.items(), key=lambda item: (-item[1], item[0])):
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[name] = rank
        load[rank] += rows
    return owner


@dataclass(frozen=True)
class Share:
    """What one rank scored of one partitioned query: ``rows`` of the selection's ``total`` sample occurrences."""

    query: str
    rows: int
    total: int


def batch_owners(selection: Selection, world: int) -> np.ndarray:
    """``(n_b,)`` the rank that scores each of the selection's batches."""
    names = [selection.files.ref(int(row)).file.name for row in selection.batch_rows]
    counts = batch_sizes(selection)  # (n_b,) selected samples per batch
    rows: dict[str, int] = {}
    for name, count in zip(names, counts.tolist()):
        rows[name] = rows.get(name, 0) + int(count)
    owner = assign_shards(rows, world)
    return np.array([owner[name] for name in names], dtype=np.int64)


def batch_sizes(selection: Selection) -> np.ndarray:
    """``(n_b,)`` how many of each batch's samples the selection keeps (its sample filter applied)."""
    index = selection.files.index
    rows, at = index.rows(selection.batch_rows)  # (N_all,) sample rows, (N_all,) their batch position
    if selection.sample_filter is not None:
        at = at[np.isin(index.sample["sample_id"][rows], selection.sample_filter)]
    return np.bincount(at, minlength=len(selection.batch_rows)).astype(np.int64)


def sample_owners(selection: Selection, world: int) -> np.ndarray:
    """``(N,)`` the rank that scores each sample occurrence of the selection, in selection order."""
    return np.repeat(batch_owners(selection, world), batch_sizes(selection))


def split(selection: Selection, world: int) -> list[Part]:
    """Every rank's :class:`Part` of ``selection`` (rank ``r`` is entry ``r``; a rank may get nothing)."""
    owners = batch_owners(selection, world)  # (n_b,)
    by_sample = np.repeat(owners, batch_sizes(selection))  # (N,)
    return [
        Part(
            replace(selection, batch_rows=selection.batch_rows[owners == rank]),
            np.flatnonzero(by_sample == rank),
            len(by_sample),
            by_sample,
        )
        for rank in range(world)
    ]


def place(parts: list[np.ndarray], positions: list[np.ndarray], total: int) -> np.ndarray:
    """Per-rank row blocks put back in selection order: ``out[positions[r]] = parts[r]``.

    Raises:
        ValueError: if a rank sent a block whose row count differs from its share (a bug or a
            rank that read another store).
    """
    shape = next((p.shape[1:] for p in parts if p.shape[0]), parts[0].shape[1:] if parts else ())
    out = np.zeros((total, *shape), dtype=parts[0].dtype if parts else np.float64)
    for rank, (block, where) in enumerate(zip(parts, positions)):
        if block.shape[0] != len(where):
            raise QueryError(
                f"rank {rank} sent {block.shape[0]} rows for its {len(where)} samples; every rank must open the "
                "same store (same manifests) and run the same query"
            )
        out[where] = block
    return out
