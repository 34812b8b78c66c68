"""Real ``Trainer.train()`` runs: a second, fresh run into the same ``output_dir`` is refused (or, with
``overwrite=True``, the old store is moved aside byte for byte); ``train(resume_from_checkpoint=...)``
continues the store; the start and end lines reach transformers' own log output, with
``log_level="info"`` and by default."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hf_cases import has_accelerate, make_dataset, make_model, train
from reruncases import file_hashes as _files
from reruncases import stored_counts as _counts

from metastore_plugins import MetaStoreTrainerCallback, open_store
from metastore_plugins.core.errors import ExistingStoreError

pytestmark = pytest.mark.skipif(not has_accelerate(), reason="transformers.Trainer needs accelerate")

N_TRAIN = 16  # 4 batches of 4 per epoch


def _run(tmp_path: Path, callback: MetaStoreTrainerCallback, **arguments: object) -> object:
    return train(tmp_path, make_model(), make_dataset(N_TRAIN, 1), make_dataset(8, 2), [callback], **arguments)


def test_a_second_fresh_train_into_the_same_output_dir_is_refused_and_the_store_is_untouched(tmp_path: Path) -> None:
    _run(tmp_path, MetaStoreTrainerCallback(reports=False), num_train_epochs=1)
    store = tmp_path / "out" / "metastore"
    assert _counts(store) == dict.fromkeys(range(N_TRAIN), 1)
    before = _files(store)
    with pytest.raises(ExistingStoreError) as refused:
        _run(tmp_path, MetaStoreTrainerCallback(reports=False), num_train_epochs=1)
    message = str(refused.value)
    assert str(store) in message and "resume_from_checkpoint" in message and "overwrite=True" in message
    assert _files(store) == before
    assert _counts(store) == dict.fromkeys(range(N_TRAIN), 1)  # not 2: the runs were not merged


def test_overwrite_moves_the_earlier_store_aside_and_starts_a_new_one(tmp_path: Path) -> None:
    _run(tmp_path, MetaStoreTrainerCallback(reports=False), num_train_epochs=1)
    store = tmp_path / "out" / "metastore"
    before = _files(store)
    _run(tmp_path, MetaStoreTrainerCallback(reports=False, overwrite=True), num_train_epochs=2)
    moved = [p for p in store.parent.iterdir() if p.name.startswith("metastore.replaced-")]
    assert len(moved) == 1 and _files(moved[0]) == before
    assert _counts(store) == dict.fromkeys(range(N_TRAIN), 2)  # the new run's 2 epochs only


def test_train_resumed_from_a_checkpoint_continues_the_same_store(tmp_path: Path) -> None:
    _run(tmp_path, MetaStoreTrainerCallback(reports=False), num_train_epochs=1, save_strategy="epoch")
    checkpoint = tmp_path / "out" / "checkpoint-4"
    assert checkpoint.is_dir()
    _run(
        tmp_path,
        MetaStoreTrainerCallback(reports=False),
        num_train_epochs=2,
        save_strategy="no",
        resume_from_checkpoint=str(checkpoint),
    )
    store = tmp_path / "out" / "metastore"
    assert _counts(store) == dict.fromkeys(range(N_TRAIN), 2)  # epoch 0 from the first run, epoch 1 resumed
    meta = open_store(store).metadata("train")
    assert sorted(meta["step"].tolist()) == [step for step in range(8) for _ in range(4)]


@pytest.fixture
def transformers_output() -> Iterator[io.StringIO]:
    """What transformers' own log handler (the one that prints the Trainer's lines) writes, from the default
    verbosity (warning) on; both are restored afterwards."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()  # a fresh process's level: earlier tests may have lowered it
    handlers = [h for h in logging.getLogger("transformers").handlers if isinstance(h, logging.StreamHandler)]
    assert handlers, "transformers configures a stream handler on its library logger"
    buffer = io.StringIO()
    streams = [handler.setStream(buffer) for handler in handlers]
    try:
        yield buffer
    finally:
        for handler, stream in zip(handlers, streams, strict=True):
            handler.setStream(stream)
        hf_logging.set_verbosity(verbosity)


@pytest.mark.parametrize("log_level", ["info", None])
def test_the_start_and_end_lines_show_in_transformers_output(
    tmp_path: Path, transformers_output: io.StringIO, log_level: str | None
) -> None:
    callback = MetaStoreTrainerCallback(tmp_path / "store")
    _run(tmp_path, callback, num_train_epochs=1, **({"log_level": log_level} if log_level else {}))
    lines = [line for line in transformers_output.getvalue().splitlines() if "MetaStoreTrainerCallback:" in line]
    store = str(tmp_path / "store")
    assert any(f"go to {store}" in line for line in lines), lines  # the start line
    assert any(f"store {store} written, reports in {store}/reports" in line for line in lines), lines  # the end
    if log_level == "info":
        assert "***** Running training *****" in transformers_output.getvalue()  # shown as the Trainer's are


@pytest.mark.slow
@pytest.mark.torchrun
def test_under_ddp_every_rank_refuses_or_follows_rank_zero(tmp_path: Path) -> None:
    """2 gloo processes: a fresh second run is refused on both ranks; with overwrite=True both write the new store."""
    worker = Path(__file__).parent / "rerun_ddp_worker.py"
    done = subprocess.run([sys.executable, str(worker), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = [json.loads((tmp_path / f"rerun-rank{r}.json").read_text()) for r in (0, 1)]
    assert [s["first"] for s in seen] == ["ran", "ran"]
    assert all(s["second"].startswith("refused: MetaStoreTrainerCallback: ") for s in seen)
    assert [s["third"] for s in seen] == ["ran", "ran"]
    store = tmp_path / "out" / "metastore"
    moved = [p for p in store.parent.iterdir() if p.name.startswith("metastore.replaced-")]
    assert len(moved) == 1  # moved once, by rank 0
    assert sorted(str(p.relative_to(moved[0])) for p in moved[0].rglob("*") if p.is_file()) == seen[0]["before"]
    assert open_store(moved[0]).ranks() == open_store(store).ranks() == [0, 1]
    assert _counts(store) == dict.fromkeys(range(8), 1)  # the third run alone: each sample once


def test_the_automatic_epoch_tag_records_the_rate_the_epochs_last_step_trained_at(tmp_path: Path) -> None:
    """The Trainer's linear decay over 8 steps (4 per epoch) applies 0.1 * (8 - t) / 8 at step t."""
    from metastore_plugins.core.store.tags.book import read_tags

    callback = MetaStoreTrainerCallback(reports=False)
    _run(tmp_path, callback, num_train_epochs=2, learning_rate=0.1, lr_scheduler_type="linear")
    tags = {tag.name: tag for tag in read_tags(callback.dirpath) if tag.automatic}
    for epoch, last_step in ((0, 3), (1, 7)):
        assert tags[f"epoch-{epoch}"].attributes["lr"] == pytest.approx(0.1 * (8 - last_step) / 8, rel=1e-6)
