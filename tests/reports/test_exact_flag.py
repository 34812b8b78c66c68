"""The influence report's ``exact`` flag follows what the shards hold, not what the plan promised.

A budget can degrade a checkpoint pass that was planned exact while the run goes on; its rows must
then say their scores are estimates. The reference is the record kinds the writer was given.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from metastore_plugins import CaptureSession, StoreWriter, open_store
from metastore_plugins.core.ops.represent import represent
from metastore_plugins.core.reports.influence_table import influence_rows, passes_exact

N, D_IN, CLASSES = 12, 6, 3


def _write(path: Path, projected_last: bool) -> None:
    """Two epochs of passes (train and val); the last one's records projected when ``projected_last``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, 8), nn.Tanh(), nn.Linear(8, CLASSES))
    x, y = torch.randn(N, D_IN), torch.randint(0, CLASSES, (N,))
    plan = {"policy": "auto", "passes": {"0": "exact", "2": "exact"}, "train": {}}  # what the start promised
    with StoreWriter(path, config={"capture_plan": plan}) as writer:
        for epoch in range(2):
            for split, rows in (("train", slice(0, 8)), ("val", slice(8, N))):
                with CaptureSession(model, loss_reduction="sum") as session:
                    F.cross_entropy(model(x[rows]), y[rows], reduction="sum").backward()
                records = session.factors()
                if projected_last and epoch == 1:
                    records = represent(records, {"0": "projected", "2": "projected"}, 2, 2)
                ids = torch.arange(N)[rows]
                writer.write(
                    records, sample_ids=ids, step=epoch, capture_point=f"epoch-{epoch}/{split}", labels=y[rows]
                )
                model.zero_grad()


def test_a_pass_degraded_after_the_plan_makes_the_rows_estimates(tmp_path: Path) -> None:
    _write(tmp_path / "exact", projected_last=False)
    _write(tmp_path / "degraded", projected_last=True)
    exact, degraded = open_store(tmp_path / "exact"), open_store(tmp_path / "degraded")
    assert passes_exact(exact) and not passes_exact(degraded)
    points = (["epoch-0/train", "epoch-1/train"], ["epoch-0/val", "epoch-1/val"])
    assert all(row["exact"] for row in influence_rows(exact, *points, k=3))
    rows = influence_rows(degraded, *points, k=3)
    assert rows and not any(row["exact"] for row in rows)
