"""What the callbacks run besides training leaves every random number generator as it was.

``preserved_rng`` itself; checkpoint passes (their loader's base seed, a dataset that draws, a
loss that draws); the sampler recorder, which must shuffle exactly as the sampler it wraps.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core.model.pass_sources import PassSource, indexed_batches
from metastore_plugins.core.model.rng import RngState, preserved_rng
from metastore_plugins.core.model.sample_ids import record_sampler_ids
from metastore_plugins.core.training.passes import checkpoint_pass
from metastore_plugins.core.training.run import RunCapture


def _assert_same(a: RngState, b: RngState) -> None:
    assert torch.equal(a.torch_cpu, b.torch_cpu)
    assert (a.cuda is None) == (b.cuda is None)
    assert all(torch.equal(x, y) for x, y in zip(a.cuda or [], b.cuda or [], strict=True))
    assert a.numpy[0] == b.numpy[0] and np.array_equal(a.numpy[1], b.numpy[1]) and a.numpy[2:] == b.numpy[2:]
    assert a.python == b.python


def _draw_from_all() -> None:
    torch.rand(3)
    if torch.cuda.is_available():
        torch.rand(3, device="cuda")
    np.random.rand(3)
    random.random()


def test_preserved_rng_puts_back_every_generator_the_block_drew_from() -> None:
    if torch.cuda.is_available():
        torch.cuda.init()  # CUDA's generators are saved where CUDA is initialised
    before = RngState.capture()
    with preserved_rng():
        _draw_from_all()
        assert not torch.equal(torch.get_rng_state(), before.torch_cpu)  # the block did move them
        assert random.getstate() != before.python
    _assert_same(RngState.capture(), before)
    with pytest.raises(RuntimeError, match="boom"), preserved_rng():
        _draw_from_all()
        raise RuntimeError("boom")
    _assert_same(RngState.capture(), before)
    expected = torch.rand(2), np.random.rand(2), random.random()  # and the next draws are the ones due
    before.restore()
    with preserved_rng():
        _draw_from_all()
    assert torch.equal(torch.rand(2), expected[0]) and np.array_equal(np.random.rand(2), expected[1])
    assert random.random() == expected[2]


class _Augmented(Dataset):
    """Items with noise drawn from torch's and numpy's global generators, as random augmentation does."""

    def __init__(self, base: TensorDataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        x, y = self.base[i]
        return x + 0.01 * torch.randn_like(x) + 0.01 * float(np.random.rand()), y


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Dropout(0.5), nn.Linear(6, 3))


def _data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


def test_indexed_batches_draw_nothing_from_the_global_generator() -> None:
    before = torch.get_rng_state()
    batches = list(indexed_batches(_data(10), [7, 2, 5, 1, 0], batch_size=2))
    assert torch.equal(torch.get_rng_state(), before)  # its loader's base seed comes from a private generator
    assert [ids.tolist() for ids, _ in batches] == [[7, 2], [5, 1], [0]]


def test_checkpoint_passes_leave_every_generator_as_training_left_it(tmp_path: Path) -> None:
    model = _model().train()
    sources = [PassSource("train", _Augmented(_data(10)), list(range(10)), 4), PassSource("val", _data(6), [0, 1], 4)]

    def loss_of(batch: Any, k: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(model(x + 0.01 * torch.randn_like(x)), y)  # a training_step that draws noise

    before = RngState.capture()
    run = RunCapture(tmp_path, encoding="fp32")
    try:
        run.checkpoint_passes(
            model,
            sources,
            loss_of,
            name="epoch-0",
            rank=0,
            world_size=1,
            to_device=lambda b: b,
            step=3,
            epoch=0,
            lr=0.1,
        )
    finally:
        run.close()
    _assert_same(RngState.capture(), before)
    assert model.training
    assert open_store(tmp_path).capture_points() == ["epoch-0/train", "epoch-0/val"]

    x, y = _data(4).tensors  # the functional checkpoint_pass of core.passes too
    with StoreWriter(tmp_path / "functional", encoding="fp32") as writer:
        batches = [(torch.arange(4), lambda: model(x + torch.randn_like(x)), y)]
        per_sample = lambda out, labels: F.cross_entropy(out, labels, reduction="none")  # noqa: E731
        checkpoint_pass(model, batches, per_sample, writer, capture_point="epoch-0/val", step=3)
    _assert_same(RngState.capture(), before)


class _EagerShuffle:
    """A batch sampler that draws its whole order from torch's global generator when ``iter()`` is called."""

    def __init__(self, n: int, batch_size: int) -> None:
        self.n, self.batch_size = n, batch_size

    def __iter__(self) -> Iterator[list[int]]:
        order = torch.randperm(self.n).tolist()
        return iter([order[i : i + self.batch_size] for i in range(0, self.n, self.batch_size)])

    def __len__(self) -> int:
        return -(-self.n // self.batch_size)


@pytest.mark.parametrize("sampling", ["shuffle", "eager batch sampler", "shuffle, 2 workers"])
def test_the_recorder_shuffles_as_the_sampler_it_wraps_and_draws_nothing_more(sampling: str) -> None:
    data = TensorDataset(torch.arange(20))

    def loader() -> DataLoader:
        if sampling == "eager batch sampler":
            return DataLoader(data, batch_sampler=_EagerShuffle(20, 6))
        return DataLoader(data, batch_size=6, shuffle=True, num_workers=2 if "workers" in sampling else 0)

    def epochs(recorded: bool) -> tuple[list[list[int]], list[list[int]], Tensor]:
        torch.manual_seed(5)
        plain = loader()
        recorder = record_sampler_ids(plain) if recorded else None
        seen, ids = [], []
        for _ in range(2):
            for (batch,) in plain:
                seen.append(batch.tolist())
                if recorder is not None:
                    ids.append(recorder.next_ids(len(batch)).tolist())
        return seen, ids, torch.get_rng_state()

    unwrapped, _, state = epochs(recorded=False)
    batches, ids, recorded_state = epochs(recorded=True)
    assert batches == unwrapped and ids == unwrapped  # the same shuffle, and the recorder names it exactly
    assert torch.equal(recorded_state, state)
