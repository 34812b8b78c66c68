"""Shared pieces of the shard reader tests: real shards of every record kind, prompt refusals, no fd leaks."""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from safetensors import safe_open

from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.records import LayerRecord, dense_record
from metastore_plugins.core.store.shards.encoding import check_encoding
from metastore_plugins.core.store.shards.shardfile import write_shard
from metastore_plugins.core.store.shards.shardread import (
    ShardData,
    ShardExpectation,
    expected_keys,
    read_shard,
    shard_problem,
)

ENCODINGS = ("fp32", "fp16", "int8", "bf16")
#: Seconds within which every refusal must come back (a FIFO opened for reading would block forever).
PROMPT = 5.0
T = TypeVar("T")


def _within(seconds: float, fn: Callable[[], T]) -> T:
    """``fn()`` run in a daemon thread: its result or exception, failing the test if it has not returned."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed back to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"blocked for more than {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def _batches(seed: int) -> list[tuple[list[LayerRecord], dict[str, torch.Tensor]]]:
    """Two batches: outer (with rows, and with none), embedding and dense records, metadata columns."""
    g = torch.Generator().manual_seed(seed)
    outer = LayerRecord(
        layer="fc",
        kind="outer",
        batch_size=3,
        params={"weight": "fc.weight", "bias": "fc.bias"},
        param_shapes={"weight": (4, 5), "bias": (4,)},
        tensors={
            "prefix": torch.randn(5, 1, 5, generator=g),  # (R, G, d_in)
            "suffix": torch.randn(5, 1, 4, generator=g),  # (R, G, d_out)
            "sample": torch.tensor([0, 0, 1, 2, 2], dtype=torch.int32),
            "position": torch.arange(5, dtype=torch.int32),
        },
    )
    empty = LayerRecord(  # every row dropped: zero-row tensors, and (fp16, int8) zero-row scales
        layer="unused",
        kind="outer",
        batch_size=3,
        params={"weight": "unused.weight"},
        param_shapes={"weight": (2, 3)},
        tensors={
            "prefix": torch.zeros(0, 1, 3),
            "suffix": torch.zeros(0, 1, 2),
            "sample": torch.zeros(0, dtype=torch.int32),
            "position": torch.zeros(0, dtype=torch.int32),
        },
    )
    embedding = LayerRecord(
        layer="emb",
        kind="embedding",
        batch_size=3,
        params={"weight": "emb.weight"},
        param_shapes={"weight": (10, 4)},
        tensors={
            "ids": torch.tensor([1, 7, 3, 3], dtype=torch.int32),
            "suffix": torch.randn(4, 4, generator=g),  # (R, d)
            "sample": torch.tensor([0, 1, 1, 2], dtype=torch.int32),
            "position": torch.tensor([0, 0, 1, 0], dtype=torch.int32),
        },
    )
    # a role named "scale": grad.scale is data, grad.scale.scale its row scales
    dense = dense_record(
        "ln",
        {"weight": torch.randn(3, 4, generator=g), "scale": torch.randn(3, generator=g)},
        {"weight": "w", "scale": "s"},
    )
    deep = dense_record(
        "conv", {"weight": torch.randn(2, 1, 2, 1, 1, 1, 1, 2, 1, generator=g)}, {"weight": "c"}
    )  # 9 dims
    meta0 = {"sample_id": torch.tensor([7, 8, 9]), "label": torch.tensor([0, 1, 0]), "loss": torch.rand(3, generator=g)}
    return [([outer, empty, embedding, dense], meta0), ([deep], {"sample_id": torch.tensor([10, 11])})]


#: What the index says of :func:`_batches`: per batch, (meta columns, [(kind, roles)]).
DESCRIBED = [
    (("label", "loss"), [("outer", ["weight", "bias"]), ("outer", ["weight"]), ("embedding", ["weight"]),
                         ("dense", ["weight", "scale"])]),
    ((), [("dense", ["weight"])]),
]  # fmt: skip


def _write(path: Path, encoding: str, seed: int = 0) -> ShardExpectation:
    metadata = {"format": "metastore", "encoding": encoding}
    size, sha256, xxh3 = write_shard(path, _batches(seed), check_encoding(encoding), metadata)
    required, optional = expected_keys(DESCRIBED, encoding)
    return ShardExpectation(size, sha256, required, optional, xxh3)


def _reference(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as handle:
        return {key: handle.get_tensor(key).clone() for key in handle.keys()}


def _assert_same(data: ShardData, reference: dict[str, torch.Tensor]) -> None:
    assert sorted(data.keys()) == sorted(reference)
    for key, want in reference.items():
        got = data.get(key)
        assert (got.dtype, got.shape) == (want.dtype, want.shape), key
        assert torch.equal(got, want), key


def _refused(path: Path, directory: Path, expect: ShardExpectation, pattern: str) -> str:
    """The one-line message ``read_shard`` refuses with, promptly, also given by ``shard_problem``."""
    with pytest.raises(StoreError) as raised:
        _within(PROMPT, lambda: read_shard(path, directory, expect))
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"{path}: "), message
    problem = message[len(f"{path}: ") :]
    assert re.search(pattern, problem), problem
    assert _within(PROMPT, lambda: shard_problem(path, directory, expect)) == problem
    return problem


def _good(tmp_path: Path) -> tuple[Path, ShardExpectation]:
    path = tmp_path / "good.safetensors"
    return path, _write(path, "fp32")


@pytest.fixture
def no_leaked_descriptors() -> Iterator[None]:
    """Every refusal closes what it opened."""
    before = set(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else set()
    yield
    if before:
        leaked = set(os.listdir("/proc/self/fd")) - before
        assert not leaked, leaked
