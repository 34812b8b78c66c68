"""A second, fresh ``fit`` into a directory that holds a store is refused (or, with ``overwrite=True``, the old
store is moved aside, byte for byte); a resumed ``fit(ckpt_path=...)`` continues the store. Also: tags set
before ``fit``, and the learning rate the automatic ``epoch-N`` tags record."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning")
pytest.importorskip("tensorboard")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402
from lightning_cases import Classifier, fit, loaders  # noqa: E402
from reruncases import file_hashes as _files  # noqa: E402
from reruncases import stored_counts as _counts  # noqa: E402

from metastore_plugins import CaptureSession, MetaStoreCallback, StoreWriter, open_store  # noqa: E402
from metastore_plugins.cli import main  # noqa: E402
from metastore_plugins.core.errors import ExistingStoreError  # noqa: E402
from metastore_plugins.core.store.reading.runs import repeated_batches  # noqa: E402
from metastore_plugins.core.store.tags.book import read_tags  # noqa: E402
from metastore_plugins.core.training.adapter_support import open_run  # noqa: E402
from metastore_plugins.core.training.run_start import Decision, claim_store_dir  # noqa: E402

N_TRAIN = 24


def _callback(store: Path, **settings: object) -> MetaStoreCallback:
    return MetaStoreCallback(store, reports=False, checkpoint_train_samples=8, **settings)  # type: ignore[arg-type]


def test_a_second_fresh_fit_into_the_same_dirpath_is_refused_and_the_store_is_untouched(tmp_path: Path) -> None:
    train, val = loaders(N_TRAIN, 6, 8)
    store = tmp_path / "store"
    fit(tmp_path, Classifier(), train, val, [_callback(store)], max_epochs=1)
    assert _counts(store) == dict.fromkeys(range(N_TRAIN), 1)
    before = _files(store)
    module = Classifier()
    with pytest.raises(ExistingStoreError) as refused:
        fit(tmp_path, module, train, val, [_callback(store)], max_epochs=1)
    message = str(refused.value)
    assert str(store) in message and "ckpt_path" in message and "overwrite=True" in message
    assert module.trainer.global_step == 0  # refused at the start, before any step
    assert _files(store) == before  # nothing written, nothing removed
    assert _counts(store) == dict.fromkeys(range(N_TRAIN), 1)  # not 2: the runs were not merged


def test_overwrite_moves_the_earlier_store_aside_and_starts_a_new_one(tmp_path: Path) -> None:
    train, val = loaders(N_TRAIN, 6, 8)
    store = tmp_path / "store"
    fit(tmp_path, Classifier(), train, val, [_callback(store)], max_epochs=1)
    before = _files(store)
    fit(tmp_path, Classifier(), train, val, [_callback(store, overwrite=True)], max_epochs=2)
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("store.replaced-")]
    assert len(moved) == 1 and _files(moved[0]) == before  # the earlier store, byte for byte
    assert _counts(store) == dict.fromkeys(range(N_TRAIN), 2)  # only the new run: 2 epochs
    assert sorted(open_store(store).metadata("train")["epoch"].tolist()) == [0] * N_TRAIN + [1] * N_TRAIN


def test_a_fit_resumed_from_a_checkpoint_continues_the_same_store(tmp_path: Path) -> None:
    train, val = loaders(N_TRAIN, 6, 8)
    store = tmp_path / "store"
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit(tmp_path, Classifier(), train, val, [_callback(store), saver], max_epochs=1, enable_checkpointing=True)
    trainer = L.Trainer(
        max_epochs=2,
        callbacks=[_callback(store), ModelCheckpoint(dirpath=tmp_path / "ckpt")],
        logger=TensorBoardLogger(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Classifier(), train, val, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    meta = open_store(store).metadata("train")
    assert sorted(meta["epoch"].tolist()) == [0] * N_TRAIN + [1] * N_TRAIN  # epoch 0 from the first run, 1 resumed
    assert _counts(store) == dict.fromkeys(range(N_TRAIN), 2)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("store.replaced-")]


class _Stepped(Classifier):
    """SGD at 0.05, divided by 10 after each epoch; records the rate each training step ran at."""

    def __init__(self) -> None:
        super().__init__(lr=0.05)
        self.rates: dict[int, set[float]] = {}

    def training_step(self, batch, batch_idx):
        if self.training:  # not a checkpoint pass (eval mode), which runs after the epoch's scheduler step
            self.rates.setdefault(self.current_epoch, set()).add(self.trainer.optimizers[0].param_groups[0]["lr"])
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)]


def test_the_automatic_epoch_tag_records_the_rate_the_epoch_trained_at(tmp_path: Path) -> None:
    train, val = loaders(N_TRAIN, 6, 8)
    module = _Stepped()
    fit(tmp_path, module, train, val, [_callback(tmp_path / "store")], max_epochs=2)
    tags = {tag.name: tag for tag in read_tags(tmp_path / "store") if tag.automatic}
    for epoch, expected in ((0, 0.05), (1, 0.005)):  # the scheduler's rate during epoch e: 0.05 * 0.1**e
        assert sorted(module.rates[epoch]) == [pytest.approx(expected)]
        assert tags[f"epoch-{epoch}"].attributes["lr"] == pytest.approx(expected, rel=1e-6)


def test_a_tag_with_steps_set_before_fit_is_written_when_training_starts(tmp_path: Path) -> None:
    train, val = loaders(N_TRAIN, 6, 8)
    callback = _callback(tmp_path / "store")
    with pytest.raises(RuntimeError, match=r"steps=\(first, last\)"):
        callback.tag("now")  # no step to tag before training
    with pytest.raises(RuntimeError, match="while training runs"):
        callback.tag("weights", steps=0, keep="snapshot")
    assert callback.tag("warm-up", steps=(0, 1), keep="exact", reason="first steps") is None
    fit(tmp_path, Classifier(), train, val, [callback], max_epochs=1)
    found = [tag for tag in read_tags(tmp_path / "store") if tag.name == "warm-up"]
    assert len(found) == 1
    assert (found[0].first_step, found[0].last_step, found[0].keep) == (0, 1, "exact")
    assert found[0].attributes == {"reason": "first steps"}


def test_a_resume_over_steps_already_stored_is_warned_and_the_store_shows_the_repeated_batches(
    tmp_path: Path,
) -> None:
    train, val = loaders(N_TRAIN, 6, 8)  # 3 steps per epoch
    store = tmp_path / "store"
    every_epoch = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{epoch}", save_top_k=-1)
    fit(tmp_path, Classifier(), train, val, [_callback(store), every_epoch], max_epochs=2, enable_checkpointing=True)
    assert open_store(store).steps("train") == list(range(6))  # the first run went on past epoch 0's checkpoint
    assert repeated_batches(open_store(store).index) == []
    trainer = L.Trainer(
        max_epochs=2,
        callbacks=[_callback(store)],
        logger=TensorBoardLogger(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with pytest.warns(UserWarning, match=r"already holds training steps 3\.\.5.*resumes from \(step 3\)"):
        trainer.fit(Classifier(), train, val, ckpt_path=str(tmp_path / "ckpt" / "epoch=0.ckpt"))
    lines = repeated_batches(open_store(store).index)
    assert [line.split(":")[0] for line in lines] == [
        "capture point 'epoch-1/train'",
        "capture point 'epoch-1/val'",
        "capture point 'train'",
    ]
    assert "3 batches are stored more than once, at steps 3..5" in lines[2]  # epoch 1's 3 steps, twice


def test_two_runs_appended_to_one_store_before_the_refusal_are_detected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a second run into the same dirpath did before: a second writer continued the store from step 0."""
    layer = torch.nn.Linear(4, 2)
    for _ in range(2):  # two runs of 2 steps of 3 samples each
        with StoreWriter(tmp_path / "store") as writer:
            for step in range(2):
                with CaptureSession(layer) as session:
                    layer(torch.randn(3, 4)).sum().backward()
                writer.write(session.factors(), sample_ids=torch.arange(3) + 3 * step, step=step)
    assert len(open_store(tmp_path / "store").sample_ids("train")) == 12  # 2 runs x 2 steps x 3 samples
    lines = repeated_batches(open_store(tmp_path / "store").index)
    assert len(lines) == 1
    assert lines[0].startswith("capture point 'train': 2 batches are stored more than once, at steps 0..1")
    assert main(["inspect", str(tmp_path / "store")]) == 1  # `metastore inspect` lists it under problems
    assert "capture point 'train': 2 batches are stored more than once" in capsys.readouterr().out


def test_overwrite_never_moves_a_store_that_a_writer_still_holds(tmp_path: Path) -> None:
    store = tmp_path / "store"
    layer = torch.nn.Linear(4, 2)
    with StoreWriter(store) as writer:  # holds rank 0's lock while it is open
        with CaptureSession(layer) as session:
            layer(torch.randn(3, 4)).sum().backward()
        writer.write(session.factors(), sample_ids=torch.arange(3), step=0)
        writer.flush()
        before = _files(store)
        with pytest.raises(ExistingStoreError, match="could not move the earlier store"):
            claim_store_dir(store, continuing=False, overwrite=True, owner="Test", resume="-")
        assert _files(store) == before and [p.name for p in tmp_path.iterdir()] == ["store"]
    assert claim_store_dir(store, continuing=True, overwrite=True, owner="Test", resume="-", step=1) is None  # kept
    moved = claim_store_dir(store, continuing=False, overwrite=True, owner="Test", resume="-")
    assert moved is not None and sorted(_files(moved)) == sorted(before) and list(store.iterdir()) == []


def test_another_rank_touches_the_store_directory_only_after_rank_zero_decides(tmp_path: Path) -> None:
    """Rank 0 may be moving the directory aside (``overwrite=True``) while rank 1 waits for its decision: rank 1
    must neither create nor check the directory before it hears where the store went (a DDP race seen in CI)."""
    store = tmp_path / "store"
    seen: list[bool] = []

    def rank_zero_moves_it(decision: Decision) -> Decision:
        seen.append(store.exists())  # what rank 1 had done to the directory by the time rank 0 decided
        return "replaced", str(tmp_path / "store.replaced-x")

    options = _callback(store).facade.options
    run, moved = open_run(
        options, store, setting="dirpath", resume="-", continuing=False, step=0, agree=rank_zero_moves_it,
        rank=1, world_size=2, loss_reduction="mean", config={}, announce=None, early_tags=[],
    )  # fmt: skip
    run.close()
    assert seen == [False]
    assert moved == tmp_path / "store.replaced-x" and store.is_dir()  # created after the decision
