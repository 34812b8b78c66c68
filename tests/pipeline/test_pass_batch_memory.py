"""Checkpoint-pass batches cut so that their exact factors fit ``PASS_BATCH_BYTES``, the gradients unchanged.

Reference: ``torch.func`` per-sample gradients of each pass sample at the pass's weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from metastore_plugins import open_store
from metastore_plugins.core.model import pass_sources
from metastore_plugins.core.model.pass_sources import PassSource, within_memory
from metastore_plugins.core.policy.budget import Budget
from metastore_plugins.core.training.run import RunCapture
from metastore_plugins.testing import reference_per_sample_gradients


def loss_fn(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


def test_within_memory_cuts_batches_once_a_sample_is_measured() -> None:
    sources = [PassSource("train", None, [0, 1], 32), PassSource("val", None, [0], 64)]
    assert within_memory(sources, 0.0) == sources  # nothing measured yet
    cut = within_memory(sources, 3.0 * 2**20, max_bytes=100 * 2**20)
    assert [s.batch_size for s in cut] == [32, 33] and [s.split for s in cut] == ["train", "val"]
    assert [s.batch_size for s in within_memory(sources, 1e12)] == [1, 1]


def test_a_pass_in_cut_batches_keeps_each_samples_gradient(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(10, 5, generator=g), torch.randint(0, 3, (10,), generator=g)
    run = RunCapture(tmp_path, encoding="fp32", budget=Budget("exact", None), labels=lambda batch: batch[1])
    try:
        run.begin_step(model)  # one training step: the plan measures a sample's factor bytes
        F.cross_entropy(model(x[:4]), y[:4]).backward()
        run.end_backward()
        run.finish_step((x[:4], y[:4]), torch.arange(4), step=0)
        model.zero_grad()
        monkeypatch.setattr(pass_sources, "PASS_BATCH_BYTES", 3 * run.policy.factor_sample_bytes)

        def loss_of(batch: Any, k: int) -> Tensor:
            return F.cross_entropy(model(batch[0]), batch[1])

        source = PassSource("train", TensorDataset(x, y), list(range(10)), 10)
        run.checkpoint_passes(model, [source], loss_of, name="epoch-0", rank=0, world_size=1,
                              to_device=lambda b: b, step=1, epoch=0, lr=0.1)  # fmt: skip
    finally:
        run.close()
    store = open_store(tmp_path)
    selection = store.select("epoch-0/train")
    assert [batch.size for batch in selection.batches()] == [3, 3, 3, 1]  # 10 samples in batches of 3
    assert selection.sample_ids().tolist() == list(range(10))
    expected = reference_per_sample_gradients(model, loss_fn, {"x": x, "y": y})
    reference = torch.sqrt(sum(g.reshape(10, -1).pow(2).sum(1) for g in expected.values()))  # (10,) ||g_i||
    np.testing.assert_allclose(store.norms("epoch-0/train"), reference.numpy(), rtol=1e-5)
