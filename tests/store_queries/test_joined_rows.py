"""Influence joins consecutive train batches into one row operand (``queries.dot_blocks``, issue 35).

The store holds padded token sequences: train batches of different sizes, each sample with its own
length (padded rows are pruned, so rows per sample differ), a learning rate per step, spread over
several shards. Scores are compared with an explicit dense matrix ``lr_b G_train G_test^T`` of
torch.func per-sample gradients (float64), whatever the memory budget, and the joined row operands
stay within the budget's quarter.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core.analysis import queries
from metastore_plugins.core.records import LayerRecord
from metastore_plugins.core.training.passes import capture_step
from metastore_plugins.testing import reference_per_sample_gradients

TRAIN_SIZES, TEST_SIZES, TOKENS, D_IN = (3, 5, 2, 4, 6), (3, 4), 6, 12
LRS = (0.5, 0.25, 0.25, 0.125, 1.0)  # two consecutive batches share one: both the scalar and the per-row weights


class MaskedSequence(nn.Module):
    """Linear on padded token sequences (padded rows have zero suffix: pruned), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x)) * mask.unsqueeze(-1)  # (B, T, 16)
        return self.head(h.sum(1) / mask.sum(1, keepdim=True))


def _batch(size: int, seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, TOKENS + 1, (size,), generator=g)  # (B,) each sample's own length
    mask = (torch.arange(TOKENS) < lengths[:, None]).double()  # (B, T)
    x = torch.randn(size, TOKENS, D_IN, generator=g, dtype=torch.float64)  # (B, T, d_in)
    return {"x": x, "mask": mask, "y": torch.randint(0, 3, (size,), generator=g)}


def _loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch["x"], batch["mask"]), batch["y"])


def _flat(grads: dict[str, Tensor]) -> Tensor:
    return torch.cat([grads[name].reshape(grads[name].shape[0], -1) for name in sorted(grads)], 1)  # (B, P)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    """The store and the reference ``(N, M)`` scores ``lr_b <g_i, g_j>`` (float64, torch.func)."""
    path = tmp_path_factory.mktemp("joined") / "store"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = MaskedSequence().double()
    flats: dict[str, list[Tensor]] = {"train": [], "test": []}
    with StoreWriter(path, encoding="fp32", shard_bytes=4000) as writer:
        offset = 0
        for point, sizes in (("train", TRAIN_SIZES), ("test", TEST_SIZES)):
            for k, size in enumerate(sizes):
                batch = _batch(size, 10 * k + len(point))
                ids = torch.arange(size) + offset
                lr = LRS[k] if point == "train" else None
                forward = lambda batch=batch: model(batch["x"], batch["mask"])  # noqa: E731
                loss = lambda out, y: F.cross_entropy(out, y, reduction="none")  # noqa: E731
                capture_step(model, forward, batch["y"], ids, loss, writer, step=k, capture_point=point, lr=lr)
                model.zero_grad()
                flats[point].append(_flat(reference_per_sample_gradients(model, _loss, batch)))  # (B, P)
                offset += size
    train, test = torch.cat(flats["train"]), torch.cat(flats["test"])  # (N, P), (M, P)
    lrs = torch.tensor(np.repeat(LRS, TRAIN_SIZES))  # (N,) each train sample's batch lr
    return path, ((lrs[:, None] * train) @ test.T).numpy()  # (N, M)


def _row_operands(monkeypatch: pytest.MonkeyPatch) -> list[Sequence[LayerRecord]]:
    """The row records of every ``total_dots`` call the queries make (recorded, then computed as usual)."""
    seen: list[Sequence[LayerRecord]] = []
    original = queries.ops.total_dots

    def recorded(records_a: Sequence[LayerRecord], records_b: Sequence[LayerRecord], *args: Any) -> Tensor:
        seen.append(records_a)
        return original(records_a, records_b, *args)

    monkeypatch.setattr(queries.ops, "total_dots", recorded)
    return seen


def test_the_store_has_batches_of_different_sizes_and_rows_per_sample(written: tuple[Path, np.ndarray]) -> None:
    store = open_store(written[0])
    batches = list(store.select("train").batches())
    assert [b.size for b in batches] == list(TRAIN_SIZES)
    assert len(list(written[0].glob("*.safetensors"))) > 2
    outer = [r for b in batches for r in b.records if r.kind == "outer"]
    assert outer, "an outer record"
    rows = torch.cat([torch.bincount(r.tensors["sample"].long(), minlength=r.batch_size) for r in outer])  # (ΣB,)
    assert len(set(rows.tolist())) > 1  # padded rows pruned: samples differ in rows


@pytest.mark.parametrize("max_bytes", [1, 1 << 30], ids=["batch-by-batch", "all-joined"])
def test_joined_batches_score_as_the_dense_matrix(
    written: tuple[Path, np.ndarray], max_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, reference = written
    calls = _row_operands(monkeypatch)
    scores = open_store(path).influence("train", "test", max_bytes=max_bytes)
    assert scores.row_ids.tolist() == list(range(sum(TRAIN_SIZES)))
    scale = np.abs(reference).max()
    np.testing.assert_allclose(scores.scores, reference, rtol=1e-5, atol=1e-6 * scale)
    sizes = [records[0].batch_size for records in calls]  # the first batch alone, then runs within the budget
    if max_bytes > 1:  # one column chunk: each run against each test batch
        assert sizes == [n for n in (TRAIN_SIZES[0], sum(TRAIN_SIZES[1:])) for _ in TEST_SIZES]
    else:  # a column chunk per test batch: every row batch alone against it
        assert sizes == list(TRAIN_SIZES) * len(TEST_SIZES)


def test_joined_and_batch_by_batch_scores_agree_and_stay_within_the_budget(
    written: tuple[Path, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = written
    store = open_store(path)
    batch_bytes = [sum(r.nbytes for r in b.records) for b in store.select("train").batches()]
    budget = 4 * (batch_bytes[0] + batch_bytes[1])  # a quarter of it holds the first two batches
    joined = _row_operands(monkeypatch)
    some = store.influence("train", "test", max_bytes=budget)
    monkeypatch.undo()
    one = store.influence("train", "test", max_bytes=1)
    scale = np.abs(one.scores).max()
    np.testing.assert_allclose(some.scores, one.scores, rtol=1e-5, atol=1e-6 * scale)
    assert max(records[0].batch_size for records in joined) > max(TRAIN_SIZES)  # some batches were joined ...
    assert all(sum(r.nbytes for r in records) <= budget // 4 for records in joined)  # ... within a quarter
