"""``report_run`` on a ``DistributedStore``: every rank scores its share, rank 0 writes what one process writes.

2 forked gloo ranks run the whole report pass (tables, refinement, dynamics, projector) on a 2-rank
DDP store; a single-process ``report_run`` on the same store is the reference. Tolerances: fp32
round-off, ``1e-6`` of the largest reference value (tests/README.md); rankings by
``assert_top_ranking``; ids, tags and who wrote what are exact.
"""

from __future__ import annotations

import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ddp_store import assert_close, run_ranks, write_ddp_store
from reportcases import RTOL, assert_shares, assert_tables_match, read_tables

from metastore_plugins.core.analysis import queries
from metastore_plugins.core.distributed import open_distributed_store
from metastore_plugins.core.reports import influence_table
from metastore_plugins.core.training.report_pass import report_run

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]  # forked gloo ranks (run_ranks)


class RecordingWriter:
    """A ``SummaryWriter`` stand-in that keeps ``(method, tag, value)`` of every call (picklable)."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.fail = fail

    def add_text(self, tag: str, text: str, global_step: int | None = None) -> None:
        if self.fail:
            raise OSError("disk full")  # rank 0 fails where only it works: after every collective
        self.calls.append(("text", tag, text))

    def add_histogram(self, tag: str, values: Any, global_step: int | None = None) -> None:
        self.calls.append(("histogram", tag, np.asarray(values, dtype=np.float64)))

    def add_figure(self, tag: str, figure: Any, global_step: int | None = None, close: bool = True) -> None:
        self.calls.append(("figure", tag, None))

    def add_scalar(self, tag: str, value: float, global_step: int | None = None) -> None:
        self.calls.append(("scalar", f"{tag}@{global_step}", float(value)))

    def add_embedding(self, mat: Any, metadata: Any = None, tag: str = "", **kwargs: Any) -> None:
        self.calls.append(("embedding", tag, (np.asarray(mat, dtype=np.float64), metadata)))


def _not_exact(store: Any) -> bool:
    return False  # as a projected store: influence_rows refines (calls recompute)


def _report(rank: int, world: int, out: Path) -> str:
    """The report pass on this rank, with a writer and a recompute that records its calls; pickle what it got."""
    influence_table.passes_exact = _not_exact  # forked: this process only
    calls: list[tuple[str, list[int], str]] = []

    def recompute(split: str, ids: Any, checkpoint: str) -> Any:
        calls.append((split, list(ids), checkpoint))
        raise RuntimeError("recorded")  # influence_rows keeps the estimates

    writer = RecordingWriter()
    store = open_distributed_store(out.parent / "store")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = report_run(
            store, out / f"reports-{rank}", [writer], k=5, recompute=recompute, influence_method="tracin"
        )
    (out / f"got{rank}.pkl").write_bytes(pickle.dumps({"result": result, "writer": writer.calls, "calls": calls}))
    return "done"


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_ddp_store(tmp_path_factory.mktemp("ddp-report") / "store")


@pytest.fixture(scope="module")
def ranks(store_dir: Path) -> list[dict[str, Any]]:
    out = store_dir.parent / "out"
    shutil.rmtree(store_dir / "sketches", ignore_errors=True)  # another test's pass may have cached them: compute
    results = run_ranks(_report, 2, out)
    for rank in (0, 1):
        assert results.get(rank, {}).get("ok") == "done", results.get(rank)
    return [pickle.loads((out / f"got{r}.pkl").read_bytes()) for r in (0, 1)]


@pytest.fixture(scope="module")
def alone(store_dir: Path, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The single-process report pass, after the partitioned one (same estimates path)."""
    writer = RecordingWriter()
    saved, influence_table.passes_exact = influence_table.passes_exact, _not_exact
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = report_run(
                store_dir, store_dir.parent / "alone", [writer], k=5, recompute=_raise, influence_method="tracin"
            )  # TracIn: the method the refinement recomputes
    finally:
        influence_table.passes_exact = saved
    assert result is not None
    return {"result": result, "writer": writer.calls}


def _raise(split: str, ids: Any, checkpoint: str) -> Any:
    raise RuntimeError("recorded")


def test_rank_zero_writes_the_single_process_tables(
    store_dir: Path, ranks: list[dict[str, Any]], alone: dict[str, Any]
) -> None:
    got, expected = ranks[0]["result"], alone["result"]
    assert_tables_match(store_dir, got, expected)
    assert all(row["exact"] is False for row in got["influence"])  # the refinement failed on purpose, as alone
    assert read_tables(store_dir.parent / "out" / "reports-0") == {k: got[k] for k in ("outliers", "influence")}
    names = sorted(Path(f).name for f in got["files"])
    assert names == sorted(Path(f).name for f in expected["files"])
    assert not (store_dir.parent / "out" / "reports-1").exists()  # rank 1 wrote no file


def test_rank_zero_logs_the_single_process_events(ranks: list[dict[str, Any]], alone: dict[str, Any]) -> None:
    got, expected = ranks[0]["writer"], alone["writer"]
    assert [(kind, tag) for kind, tag, _ in got] == [(kind, tag) for kind, tag, _ in expected]
    for (kind, tag, value), (_, _, want) in zip(got, expected):
        if kind == "scalar":
            assert abs(value - want) <= RTOL * max(1.0, abs(want)), tag
        elif kind == "histogram":
            assert_close(value, want)
        elif kind == "embedding":
            assert_close(value[0], want[0])
            assert value[1] == want[1]
    assert {"embedding", "scalar", "histogram", "text"} <= {kind for kind, _, _ in got}
    assert ranks[1]["writer"] == []  # rank 1's writer is ignored
    assert ranks[1]["result"].keys() == {"partition"}


def test_every_rank_scored_its_share_and_only_rank_zero_refined(ranks: list[dict[str, Any]]) -> None:
    shares = [r["result"]["partition"] for r in ranks]
    assert_shares(shares)
    names = [q["query"] for q in shares[0]["queries"]]
    assert "norms of 'train'" in names and "sketches of 'epoch-1/train'" in names  # the writers' views
    assert ranks[0]["calls"] and ranks[1]["calls"] == []  # the model runs on rank 0 only


def _failing(how: str) -> Any:
    def worker(rank: int, world: int, out: Path) -> str:
        store = open_distributed_store(out.parent / "store")
        if rank == 1 and how == "rank 1 dies scoring":
            queries.dot_blocks = lambda *a, **k: os._exit(3)  # killed mid-pass, no goodbye
        writers = [RecordingWriter(fail=rank == 0 and how == "rank 0 fails writing")]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                report_run(store, out / f"reports-{rank}", writers, k=5)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "finished"

    return worker


@pytest.mark.parametrize("how", ["rank 1 dies scoring", "rank 0 fails writing"])
def test_a_failing_rank_does_not_hang_the_other(store_dir: Path, how: str) -> None:
    out = store_dir.parent / f"out-{how.replace(' ', '-')}"
    results = run_ranks(_failing(how), 2, out, timeout_s=3, wait_s=40)
    if how == "rank 1 dies scoring":
        assert 1 not in results
        message = results[0]["ok"]
        assert message.startswith("DistributedQueryError") and "rank(s) 1 never reached it" in message, message
    else:  # rank 0 writes after the last collective: rank 1 is done by then
        assert results[1]["ok"] == "finished"
        assert results[0]["ok"] == "OSError: disk full"
