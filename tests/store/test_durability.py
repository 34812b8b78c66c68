"""Durability bounded in time: the writer's timer (``flush_seconds``) and ``flush(wait=False)`` put an idle
writer's batches on disk without any flush() call, as small shards that the store lists."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from storecases import synthetic_batch

from metastore_plugins import StoreWriter, open_store

DEADLINE = 30.0  # seconds a poll waits at most: generous, so that a loaded machine does not fail the tests


def _write(writer: StoreWriter, steps: range, size: int = 4) -> None:
    for step in steps:
        records, _ = synthetic_batch(step, size)
        writer.write(records, sample_ids=torch.arange(size) + size * step, step=step)


def _poll(condition: Callable[[], bool]) -> float:
    """Seconds until ``condition()`` holds (fails after :data:`DEADLINE`)."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < DEADLINE, "the writer did not write in time"
        time.sleep(0.01)
    return time.monotonic() - start


def test_the_timer_writes_an_idle_writers_batches_without_flush(tmp_path: Path) -> None:
    writer = StoreWriter(tmp_path, encoding="fp32", flush_seconds=0.5)
    try:
        start = time.monotonic()
        _write(writer, range(3))
        _poll(lambda: writer.stats.shards >= 1)
        assert time.monotonic() - start >= 0.25  # not before half of flush_seconds after the first batch
        store = open_store(tmp_path)  # no flush() and no close(): what a killed run would leave
        assert store.steps("train") == [0, 1, 2]
        assert sorted(store.sample_ids("train").tolist()) == list(range(12))
        assert store.verify() == []
        assert writer.stats.timer_shards == writer.stats.shards == 1  # one small shard for the three batches
        _write(writer, range(3, 5))  # the timer starts again for the next batches
        _poll(lambda: writer.stats.shards >= 2)
        assert open_store(tmp_path).steps("train") == [0, 1, 2, 3, 4]
        assert writer.stats.timer_shards == 2
    finally:
        writer.close()


def test_no_timer_without_flush_seconds(tmp_path: Path) -> None:
    with StoreWriter(tmp_path, encoding="fp32", flush_seconds=None) as writer:
        _write(writer, range(3))
        time.sleep(0.5)  # no synchronization: asserts that nothing happened in this time (the old behaviour)
        assert writer.stats.shards == 0
    assert writer.stats.shards == 1 and writer.stats.timer_shards == 0  # close() wrote them


def test_flush_without_waiting_returns_at_once_and_the_shard_follows(tmp_path: Path) -> None:
    with StoreWriter(tmp_path, encoding="fp32", flush_seconds=None) as writer:
        _write(writer, range(4))
        start = time.monotonic()
        writer.flush(wait=False)
        assert (
            time.monotonic() - start < 1.0
        )  # it only queued a request (a write takes milliseconds, but is not waited)
        _poll(lambda: writer.stats.shards >= 1)
        assert open_store(tmp_path).steps("train") == [0, 1, 2, 3]
        assert writer.stats.timer_shards == 0
        writer.flush(wait=False)  # nothing held: no empty shard
        writer.flush()
        assert writer.stats.shards == 1


def test_a_blocking_flush_writes_everything_queued(tmp_path: Path) -> None:
    with StoreWriter(tmp_path, encoding="fp32", flush_seconds=60.0) as writer:
        _write(writer, range(2))
        writer.flush()
        assert open_store(tmp_path).steps("train") == [0, 1] and writer.stats.timer_shards == 0


@pytest.mark.parametrize("value", [0, -1.0, math.inf, math.nan, True, "10", [1.0]])
def test_invalid_flush_seconds_raise_naming_the_argument(tmp_path: Path, value: object) -> None:
    with pytest.raises(ValueError, match="flush_seconds"):
        StoreWriter(tmp_path, flush_seconds=value)  # type: ignore[arg-type]
