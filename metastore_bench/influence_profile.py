"""What exact store influence costs beyond its time: the arithmetic of the plan the cost model
chose, the rate it ran at against one large matmul, and its peak memory in a fresh process.

- ``plan_flops``: for every (train batch, test batch) pair that ``store.influence`` multiplies,
  the :attr:`~metastore_plugins.core.ops.Plan.flops` of each record pair
  (:func:`~metastore_plugins.core.ops.plan_total_dots`): matrix-product flops of the chosen
  method plus one per element of its elementwise steps;
- ``matmul_gflops``: ``2 n^3`` flops of one ``(n, n) @ (n, n)`` fp32 product over its time, in
  the same process and thread count, timed in the same rounds as the influence it is compared to;
- ``influence_memory``: ``store.influence(train, test)`` in a fresh subprocess
  (:func:`metastore_bench.scaling_bench.measure`): peak resident set minus the resident set just
  before, split into anonymous memory (sampled) and the file pages (shards) mapped meanwhile.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from metastore_plugins.core import ops
from metastore_plugins.core.analysis import GradientStore

from .scaling_bench import measure


def plan_flops(store: GradientStore, train: str = "train", test: str = "test") -> float:
    """Flops of the plans ``store.influence(train, test)`` follows (same batch pairs, same cost model)."""
    tests = list(store.select(test).batches())
    return float(
        sum(
            plan.flops
            for row in store.select(train).batches()
            for col in tests
            for plan in ops.plan_total_dots(row.records, col.records)
        )
    )


class Matmul:
    """One ``(n, n) @ (n, n)`` fp32 product, its operands made once: call it to time one product."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.size = size
        self.a = torch.randn(size, size, generator=generator)  # (n, n)
        self.b = torch.randn(size, size, generator=generator)  # (n, n)
        self.out = torch.empty(size, size)  # (n, n)
        torch.matmul(self.a, self.b, out=self.out)  # warm-up

    def __call__(self) -> float:
        """Seconds of one product."""
        start = time.perf_counter()
        torch.matmul(self.a, self.b, out=self.out)
        return time.perf_counter() - start

    def gflops(self, seconds: float) -> float:
        return 2.0 * self.size**3 / seconds / 1e9


def influence_memory(store_path: Path, threads: int) -> dict[str, Any]:
    """Peak memory (MiB) and time of one ``store.influence("train", "test")`` in a fresh process."""
    point = measure(store_path, 0, 1, "store", threads)
    return {
        "extra_peak_mib": point["rss_peak_mib"] - point["rss_before_mib"],
        "anon_extra_peak_mib": point["anon_peak_mib"] - point["anon_before_mib"],
        "file_mapped_mib": point["file_after_mib"] - point["file_before_mib"],
        "process_peak_mib": point["rss_peak_mib"],
        "time_s": point["times_s"][0],
    }
