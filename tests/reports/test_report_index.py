"""The influence report's proponents and opponents through the nearest-gradient index the run built at its close.

Reference: the same report's rows with every training row scored (``influence_rows(index=False)``, the
exhaustive scan). With the index, only each test sample's candidates are rescored (fewer rows than the
store holds); the top lists (ids compared as sets: no order among equal scores) and their scores must be
the exhaustive ones, on exact factors, on seeded projections, and on projections on each pass's K-FAC
eigenbasis with a 2-class head (its block is 2 x 8 beside the hidden layer's 8 x 8: the index pads it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from metastore_plugins import CaptureSession, StoreWriter, open_store
from metastore_plugins.core.analysis import queries
from metastore_plugins.core.analysis import vector_index as vi
from metastore_plugins.core.analysis.index_parts import build_rank_parts
from metastore_plugins.core.ops.curvature import CurvatureSums
from metastore_plugins.core.ops.eigenbasis import fit_bases, represent_on_bases
from metastore_plugins.core.ops.represent import represent
from metastore_plugins.core.reports.build import report_tables
from metastore_plugins.core.reports.influence_table import influence_rows

TRAIN_N, VAL_N = 1000, 24


def write_passes(path: Path, kept: str) -> None:
    """Two epochs of checkpoint passes (1000 train samples, 24 val), 100 samples a batch, labels and rates;
    ``kept``: ``"exact"`` factors, ``"projected"`` 4 x 4 (seeded), ``"eigenbasis"`` 8 x 8 on each pass's basis."""
    torch.manual_seed(0)
    classes = 2 if kept == "eigenbasis" else 4
    model = nn.Sequential(nn.Linear(10, 24), nn.Tanh(), nn.Linear(24, classes))
    x, y = torch.randn(TRAIN_N + VAL_N, 10), torch.randint(0, classes, (TRAIN_N + VAL_N,))
    both = dict.fromkeys(("0", "2"), "projected")
    with StoreWriter(path, encoding="fp32", shard_bytes=200_000) as writer:
        for epoch in range(2):
            bases = None
            for split, ids in (("train", torch.arange(TRAIN_N)), ("val", torch.arange(TRAIN_N, TRAIN_N + VAL_N))):
                for part in ids.split(100):
                    with CaptureSession(model, loss_reduction="sum") as session:
                        F.cross_entropy(model(x[part]), y[part], reduction="sum").backward()
                    records = session.factors()
                    if kept == "eigenbasis":
                        if bases is None:  # fitted on the pass's first batch, used for the whole pass
                            sums = CurvatureSums()
                            sums.add(records)
                            bases = fit_bases(sums, 8, epoch)
                        records = represent_on_bases(records, both, 8, None, bases)
                    elif kept == "projected":
                        records = represent(records, both, 4, 4)
                    point = f"epoch-{epoch}/{split}"
                    writer.write(records, sample_ids=part, step=epoch, capture_point=point, labels=y[part], lr=0.1)
                    model.zero_grad()
            with torch.no_grad():  # the next epoch's passes are taken at other weights
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))


def top_lists(rows: list[dict[str, Any]]) -> list[tuple[int, list[int], list[int]]]:
    return [
        (r["test_id"], sorted(e["sample_id"] for e in r["proponents"]), sorted(e["sample_id"] for e in r["opponents"]))
        for r in rows
    ]


def assert_same_rows(fast: list[dict[str, Any]], reference: list[dict[str, Any]]) -> None:
    assert fast and top_lists(fast) == top_lists(reference)
    for a, b in zip(fast, reference):
        got = sorted(e["score"] for e in a["proponents"] + a["opponents"])
        want = sorted(e["score"] for e in b["proponents"] + b["opponents"])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)
        assert a["exact"] == b["exact"] and a["method"] == b["method"] == "tracin"


@pytest.mark.parametrize("kept", ["exact", "projected", "eigenbasis"])
def test_report_top_lists_through_the_index_equal_the_exhaustive_scan(
    tmp_path: Path, kept: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "store"
    write_passes(path, kept)
    store = open_store(path)
    train, test = ["epoch-0/train", "epoch-1/train"], ["epoch-0/val", "epoch-1/val"]
    reference = influence_rows(store, train, test, k=5, samples=4, method="tracin", index=False)
    without_index = report_tables(store, influence_method="tracin", influence_samples=4)["influence"]
    assert_same_rows(without_index, reference)  # no index kept: every row scored
    built = build_rank_parts(path, 0)  # what RunCapture(index=True) does at its close
    assert built.problems == [] and built.written

    opened: list[Any] = []
    scored: list[int] = []
    open_index, full = vi.open_index, queries.influence

    def spy_open(*args: Any, **kwargs: Any) -> Any:
        opened.append(index := open_index(*args, **kwargs))
        return index

    def spy_full(*args: Any, **kwargs: Any) -> Any:
        scored.append(TRAIN_N if kwargs.get("train_ids") is None else len(kwargs["train_ids"]))
        return full(*args, **kwargs)

    monkeypatch.setattr(vi, "open_index", spy_open)
    monkeypatch.setattr(queries, "influence", spy_full)
    store = open_store(path)
    fast = report_tables(store, influence_method="tracin", influence_samples=4)["influence"]
    assert len(opened) == 2 and all(o is not None and o.rebuilt == [] for o in opened)  # the kept index, whole
    if kept != "exact":
        assert scored == []  # the projections are the records: scored from the index's vectors
    else:
        assert len(scored) == 1 and scored[0] < TRAIN_N  # only the candidates rescored from the shards
    assert_same_rows(fast, reference)
    assert_same_rows(influence_rows(store, train, test, k=5, samples=4, method="tracin"), reference)
