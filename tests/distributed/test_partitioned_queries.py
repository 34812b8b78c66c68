"""Every partitioned query, on 2 and 3 gloo processes, equals the single-process query on a 2-rank DDP store.

The single-process results come from ``metastore_plugins.core.analysis`` (``open_store``),
the partitioned ones from ``metastore_plugins.core.distributed`` in forked processes.
Tolerance: fp32 round-off, ``1e-6`` of the largest reference value (tests/README.md: the same
values computed in another process are never compared bit for bit). Influence, similarity
dots and sketches are the same op calls on the same blocks (the benchmark measures them equal
bit for bit); norms, self-influence and cosines group batches per op call differently; the
top-k sums the partial rows of a sample held by two ranks in another order. Ids, row order
and which rank gets ``None`` are exact.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ddp_store import assert_close, run_ranks, write_ddp_store
from reportcases import assert_top_ranking

from metastore_plugins import open_store
from metastore_plugins.core.distributed import (
    open_distributed_store,
    partitioned_influence,
    partitioned_influence_top,
    partitioned_norms,
    partitioned_self_influence,
    partitioned_similar,
    partitioned_sketches,
    split,
)

TRAIN = ["epoch-0/train", "epoch-1/train"]
VAL = ["epoch-0/val", "epoch-1/val"]
RTOL = 1e-6

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]  # forked gloo ranks (run_ranks)


def _queries(rank: int, world: int, out: Path) -> str:
    """Run every partitioned query; pickle what this rank got."""
    store = open_distributed_store(out.parent / "store")
    got: dict[str, Any] = {
        "self_influence": partitioned_self_influence(store, TRAIN),
        "self_influence_train": partitioned_self_influence(store, "train"),
        "self_influence_val": partitioned_self_influence(store, "epoch-0/val"),  # 2 shards: a rank with none at 3
        "norms": partitioned_norms(store, "train"),
        "norms_by_layer": partitioned_norms(store, "epoch-1/train", by_layer=True),
        "influence": partitioned_influence(store, TRAIN, VAL),
        "influence_filtered": partitioned_influence(store, "epoch-0/train", "epoch-0/val", train_ids=range(0, 40, 7)),
        "influence_on_1": partitioned_influence(store, "epoch-1/train", "epoch-1/val", dst=1),
        "influence_val_rows": partitioned_influence(store, "epoch-1/val", "epoch-1/train", max_bytes=2000),
        "top": partitioned_influence_top(store, TRAIN, VAL, k=3),
        "similar": partitioned_similar(store, "epoch-0/val", "train", query_ids=[41, 43]),
        "similar_dots": partitioned_similar(store, "epoch-0/val", "epoch-0/train", cosine=False),
        "sketches": partitioned_sketches(store, "train", dim=4, cache=False),
        "store_influence": store.influence("epoch-0/train", "epoch-0/val").scores,
        "store_sketches_cached": store.sketches("epoch-1/train", dim=4),  # built partitioned, rank 0 writes the cache
        "own_rows": len(split(store.select("train"), world)[rank].selection),
    }
    (out / f"got{rank}.pkl").write_bytes(pickle.dumps(got))
    return "done"


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_ddp_store(tmp_path_factory.mktemp("ddp") / "store")


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def ranks(request: pytest.FixtureRequest, store_dir: Path) -> tuple[int, list[dict[str, Any]]]:
    world = int(request.param)
    out = store_dir.parent / f"out-{world}"
    results = run_ranks(_queries, world, out)
    for rank in range(world):
        assert results.get(rank, {}).get("ok") == "done", results.get(rank)
    return world, [pickle.loads((out / f"got{r}.pkl").read_bytes()) for r in range(world)]


def test_self_influence_and_norms_equal_one_process(store_dir: Path, ranks: tuple[int, list[dict[str, Any]]]) -> None:
    store = open_store(store_dir)
    for got in ranks[1]:
        assert_close(got["self_influence"], store.self_influence(TRAIN))
        assert_close(got["self_influence_train"], store.self_influence("train"))
        assert_close(got["self_influence_val"], store.self_influence("epoch-0/val"))
        assert_close(got["norms"], store.norms("train"))
        expected = store.norms("epoch-1/train", by_layer=True)
        assert set(got["norms_by_layer"]) == set(expected)
        for layer, values in expected.items():
            assert_close(got["norms_by_layer"][layer], values)


def test_influence_is_the_one_process_matrix(store_dir: Path, ranks: tuple[int, list[dict[str, Any]]]) -> None:
    store = open_store(store_dir)
    world, results = ranks
    cases = {
        "influence": store.influence(TRAIN, VAL),
        "influence_filtered": store.influence("epoch-0/train", "epoch-0/val", train_ids=range(0, 40, 7)),
        "influence_val_rows": store.influence("epoch-1/val", "epoch-1/train", max_bytes=2000),
    }
    for rank, got in enumerate(results):
        for name, expected in cases.items():
            np.testing.assert_array_equal(got[name].row_ids, expected.row_ids)
            np.testing.assert_array_equal(got[name].col_ids, expected.col_ids)
            assert_close(got[name].scores, expected.scores)
        assert_close(got["store_influence"], store.influence("epoch-0/train", "epoch-0/val").scores)
        gathered = got["influence_on_1"]
        if rank == 1:
            assert_close(gathered.scores, store.influence("epoch-1/train", "epoch-1/val").scores)
        else:
            assert gathered is None


def test_top_k_equals_the_ranking_of_the_full_matrix(store_dir: Path, ranks: tuple[int, list[dict[str, Any]]]) -> None:
    full = open_store(store_dir).influence(TRAIN, VAL)
    tol = RTOL * float(np.abs(full.scores).max())
    for got in ranks[1]:
        assert [e["sample_id"] for e in got["top"]] == full.col_ids.tolist()
        for j, entry in enumerate(got["top"]):
            ranking = list(zip(full.row_ids.tolist(), full.scores[:, j].tolist()))
            assert len(entry["proponents"]) == len(entry["opponents"]) == 3
            assert_top_ranking(entry["proponents"], ranking, tol)
            assert_top_ranking([(i, -s) for i, s in entry["opponents"]], [(i, -s) for i, s in ranking], tol)


def test_similar_and_sketches_equal_one_process(store_dir: Path, ranks: tuple[int, list[dict[str, Any]]]) -> None:
    store = open_store(store_dir)
    cosine = store.similar("epoch-0/val", "train", query_ids=[41, 43])
    dots = store.similar("epoch-0/val", "epoch-0/train", cosine=False)
    sketches = store.sketches("train", dim=4, cache=False)
    for got in ranks[1]:
        np.testing.assert_array_equal(got["similar"].row_ids, cosine.row_ids)
        assert_close(got["similar"].scores, cosine.scores)
        assert_close(got["similar_dots"].scores, dots.scores)
        assert_close(got["sketches"], sketches)
        assert_close(got["store_sketches_cached"], store.sketches("epoch-1/train", dim=4, cache=False))
    assert list((store_dir / "sketches").glob("sketch-d4-*.safetensors"))  # rank 0 kept what was built


def test_every_row_is_scored_once_and_ranks_can_be_empty(
    store_dir: Path, ranks: tuple[int, list[dict[str, Any]]]
) -> None:
    world, results = ranks
    store = open_store(store_dir)
    assert sum(got["own_rows"] for got in results) == len(store.select("train"))
    val_parts = split(store.select("epoch-0/val"), world)  # 2 shards
    assert sum(len(p.selection) == 0 for p in val_parts) == world - 2  # more ranks than shards: someone idles
