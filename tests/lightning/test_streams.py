"""IterableDataset streams whose items carry an id field: training steps and checkpoint passes both work,
the passes over the first items of the stream (issue: the pass crashed with `object of type ... has no len()`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lightning_cases import DictClassifier, fit, make_data
from torch.utils.data import DataLoader, IterableDataset

from metastore_plugins import MetaStoreCallback, open_store
from metastore_plugins.core.errors import SampleIdError
from metastore_plugins.core.model.pass_sources import stream_batches


class Stream(IterableDataset):
    """Dict items ``{"x", "labels", "idx"}`` of a fixed table, read in order (no ``len``, no indexing)."""

    def __init__(self, n: int, seed: int, with_ids: bool = True) -> None:
        self.base, self.with_ids = make_data(n, seed), with_ids

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self.base)):
            x, y = self.base[i]
            yield {"x": x, "labels": y, **({"idx": i} if self.with_ids else {})}


def test_a_stream_with_ids_trains_and_gets_checkpoint_passes(tmp_path: Path) -> None:
    train = DataLoader(Stream(40, 1), batch_size=8)
    val = DataLoader(Stream(12, 2), batch_size=8)
    callback = MetaStoreCallback(  # self-influence over the passes: the stream items they took
        tmp_path / "store", checkpoint_train_samples=12, checkpoint_val_samples=10, outliers_from="checkpoints"
    )
    fit(tmp_path, DictClassifier(), train, val, [callback])
    store = open_store(tmp_path / "store")
    assert store.sample_ids("train").tolist() == list(range(40)) * 2
    for epoch in (0, 1):
        np.testing.assert_array_equal(store.sample_ids(f"epoch-{epoch}/train"), np.arange(12))  # the first 12 items
        np.testing.assert_array_equal(store.sample_ids(f"epoch-{epoch}/val"), np.arange(10))
    rows = callback.report_result["outliers"] if callback.report_result is not None else []
    assert len(rows) == 20  # ranked by AUM over the training steps: every one of the 40 trained samples competes
    in_passes = [row for row in rows if row["self_influence"] is not None]
    assert {row["sample_id"] for row in in_passes} <= set(range(12))  # self-influence only where the passes went


def test_stream_batches_take_exactly_the_first_items() -> None:
    found = list(stream_batches(Stream(30, 3), limit=13, batch_size=5))
    assert [ids.tolist() for ids, _ in found] == [list(range(5)), list(range(5, 10)), list(range(10, 13))]
    x = torch.cat([batch["x"] for _, batch in found])
    torch.testing.assert_close(x, make_data(30, 3).tensors[0][:13], rtol=0, atol=0)


def test_a_stream_without_ids_says_what_to_add() -> None:
    with pytest.raises(SampleIdError, match="'sample_id' or 'idx' field.*checkpoint_every_n_epochs=0"):
        list(stream_batches(Stream(10, 3, with_ids=False), limit=4, batch_size=2))
