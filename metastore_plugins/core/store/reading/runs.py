"""Batches a store lists more than once: the mark of two runs written into one store directory.

One run stores each (capture point, step, micro-batch, rank) once. The same key listed twice
means a second run was appended to the first (a fresh run into the same directory, which the
callbacks refuse since :mod:`~metastore_plugins.core.training.run_start`, or a resumed run that went over
steps the first one had already stored), and every query over those steps counts both.

Example::

    for line in repeated_batches(StoreReader(path).index):
        print(line)
"""

from __future__ import annotations

import numpy as np

from metastore_plugins.core.store.shards.index import StoreIndex


def repeated_batches(index: StoreIndex) -> list[str]:
    """One line per capture point whose (step, micro-batch, rank) keys are listed more than once; empty if none."""
    if not len(index):
        return []
    batch = index.batch
    keys = np.stack([batch["capture_point"], batch["step"], batch["micro_batch"], batch["rank"]], axis=1)  # (n, 4)
    unique, counts = np.unique(keys, axis=0, return_counts=True)  # sorted by capture point, then step
    lines = []
    for point in np.unique(unique[counts > 1, 0]):
        repeated = (unique[:, 0] == point) & (counts > 1)
        _, step, micro_batch, rank = unique[repeated][0].tolist()
        steps = unique[repeated, 1]
        lines.append(
            f"capture point {index.capture_point_names[int(point)]!r}: {int(repeated.sum())} batches are stored "
            f"more than once, at steps {int(steps.min())}..{int(steps.max())} (step {step}, micro-batch "
            f"{micro_batch}, rank {rank}: {int(counts[repeated][0])} times): two runs were written into this store "
            "(a second run into the same directory, or a resumed run over steps already stored), and queries over "
            "those steps count both; the copies share their step numbers, so only a run into a new directory "
            "separates them"
        )
    return lines


__all__ = ["repeated_batches"]
