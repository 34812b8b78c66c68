"""The framework-free pieces the callbacks share: ids, labels, schedules, TensorBoard sink."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("tensorboard")
pytest.importorskip("matplotlib")

from metastore_plugins.core.errors import SampleIdError  # noqa: E402
from metastore_plugins.core.model.losses import default_labels, default_per_sample_loss  # noqa: E402
from metastore_plugins.core.model.pass_sources import CheckpointSchedule, indexed_batches, rank_share  # noqa: E402
from metastore_plugins.core.model.sample_ids import IndexedDataset, take_sample_ids  # noqa: E402
from metastore_plugins.core.reports.render import scatter_figure  # noqa: E402
from metastore_plugins.core.reports.tensorboard import summary_writer, write_tensorboard  # noqa: E402


def test_indexed_dataset_items_carry_the_index_and_lose_it_again() -> None:
    data = TensorDataset(torch.arange(10.0)[:, None], torch.arange(10) % 3)
    batch = next(
        iter(DataLoader(IndexedDataset(data), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0)))
    )
    ids = take_sample_ids(batch, strip=True)
    assert len(batch) == 2 and torch.equal(batch[0][:, 0].long(), ids) and torch.equal(batch[1], ids % 3)
    dicts = [{"x": torch.tensor([float(i)]), "labels": i % 2} for i in range(6)]
    dict_batch = next(iter(DataLoader(IndexedDataset(dicts), batch_size=6)))
    assert take_sample_ids(dict_batch, strip=True).tolist() == list(range(6)) and "sample_id" not in dict_batch
    assert take_sample_ids({"idx": torch.tensor([4, 2])}, strip=False).tolist() == [4, 2]
    assert take_sample_ids([torch.zeros(2), torch.zeros(2)], strip=False) is None
    with pytest.raises(SampleIdError, match="collate_fn"):
        take_sample_ids((torch.zeros(2), torch.zeros(2)), strip=True)


def test_default_labels_and_loss_fail_naming_the_argument() -> None:
    assert torch.equal(default_labels((torch.zeros(2), torch.tensor([1, 0]))), torch.tensor([1, 0]))
    assert default_labels({"labels": 3}) == 3
    with pytest.raises(ValueError, match=r"labels=callable\(batch\)"):
        default_labels((1, 2, 3))
    with pytest.raises(ValueError, match="per_sample_loss="):
        default_per_sample_loss(torch.zeros(()), torch.tensor([1, 0]))
    losses = default_per_sample_loss({"logits": torch.zeros(2, 4)}, torch.tensor([1, 0]))
    torch.testing.assert_close(losses, torch.full((2,), float(np.log(4))))


def test_checkpoint_subset_is_bounded_seeded_and_fixed() -> None:
    schedule = CheckpointSchedule(every_n_epochs=2, train_samples=5, seed=1)
    first = schedule.train_subset(100)
    assert len(first) == 5 == len(set(first)) and first == sorted(first) and schedule.train_subset(100) is first
    assert CheckpointSchedule(train_samples=5, seed=1).train_subset(100) == first
    assert [schedule.due(e) for e in range(4)] == [False, True, False, True]
    assert rank_share(list(range(7)), 1, 2) == [1, 3, 5]
    batches = list(indexed_batches(IndexedDataset(TensorDataset(torch.arange(10) * 10)), [7, 2, 5], 2))
    assert [ids.tolist() for ids, _ in batches] == [[7, 2], [5]]
    assert batches[0][1][0].tolist() == [70, 20]  # the wrapped dataset's items, without the wrapper's index


class FakeWriter:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def add_text(self, tag, text, step=None):
        self.calls.append(("text", tag))

    def add_histogram(self, tag, values, step=None):
        self.calls.append(("histogram", tag))

    def add_figure(self, tag, figure, step=None, close=True):
        assert figure.axes and figure.axes[0].get_title()
        self.calls.append(("figure", tag))


def test_tensorboard_sink_writes_tables_histograms_and_a_scatter(tmp_path: Path) -> None:
    points = {"sample_id": np.arange(3), "self_influence": np.array([1.0, 3.0, np.nan]), "label": np.array([0, 1, 1])}
    figure = scatter_figure({**points, "loss": np.array([0.1, 2.0, 1.0])}, title="t")
    assert figure.axes[0].get_title() == "t" and len(figure.axes[0].collections) == 2
    table = {
        "sample_id": np.arange(4),
        "self_influence": np.array([1.0, 2, 3, 4]),
        "label": np.array([0, 0, 1, 1]),
        "loss": np.array([0.1, 0.2, 0.3, 0.4]),
    }
    writer = FakeWriter()
    tags = write_tensorboard(writer, {"outliers": [{"rank": 1, "sample_id": 3}], "influence": []}, table, step=5)
    assert tags == [
        "metastore/outliers",
        "metastore/self_influence/class_0",
        "metastore/self_influence/class_1",
        "metastore/loss_vs_self_influence",
    ]
    real = summary_writer(tmp_path)
    write_tensorboard(real, {"outliers": [{"rank": 1}]}, table)
    real.close()
    assert list(tmp_path.glob("events.out.tfevents.*"))


class _Scaler:
    def get_scale(self) -> float:
        return 1.0


def test_run_capture_skips_overflowed_fp16_steps_and_writes_the_rest(tmp_path: Path) -> None:
    from metastore_plugins import open_store
    from metastore_plugins.core.training.run import RunCapture

    model = torch.nn.Linear(3, 2)
    g = torch.Generator().manual_seed(0)
    run = RunCapture(tmp_path, encoding="fp32", labels=lambda batch: batch[1])
    try:
        for step, blow_up in enumerate((False, True, False)):
            x = torch.randn(4, 3, generator=g)
            run.begin_step(model, grad_scaler=_Scaler())
            logits = model(x)
            # the step that overflows has every sample misclassified: its gradient, scaled by 1e38 * 1e38, is
            # infinite whatever the data (a correctly classified sample's gradient would vanish at this scale)
            y = 1 - logits.argmax(1) if blow_up else torch.tensor([0, 1, 1, 0])
            loss = torch.nn.functional.cross_entropy(logits * (1e38 if blow_up else 1.0), y) * (
                1e38 if blow_up else 1.0
            )
            loss.backward()
            run.end_backward()
            run.finish_step((x, y), torch.arange(4) + 10 * step, step=step)
    finally:
        run.close()
    assert run.skipped_steps == 1
    assert open_store(tmp_path).steps("train") == [0, 2]


def test_run_capture_hooks_once_ignores_forwards_between_steps_and_unhooks_on_close(tmp_path: Path) -> None:
    from metastore_plugins import open_store
    from metastore_plugins.core.training.run import RunCapture
    from metastore_plugins.testing import max_relative_error, reference_per_sample_gradients

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, generator=g), torch.randint(0, 2, (4,), generator=g)) for _ in range(3)]
    run = RunCapture(tmp_path, encoding="fp32")
    try:
        for step, (x, y) in enumerate(batches):
            run.begin_step(model, loss_scale=0.5)
            (torch.nn.functional.cross_entropy(model(x), y) * 0.5).backward()
            run.end_backward()
            run.finish_step((x, y), torch.arange(4) + 10 * step, step=step)
            hooks = sum(len(m._forward_hooks) for m in model.modules())
            torch.nn.functional.cross_entropy(model(x), y).backward()  # e.g. user code between steps: not captured
        assert hooks == sum(len(m._forward_hooks) for m in model.modules()) > 0  # hooked once, kept
    finally:
        run.close()
    assert sum(len(m._forward_hooks) for m in model.modules()) == 0
    store = open_store(tmp_path)
    assert store.steps("train") == [0, 1, 2] and len(store.sample_ids("train")) == 12
    for step, (x, y) in enumerate(batches[-1:], start=2):
        expected = reference_per_sample_gradients(
            model, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]), (x, y)
        )
        # the weights did not change (no optimizer step), so every step's gradients are those of the same model
        restored = {
            name: torch.stack([store.restore(10 * step + i, capture_point="train", step=step)[name] for i in range(4)])
            for name in expected
        }
        assert max_relative_error(restored, expected) <= 1e-5
