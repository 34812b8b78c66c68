"""MetaStoreCallback: dict batches, wrong configurations that fail early, resuming into the same store."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset

L = pytest.importorskip("lightning")
pytest.importorskip("tensorboard")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402
from lightning_cases import D_IN, Classifier, DictClassifier, DictData, fit, loaders, make_data  # noqa: E402

from metastore_plugins import MetaStoreCallback, open_store  # noqa: E402
from metastore_plugins.core.errors import SampleIdError  # noqa: E402


def test_dict_batches_with_an_idx_field_need_no_wrapper(tmp_path: Path) -> None:
    base = make_data(20, 1)
    train = DataLoader(DictData(base), batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(3))
    callback = MetaStoreCallback(dirpath=tmp_path / "store", checkpoint_train_samples=8, reports=False)
    fit(tmp_path, DictClassifier(), train, None, [callback], max_epochs=1)
    store = open_store(tmp_path / "store")
    meta = store.metadata("train")
    assert sorted(meta["sample_id"].tolist()) == list(range(20))
    np.testing.assert_array_equal(meta["label"], base.tensors[1][meta["sample_id"]].numpy())
    assert store.capture_points() == ["epoch-0/train", "train"]  # no val loader: no val pass
    assert len(store.sample_ids("epoch-0/train")) == 8
    assert not (tmp_path / "store" / "reports").exists()


@pytest.mark.parametrize("workers", [0, 2])
def test_plain_datasets_get_their_ids_from_the_sampler(tmp_path: Path, workers: int) -> None:
    """No wrapper: ids come from the index lists the loader's sampler drew (workers prefetch ahead)."""
    base = make_data(30, 1)
    order = torch.Generator().manual_seed(3)
    train = DataLoader(base, batch_size=4, shuffle=True, drop_last=True, num_workers=workers, generator=order)
    callback = MetaStoreCallback(
        dirpath=tmp_path / "store", encoding="fp32", reports=False, checkpoint_every_n_epochs=0
    )
    module = Classifier(lr=0.0)
    fit(tmp_path, module, train, None, [callback], max_epochs=2)
    store = open_store(tmp_path / "store")
    meta = store.metadata("train")
    for epoch in (0, 1):
        ids = meta["sample_id"][meta["epoch"] == epoch].tolist()
        assert len(ids) == 28 == len(set(ids))
    np.testing.assert_array_equal(meta["label"], base.tensors[1][meta["sample_id"]].numpy())
    losses = F.cross_entropy(module(base.tensors[0]), base.tensors[1], reduction="none").detach()
    np.testing.assert_allclose(meta["loss"], losses[meta["sample_id"]].numpy(), rtol=1e-5)


class _Stream(IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        yield from zip(torch.randn(16, D_IN, generator=g), torch.randint(0, 3, (16,), generator=g))


def test_batches_without_recoverable_ids_fail_naming_indexed_dataset(tmp_path: Path) -> None:
    train = DataLoader(_Stream(), batch_size=8)  # fails at the first batch
    with pytest.raises(SampleIdError, match="IndexedDataset"):
        fit(tmp_path, Classifier(), train, None, [MetaStoreCallback(dirpath=tmp_path / "s")], max_epochs=1)
    no_sampler = DataLoader(make_data(8, 1), batch_size=None)  # fails at on_train_start, before training
    module = Classifier()
    with pytest.raises(SampleIdError, match="IndexedDataset"):
        fit(tmp_path, module, no_sampler, None, [MetaStoreCallback(dirpath=tmp_path / "s")], max_epochs=1)
    assert module.trainer.global_step == 0


def test_wrong_settings_fail_at_setup_naming_the_setting(tmp_path: Path) -> None:
    train, _ = loaders(16, 4, 8)
    with pytest.raises(ValueError, match="dirpath"):
        fit(tmp_path, Classifier(), train, None, [MetaStoreCallback()], logger=False, max_epochs=1)
    with pytest.raises(ValueError, match=r"modules=.*'nope'"):
        fit(tmp_path, Classifier(), train, None, [MetaStoreCallback(modules=["nope"])], max_epochs=1)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match=r"dirpath"):
        fit(
            tmp_path,
            Classifier(),
            train,
            None,
            [MetaStoreCallback(dirpath=tmp_path / "a-file" / "store")],
            max_epochs=1,
        )
    manual = Classifier()
    manual.automatic_optimization = False
    with pytest.raises(ValueError, match="automatic_optimization"):
        fit(tmp_path, manual, train, None, [MetaStoreCallback()], max_epochs=1)
    with pytest.raises(ValueError, match="loss_reduction"):
        MetaStoreCallback(loss_reduction="none")
    with pytest.raises(
        ValueError, match=r"MetaStoreCallback\(encoding=\.\.\.\) must be one of fp32, fp16, bf16, int8; got 'float16'"
    ):
        MetaStoreCallback(encoding="float16")
    with pytest.raises(ValueError, match=r"MetaStoreCallback\(unsupported=\.\.\.\) must be one of warn, error, skip"):
        MetaStoreCallback(unsupported="ignore")
    with pytest.raises(
        ValueError, match=r"MetaStoreCallback\(modules=\.\.\.\) takes a list of module paths; write \['net'\]"
    ):
        MetaStoreCallback(modules="net")


def test_checkpoint_passes_do_not_log_and_evaluation_loops_see_plain_items(tmp_path: Path) -> None:
    train, val = loaders(16, 4, 8)
    module = Classifier()
    trainer = fit(tmp_path, module, train, val, [MetaStoreCallback(reports=False)], max_epochs=1)
    assert set(trainer.callback_metrics) == {"train_loss", "val_loss"}
    module.test_step = module.validation_step
    trainer.test(module, val, verbose=False)  # `x, y = batch` in the step: the index was removed


def test_resuming_from_a_checkpoint_continues_the_same_store(tmp_path: Path) -> None:
    train, val = loaders(24, 6, 8)
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    first = MetaStoreCallback(checkpoint_train_samples=10, seed=3)
    fit(tmp_path, Classifier(), train, val, [first, saver], max_epochs=1, enable_checkpointing=True)
    second = MetaStoreCallback(checkpoint_train_samples=10, seed=99)  # state from the checkpoint wins
    trainer = L.Trainer(
        max_epochs=2,
        callbacks=[second, ModelCheckpoint(dirpath=tmp_path / "ckpt")],
        logger=TensorBoardLogger(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Classifier(), train, val, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert Path(trainer.log_dir) != first.dirpath.parent  # a new logger version ...
    assert second.dirpath == first.dirpath  # ... and the same store
    store = open_store(first.dirpath)
    meta = store.metadata("train")
    assert meta["epoch"].tolist() == [0] * 24 + [1] * 24
    assert meta["step"].tolist() == [s for s in range(6) for _ in range(8)]
    assert store.sample_ids("epoch-0/train").tolist() == store.sample_ids("epoch-1/train").tolist()
    assert len(store.sample_ids("epoch-1/train")) == 10
    assert store.verify() == []


class _Regressor(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(D_IN, 1)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self(batch[0]).squeeze(1), batch[1])


def test_a_regression_with_its_own_per_sample_loss_is_stored_and_reported(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, D_IN, generator=g)
    train = DataLoader(torch.utils.data.TensorDataset(x, x.sum(1)), batch_size=8, shuffle=True, generator=g)
    callback = MetaStoreCallback(per_sample_loss=lambda out, batch: (out.squeeze(1) - batch[1]) ** 2)
    fit(tmp_path, _Regressor(), train, None, [callback], max_epochs=1)
    store = open_store(callback.dirpath)
    assert sorted(store.sample_ids("train").tolist()) == list(range(16)) and store.verify() == []
    meta = store.metadata("train")
    np.testing.assert_allclose(meta["label"], x.sum(1)[meta["sample_id"]].numpy(), rtol=1e-6)
    assert (meta["prediction"] == -1).all()  # no class predictions for a (B, 1) output
    assert (callback.dirpath / "reports" / "outliers.md").is_file()
