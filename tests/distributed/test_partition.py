"""Shard -> rank assignment: balanced by rows, deterministic, every batch scored once, empty ranks allowed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from ddp_store import assert_close, write_ddp_store

from metastore_plugins import open_store
from metastore_plugins.core.distributed import assign_shards, partitioned_influence, split
from metastore_plugins.core.distributed.partition import place


def test_largest_shards_first_to_the_least_loaded_rank() -> None:
    owner = assign_shards({"a": 10, "b": 7, "c": 6, "d": 3, "e": 1}, 2)
    assert owner == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 0}  # loads 14 and 13
    assert assign_shards({"b": 5, "a": 5}, 2) == {"a": 0, "b": 1}  # ties: by name, then by rank
    assert assign_shards({"a": 4}, 3) == {"a": 0}  # more ranks than shards: ranks 1, 2 idle
    with pytest.raises(ValueError, match="positive number of ranks"):
        assign_shards({"a": 1}, 0)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_ddp_store(tmp_path_factory.mktemp("ddp-part") / "store")


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_parts_cover_the_selection_once_in_order(store_dir: Path, world: int) -> None:
    selection = open_store(store_dir).select("train", sample_ids=range(0, 40, 3))
    parts = split(selection, world)
    positions = np.sort(np.concatenate([p.positions for p in parts]))
    np.testing.assert_array_equal(positions, np.arange(len(selection)))
    ids = place([p.selection.sample_ids() for p in parts], [p.positions for p in parts], len(selection))
    np.testing.assert_array_equal(ids, selection.sample_ids())  # each part is a subsequence, in selection order
    loads = sorted(len(p.selection) for p in parts)
    shard_rows = max(r.size for r in selection.refs) * 4  # a shard holds a few batches
    assert loads[-1] - loads[0] <= shard_rows
    if world > len({r.file.name for r in selection.refs}):
        assert loads[0] == 0


def test_without_a_process_group_the_query_runs_here(store_dir: Path) -> None:
    store = open_store(store_dir)
    scores = partitioned_influence(store, "epoch-0/train", "epoch-0/val")
    assert scores is not None
    assert_close(scores.scores, store.influence("epoch-0/train", "epoch-0/val").scores)
