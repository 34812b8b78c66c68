"""The stores the analytics benchmarks query, and the dense baseline that reads them back.

- :func:`write_store`: ``n_train`` train and ``n_test`` test samples captured at the same weights
  (test ids offset by :data:`TEST_ID_OFFSET`), batches drawn with seeds ``100 + k`` and ``200 + k``;
- :func:`rebuild_pass`: the ``rebuild`` method, dense per-sample gradients ``G_i = D_i^T A_i``
  rebuilt from the stored factors batch by batch, then ``G_train G_test^T`` and ``||G_i||``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from metastore_plugins.core.analysis import open_store
from metastore_plugins.core.records import restore_all
from metastore_plugins.core.store import StoreWriter
from metastore_plugins.core.training.passes import capture_step

from .capture_bench import per_sample_ce
from .models import Workload

TEST_ID_OFFSET = 1_000_000


def write_store(
    path: Path, model: torch.nn.Module, workload: Workload, n_train: int, n_test: int, encoding: str
) -> None:
    """Capture ``n_train`` train and ``n_test`` test samples at the same weights (model left unchanged)."""
    with StoreWriter(path, encoding=encoding) as writer:
        for point, count, seed, offset in (("train", n_train, 100, 0), ("test", n_test, 200, TEST_ID_OFFSET)):
            for k, lo in enumerate(range(0, count, workload.batch_size)):
                size = min(workload.batch_size, count - lo)
                batch = workload.batch(size, seed + k)
                capture_step(
                    model,
                    lambda batch=batch: workload.forward(model, batch),
                    batch["labels"],
                    torch.arange(lo, lo + size) + offset,
                    per_sample_ce,
                    writer,
                    step=0,
                    capture_point=point,
                )
    model.zero_grad(set_to_none=True)


def flat(grads: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    """Per-sample gradients of ``names`` flattened side by side: ``(n, P)``."""
    return torch.cat([grads[n].reshape(grads[n].shape[0], -1) for n in names], 1)  # (n, P)


def rebuild_pass(path: Path, names: list[str], train_ids: list[int] | None = None) -> dict[str, Any]:
    """Norms and influence after rebuilding dense per-sample gradients from the stored factors."""
    store = open_store(path)
    start = time.perf_counter()
    g_test = torch.cat([flat(restore_all(b.records), names) for b in store.select("test").batches()])  # (M, P)
    t = {"test": time.perf_counter() - start, "train": 0.0, "matmul": 0.0, "norms": 0.0}
    scores, norms = [], []
    batches = iter(store.select("train", sample_ids=train_ids).batches())
    while True:
        t0 = time.perf_counter()
        b = next(batches, None)
        if b is None:
            break
        g = flat(restore_all(b.records), names)  # (n, P)
        t1 = time.perf_counter()
        scores.append(g @ g_test.T)  # (n, M)
        t2 = time.perf_counter()
        norms.append(g.norm(dim=1))  # (n,)
        t["train"] += t1 - t0
        t["matmul"] += t2 - t1
        t["norms"] += time.perf_counter() - t2
    return {
        "scores": torch.cat(scores).double().numpy(),
        "norms": torch.cat(norms).double().numpy(),
        "influence_s": t["test"] + t["train"] + t["matmul"],
        "norms_s": t["train"] + t["norms"],
    }
