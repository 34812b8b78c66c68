"""Queries stream a store larger than their memory budget: record bytes alive at once stay bounded, results exact."""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from runcases import Run

from metastore_plugins.core.store.reading import selection as selection_module


class LiveRecordBytes:
    """Counts the bytes of decoded record tensors that are still alive (freed ones are subtracted)."""

    def __init__(self) -> None:
        self.live = self.peak = self.total = 0

    def track(self, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        self.live += size
        self.total += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._free, size)

    def _free(self, size: int) -> None:
        self.live -= size


@pytest.fixture
def live_bytes(monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveRecordBytes]:
    counter = LiveRecordBytes()
    original = selection_module.BatchRef.read_records

    def tracked(self: selection_module.BatchRef, layers=None):  # type: ignore[no-untyped-def]
        records = original(self, layers)
        for record in records:
            for tensor in record.tensors.values():
                counter.track(tensor)
        return records

    monkeypatch.setattr(selection_module.BatchRef, "read_records", tracked)
    yield counter


def test_influence_streams_under_the_budget(run_a: Run, live_bytes: LiveRecordBytes) -> None:
    store = run_a.store
    batch_bytes = max(sum(r.nbytes for r in ref.read_records()) for ref in store.select("train").refs)
    whole = store.influence("train", "train", max_bytes=1 << 30)
    live_bytes.live = live_bytes.peak = live_bytes.total = 0
    budget = 3 * batch_bytes  # the store holds 8 batches: 2.7x the budget
    small = store.influence("train", "train", max_bytes=budget)
    assert live_bytes.total > budget  # the query read more than its budget in all ...
    assert live_bytes.peak <= budget + 2 * batch_bytes, (
        live_bytes.peak,
        budget,
    )  # ... never more than budget + a batch or two
    scale = np.abs(whole.scores).max()  # row batches joined up to the budget: the same scores up to float rounding
    np.testing.assert_allclose(small.scores, whole.scores, rtol=1e-5, atol=1e-6 * scale)
    flat = torch.cat([torch.cat([g.reshape(g.shape[0], -1) for g in ref.values()], 1) for ref in run_a.refs]).double()
    lrs = torch.cat([torch.full((len(i),), lr, dtype=torch.float64) for i, lr in zip(run_a.ids, run_a.lrs)])
    ids = torch.cat(run_a.ids).tolist()
    unique = small.row_ids.tolist()
    index = torch.tensor([unique.index(i) for i in ids])
    occurrence = (lrs[:, None] * flat) @ flat.T  # (N_occ, N_occ)
    by_row = torch.zeros(len(unique), len(ids), dtype=torch.float64).index_add_(0, index, occurrence)
    expected = torch.zeros(len(unique), len(unique), dtype=torch.float64).index_add_(1, index, by_row).numpy()
    assert np.abs(small.scores - expected).max() <= 1e-5 * np.abs(expected).max()
