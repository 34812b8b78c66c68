"""A rank that dies or hangs mid-query: the others raise an error naming it, within the group's timeout."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from ddp_store import run_ranks, write_ddp_store

from metastore_plugins.core.analysis import queries
from metastore_plugins.core.distributed import open_distributed_store, partitioned_influence
from metastore_plugins.core.errors import DistributedQueryError

pytestmark = [pytest.mark.slow, pytest.mark.torchrun]  # forked gloo ranks (run_ranks)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_ddp_store(tmp_path_factory.mktemp("ddp-fail") / "store")


def _failing_rank(how: str) -> Any:
    def worker(rank: int, world: int, out: Path) -> str:
        store = open_distributed_store(out.parent / "store")
        if rank == 1:

            def broken(*args: Any, **kwargs: Any) -> Any:
                if how == "dies":
                    os._exit(3)  # killed mid-query: no exception, no goodbye
                time.sleep(120)  # stuck (a hung read, a deadlock)

            queries.dot_blocks = broken
        start = time.monotonic()
        try:
            partitioned_influence(store, "epoch-0/train", "epoch-0/val")
        except DistributedQueryError as exc:
            return f"raised after {time.monotonic() - start:.1f} s: {exc}"
        return "finished"

    return worker


@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_the_other_ranks_raise_naming_the_rank(store_dir: Path, how: str) -> None:
    out = store_dir.parent / f"out-{how}"
    results = run_ranks(_failing_rank(how), 3, out, timeout_s=3, wait_s=30, stuck=1)  # a 3 s collective timeout
    assert 1 not in results  # the failing rank left nothing
    for rank in (0, 2):
        message = results[rank].get("ok", results[rank])
        assert isinstance(message, str) and message.startswith("raised after "), message
        assert f"rank {rank}:" in message and "rank(s) 1 never reached it" in message, message
        seconds = float(message.split()[2])
        assert seconds < 3 + 2 + 5, message  # the timeout, the grace to read who is missing, a loaded machine
