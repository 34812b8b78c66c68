"""MetaStoreTrainerCallback on real ``transformers.Trainer`` runs (needs accelerate, which the Trainer needs):
exact ids under shuffling, each sample's own gradient with accumulation in both loss-scaling modes, checkpoint
passes, reports in the Trainer's TensorBoard run directory."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("datasets")
pytest.importorskip("tensorboard")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")

from hf_cases import (  # noqa: E402
    MeanBert,
    SumOverItemsBert,
    TorchDataset,
    make_dataset,
    make_model,
    reference_gradient,
    relative_error,
    train,
)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from transformers import BertForSequenceClassification  # noqa: E402

from metastore_plugins import MetaStoreTrainerCallback, open_store  # noqa: E402

N_TRAIN, N_VAL = 18, 10

MODELS = {
    "num_items_in_batch": SumOverItemsBert,
    "divided_by_window": MeanBert,
    "kwargs_mean": BertForSequenceClassification,
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def accumulated(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    tmp_path = tmp_path_factory.mktemp(request.param)
    train_set, val_set = make_dataset(N_TRAIN, 1), make_dataset(N_VAL, 2)
    model = make_model(cls=MODELS[request.param])
    callback = MetaStoreTrainerCallback(encoding="fp32")
    trainer = train(tmp_path, model, train_set, val_set, [callback], gradient_accumulation_steps=2)
    return trainer, model, callback, open_store(callback.dirpath), train_set, val_set


def test_the_trainer_scales_the_loss_as_this_test_means(accumulated) -> None:
    trainer, model, *_ = accumulated
    assert trainer.model_accepts_loss_kwargs == (type(model) is not MeanBert)


def test_ids_exact_and_each_samples_own_gradient(accumulated) -> None:
    trainer, model, callback, store, train_set, _ = accumulated
    assert callback.dirpath == Path(trainer.args.output_dir) / "metastore"
    assert store.capture_points() == ["epoch-0/train", "epoch-0/val", "epoch-1/train", "epoch-1/val", "train"]
    meta = store.metadata("train")
    for epoch in (0, 1):
        assert sorted(meta["sample_id"][meta["epoch"] == epoch].tolist()) == list(range(N_TRAIN))
    assert [train_set[int(i)]["label"] for i in meta["sample_id"]] == meta["label"].tolist()
    assert sorted(set(meta["step"].tolist())) == list(range(trainer.state.global_step))
    worst = 0.0
    for sid, step in zip(meta["sample_id"][meta["epoch"] == 0], meta["step"][meta["epoch"] == 0]):
        item = train_set[int(sid)]
        stored = store.restore(int(sid), capture_point="train", step=int(step))
        worst = max(worst, relative_error(stored, reference_gradient(model, item["input_ids"], item["label"])))
    assert worst < 1e-4


def test_checkpoint_passes_at_evaluation(accumulated) -> None:
    _, model, _, store, _, val_set = accumulated
    assert sorted(store.sample_ids("epoch-1/val").tolist()) == list(range(N_VAL))
    item = val_set[3]
    stored = store.restore(3, capture_point="epoch-1/val")
    assert relative_error(stored, reference_gradient(model, item["input_ids"], item["label"])) < 1e-4


def test_reports_next_to_the_trainers_curves(tmp_path: Path) -> None:
    callback = MetaStoreTrainerCallback()
    trainer = train(
        tmp_path,
        make_model(),
        TorchDataset(N_TRAIN, 1),
        TorchDataset(N_VAL, 2),
        [callback],
        learning_rate=0.5,
        optim="sgd",
        remove_unused_columns=False,
    )
    assert (callback.dirpath / "reports" / "outliers.md").is_file()
    runs = [d for d in (Path(trainer.args.output_dir) / "runs").iterdir() if d.is_dir()]
    assert len(runs) == 1  # the Trainer's own run directory, not one of ours
    events = EventAccumulator(
        str(runs[0]), size_guidance={"tensors": 0, "histograms": 0, "images": 0, "scalars": 0}
    ).Reload()
    tags = events.Tags()
    assert "train/loss" in tags["scalars"]
    assert {"metastore/outliers/text_summary", "metastore/influence/text_summary"} <= set(tags["tensors"])
    assert {"metastore/loss_vs_self_influence", "metastore/gradient_norms", "metastore/data_map"} == set(tags["images"])
    row = callback.report_result["outliers"][0]
    assert row["text"] == TorchDataset(N_TRAIN, 1).rows["text"][row["sample_id"]]


def test_steps_eval_strategy_names_passes_by_step(tmp_path: Path) -> None:
    callback = MetaStoreTrainerCallback(capture_train_steps=False)
    train(
        tmp_path,
        make_model(),
        make_dataset(N_TRAIN, 1),
        make_dataset(N_VAL, 2),
        [callback],
        eval_strategy="steps",
        eval_steps=2,
        max_steps=4,
        report_to="none",
    )
    assert open_store(callback.dirpath).capture_points() == ["step-2/train", "step-2/val", "step-4/train", "step-4/val"]


@pytest.mark.slow
@pytest.mark.torchrun
def test_torchrun_two_processes(tmp_path: Path) -> None:
    import subprocess
    import sys

    worker = Path(__file__).parent / "trainer_ddp_worker.py"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # rendezvous and master ports chosen free by the OS, never a fixed number
        "--nproc_per_node",
        "2",
        str(worker),
        str(tmp_path),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    store = open_store(tmp_path / "out" / "metastore")
    assert store.ranks() == [0, 1] and store.verify() == []
    train_set = make_dataset(20, 1)
    meta = store.metadata("train")
    for epoch in (0, 1):
        in_epoch = meta["epoch"] == epoch
        per_rank = [set(meta["sample_id"][in_epoch & (meta["rank"] == r)].tolist()) for r in (0, 1)]
        assert per_rank[0] | per_rank[1] == set(range(20))  # accelerate may repeat samples to even out the shards
    assert [train_set[int(i)]["label"] for i in meta["sample_id"]] == meta["label"].tolist()
    model = make_model()
    sid, step = int(meta["sample_id"][0]), int(meta["step"][0])
    stored = store.restore(sid, capture_point="train", step=step)
    item = train_set[sid]
    assert relative_error(stored, reference_gradient(model, item["input_ids"], item["label"])) < 1e-4


def test_checkpoint_passes_weigh_the_steps_since_the_previous_pass(tmp_path: Path) -> None:
    """Linear decay to 0 over 2 epochs with accumulation: each pass is recorded with the sum of its epoch's rates.

    The last pass is not weighted by the rate at that instant (0 under linear decay)."""
    callback = MetaStoreTrainerCallback(capture_train_steps=False)
    lr, batch, accumulation = 0.3, 2, 2
    train(
        tmp_path,
        make_model(),
        TorchDataset(N_TRAIN, 1),
        TorchDataset(N_VAL, 2),
        [callback],
        learning_rate=lr,
        optim="sgd",
        lr_scheduler_type="linear",
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        remove_unused_columns=False,
    )
    store = open_store(callback.dirpath)
    per_epoch = -(-N_TRAIN // (batch * accumulation))  # optimizer steps per epoch, the last window partial
    total = 2 * per_epoch
    rates = [lr * (total - t) / total for t in range(total)]  # transformers' linear schedule, no warm-up
    for epoch in (0, 1):
        want = sum(rates[epoch * per_epoch : (epoch + 1) * per_epoch])
        for split in ("train", "val"):
            assert store.learning_rate(f"epoch-{epoch}/{split}") == pytest.approx(want, rel=1e-6)
    assert rates[-1] < store.learning_rate("epoch-1/train") / per_epoch  # the instant rate at the end is the smallest
