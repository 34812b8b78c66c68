"""Captum ``TracInCPFast`` on its home ground: influence through the CNN's last layer only.

``TracInCPFast`` scores ``(x_i . x_j)(d_i . d_j)`` with ``x`` the last layer's input and ``d`` the
loss gradient at its output -- the weight part of the last layer's gradient, at one checkpoint.
It recomputes both from the checkpoint and the data (a forward pass per sample); the store reads
the captured factors. Agreement is checked against the store's weight-only dots (``ops.total_dots``
with ``params=["fc2.weight"]``); ``store.influence(layers=["fc2"])`` (weight and bias) is timed too.
"""

from __future__ import annotations

import importlib.util
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from metastore_plugins.core import ops
from metastore_plugins.core.analysis import open_store

from .models import Workload
from .stores import write_store
from .timing import median, rel_error

LAYER, WEIGHT = "fc2", "fc2.weight"


def _inputs(workload: Workload, count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same samples :func:`write_store` captured (batches drawn with seeds ``seed + k``)."""
    parts = [
        workload.batch(min(workload.batch_size, count - lo), seed + k)
        for k, lo in enumerate(range(0, count, workload.batch_size))
    ]
    return torch.cat([p["x"] for p in parts]), torch.cat([p["labels"] for p in parts])


def _store_weight_dots(path: Path) -> torch.Tensor:
    store = open_store(path)
    cols = [b.records for b in store.select("test", layers=[LAYER]).batches()]
    rows = [
        torch.cat([ops.total_dots(b.records, c, params=[WEIGHT]) for c in cols], 1)  # (n, M)
        for b in store.select("train", layers=[LAYER]).batches()
    ]
    return torch.cat(rows)  # (N, M)


def run(workload: Workload, n_train: int, n_test: int, repeats: int) -> dict[str, Any]:
    if importlib.util.find_spec("captum") is None:
        return {"workload": workload.name, "status": "skipped (not installed)"}
    from captum.influence import TracInCPFast
    from torch.utils.data import TensorDataset

    model = workload.build()
    x_train, y_train = _inputs(workload, n_train, 100)
    x_test, y_test = _inputs(workload, n_test, 200)
    with tempfile.TemporaryDirectory(prefix="msbench-") as tmp:
        path = Path(tmp) / "store"
        write_store(path, model, workload, n_train, n_test, "fp32")
        checkpoint = Path(tmp) / "checkpoint.pt"
        torch.save(model.state_dict(), checkpoint)

        def load(m: nn.Module, file: str) -> float:
            m.load_state_dict(torch.load(file))
            return 1.0  # learning rate: the store's influence uses lr = 1 when none was recorded

        try:
            tracin = TracInCPFast(
                model,
                getattr(model, LAYER),
                TensorDataset(x_train, y_train),
                [str(checkpoint)],
                checkpoints_load_func=load,
                loss_fn=nn.CrossEntropyLoss(reduction="sum"),
                batch_size=workload.batch_size,
            )
            captum_scores = tracin.influence((x_test, y_test)).T  # (N, M)
        except Exception as exc:  # noqa: BLE001 - reported, never hidden
            return {"workload": workload.name, "status": f"failed: {type(exc).__name__}: {str(exc)[:160]}"}
        store = open_store(path)
        times: dict[str, list[float]] = {"captum": [], "store_weight_dots": [], "store_influence_layer": []}
        ours = _store_weight_dots(path)
        for _ in range(repeats):
            t0 = time.perf_counter()
            tracin.influence((x_test, y_test))
            t1 = time.perf_counter()
            ours = _store_weight_dots(path)
            t2 = time.perf_counter()
            store.influence("train", "test", layers=[LAYER])
            times["captum"].append(t1 - t0)
            times["store_weight_dots"].append(t2 - t1)
            times["store_influence_layer"].append(time.perf_counter() - t2)
    medians = {name: median(values) for name, values in times.items()}
    return {
        "workload": workload.name,
        "status": "ok",
        "layer": LAYER,
        "n_train": n_train,
        "n_test": n_test,
        "repeats": repeats,
        "median_s": medians,
        "store_speedup_vs_captum": medians["captum"] / medians["store_weight_dots"],
        "agreement_weight_only": rel_error(ours.double().numpy(), captum_scores.double().numpy()),
    }
