"""The training-dynamics queries, in-run influence and the curvature and sketch queries of a ``DistributedStore``
(2 gloo processes, each reading its shards) equal the single-process queries on a 2-rank DDP store.

Tolerance: fp32 round-off, ``1e-6`` of the largest reference value (tests/README.md); sums over ranks
are added in another order. Ids, steps, entries and row order are exact.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ddp_store import assert_close, run_ranks, write_ddp_store

from metastore_plugins import open_store
from metastore_plugins.core.distributed import open_distributed_store

TRAIN = ["epoch-0/train", "epoch-1/train"]
VAL = ["epoch-0/val", "epoch-1/val"]

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]  # forked gloo ranks (run_ranks)


def _ask(store: Any) -> dict[str, Any]:
    """Every query compared, asked of ``store`` (partitioned or not)."""
    return {
        "batch_gradient": store.batch_gradient(3),
        "batch_gradient_mob": store.batch_gradient(5, reduction="mean_of_batches"),
        "changed_most": store.changed_most(k=4),
        "contributors": store.top_contributors("0", k=3, steps=(0, 6)),
        "exceed": store.exceed_fractions(0.5),
        "exceed_weights": store.exceed_fractions(0.01, of="weights", steps=(0, 2)),
        "spikes": store.spikes(0.0, fraction=0.0, before=2),
        "compare": store.compare(store.path),
        "in_run": store.in_run_influence("epoch-1/val"),
        "kfac": store.kfac_influence(TRAIN, VAL, method="kfac"),
        "ekfac": store.kfac_influence(TRAIN, VAL, train_ids=range(0, 40, 3)),
        "sketched": store.sketched_influence(TRAIN, VAL, dim=2, cache=False),
        "kernel": store.kernel_influence(TRAIN, VAL, dim=2, cache=False),
        "concat": store.sketches("train", dim=2, combine="concat", steps=(0, 5)),
        "index": store.build_vector_index("epoch-1/train", dim=2).vectors,  # rank 0 builds, rank 1 reads
    }


def _queries(rank: int, world: int, out: Path) -> str:
    store = open_distributed_store(out.parent / "store")
    got = _ask(store)
    got["shares"] = [(s.query, s.rows, s.total) for s in store.shares]
    (out / f"got{rank}.pkl").write_bytes(pickle.dumps(got))
    return "done"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    store_dir = write_ddp_store(tmp_path_factory.mktemp("ddp-dynamics") / "store")
    out = store_dir.parent / "out"
    ranks = run_ranks(_queries, 2, out)
    for rank in range(2):
        assert ranks.get(rank, {}).get("ok") == "done", ranks.get(rank)
    return _ask(open_store(store_dir)), [pickle.loads((out / f"got{r}.pkl").read_bytes()) for r in range(2)]


def test_dynamics_queries_equal_one_process(results: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    alone, ranks = results
    for got in ranks:
        for name in ("batch_gradient", "batch_gradient_mob"):
            assert set(got[name]) == set(alone[name])
            for param, grad in alone[name].items():
                assert_close(got[name][param], grad)
        assert [(c.param, c.index) for c in got["changed_most"]] == [(c.param, c.index) for c in alone["changed_most"]]
        assert_close([c.value for c in got["changed_most"]], [c.value for c in alone["changed_most"]])
        contributors, expected = got["contributors"], alone["contributors"]
        assert contributors.entries == expected.entries
        np.testing.assert_array_equal(contributors.sample_ids, expected.sample_ids)
        np.testing.assert_array_equal(contributors.steps, expected.steps)
        assert_close(contributors.values, expected.values)
        for name in ("exceed", "exceed_weights"):
            np.testing.assert_array_equal(got[name][0], alone[name][0])
            assert_close(got[name][1], alone[name][1])
        assert [(s.step, s.steps_before) for s in got["spikes"]] == [(s.step, s.steps_before) for s in alone["spikes"]]
        for spike, expected_spike in zip(got["spikes"], alone["spikes"]):
            np.testing.assert_array_equal(spike.sample_ids, expected_spike.sample_ids)
        compared, expected_comparison = got["compare"], alone["compare"]
        assert [row.layer for row in compared.layers] == [row.layer for row in expected_comparison.layers]
        assert_close([row.mean_norm for row in compared.layers], [row.mean_norm for row in expected_comparison.layers])
        np.testing.assert_array_equal(compared.steps, expected_comparison.steps)
        assert_close(compared.norm, expected_comparison.norm)
        assert_close(compared.loss, expected_comparison.loss)


def test_influence_queries_equal_one_process(results: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    alone, ranks = results
    for got in ranks:
        for name in ("in_run", "kfac", "ekfac", "sketched", "kernel"):
            np.testing.assert_array_equal(got[name].row_ids, alone[name].row_ids)
            np.testing.assert_array_equal(got[name].col_ids, alone[name].col_ids)
            assert_close(got[name].scores, alone[name].scores)
        assert_close(got["concat"], alone["concat"])
        assert_close(got["index"], alone["index"])


def test_each_rank_read_its_share(results: tuple[dict[str, Any], list[dict[str, Any]]]) -> None:
    shares = [got["shares"] for got in results[1]]
    assert [q for q, _, _ in shares[0]] == [q for q, _, _ in shares[1]]  # the same reads in the same order
    for (query, rows_0, total), (_, rows_1, _) in zip(*shares):
        assert rows_0 + rows_1 == total, query
    assert any(q.startswith("influence of 'train'") for q, _, _ in shares[0])  # in-run influence, partitioned
    assert any(q.startswith("top_contributors") for q, _, _ in shares[0])
    assert any(q.startswith("curvature of") for q, _, _ in shares[0])  # K-FAC sums, each rank its shards
    assert sum(rows for _, rows, _ in shares[1]) > 0
