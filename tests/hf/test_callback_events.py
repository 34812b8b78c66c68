"""MetaStoreTrainerCallback driven by Trainer.train()'s event sequence: exact ids, each sample's own gradient
under both loss-scaling modes and accumulation, checkpoint passes, reports in TensorBoard and files.

These run without accelerate (which ``transformers.Trainer`` needs); ``test_trainer.py`` repeats the
key checks on real ``Trainer`` runs where accelerate is installed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("datasets")
pytest.importorskip("tensorboard")

from hf_cases import (  # noqa: E402
    CLASSES,
    MeanBert,
    SumOverItemsBert,
    TorchDataset,
    make_dataset,
    make_model,
    reference_gradient,
    relative_error,
    simulate_train,
)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from transformers import BertForSequenceClassification  # noqa: E402

from metastore_plugins import open_store  # noqa: E402
from metastore_plugins.core.errors import SampleIdError  # noqa: E402
from metastore_plugins.hf_callback import MetaStoreTrainerCallback  # noqa: E402

N_TRAIN, N_VAL = 18, 10  # batches of 4: 4, 4, 4, 4, 2; accumulation 2: windows of 2, 2, 1 micro-batches

MODELS = {
    "num_items_in_batch": SumOverItemsBert,  # sum / items of the whole window: not divided again
    "divided_by_window": MeanBert,  # mean, divided by the window length (1 for the last window)
    "kwargs_mean": BertForSequenceClassification,  # takes **kwargs, so the Trainer does not divide its mean
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def accumulated(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    tmp_path = tmp_path_factory.mktemp(request.param)
    train_set, val_set = make_dataset(N_TRAIN, 1), make_dataset(N_VAL, 2)
    model = make_model(cls=MODELS[request.param])
    callback = MetaStoreTrainerCallback(encoding="fp32")
    run = simulate_train(tmp_path, model, train_set, val_set, [callback], accumulation=2)
    return run, model, callback, open_store(callback.dirpath), train_set, val_set


def test_store_under_output_dir_with_train_and_checkpoint_passes(accumulated) -> None:
    run, _, callback, store, _, _ = accumulated
    assert callback.dirpath == Path(run.args.output_dir) / "metastore"
    assert store.capture_points() == ["epoch-0/train", "epoch-0/val", "epoch-1/train", "epoch-1/val", "train"]
    assert store.verify() == []


def test_every_training_sample_once_per_epoch_with_its_own_label(accumulated) -> None:
    _, _, _, store, train_set, _ = accumulated
    meta = store.metadata("train")
    for epoch in (0, 1):
        ids = meta["sample_id"][meta["epoch"] == epoch]
        assert sorted(ids.tolist()) == list(range(N_TRAIN))
    assert [train_set[int(i)]["label"] for i in meta["sample_id"]] == meta["label"].tolist()
    assert meta["sample_id"][:N_TRAIN].tolist() != list(range(N_TRAIN))  # shuffled
    assert sorted(set(meta["step"].tolist())) == [0, 1, 2, 3, 4, 5]  # 3 optimizer steps per epoch
    window = meta["step"] == 2  # the last, short window: one micro-batch of 2 samples
    assert meta["micro_batch"][window].tolist() == [0, 0]


def test_stored_gradient_is_each_samples_own_loss_gradient(accumulated) -> None:
    """lr=0 keeps the weights fixed: every stored row equals the gradient of that sample alone, by hand."""
    _, model, _, store, train_set, _ = accumulated
    meta = store.metadata("train")
    worst = 0.0
    for sid, step in zip(meta["sample_id"][meta["epoch"] == 0], meta["step"][meta["epoch"] == 0]):
        item = train_set[int(sid)]
        stored = store.restore(int(sid), capture_point="train", step=int(step))
        worst = max(worst, relative_error(stored, reference_gradient(model, item["input_ids"], item["label"])))
    assert worst < 1e-4


def test_stored_losses_and_predictions(accumulated) -> None:
    _, model, _, store, train_set, _ = accumulated
    import torch
    import torch.nn.functional as F

    meta = store.metadata("train")
    sid = int(meta["sample_id"][0])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([train_set[sid]["input_ids"]])).logits
    assert meta["loss"][0] == pytest.approx(
        float(F.cross_entropy(logits, torch.tensor([train_set[sid]["label"]]))), rel=1e-5
    )
    # the stored prediction is an argmax of this sample's logits, up to fp32 round-off: it came from a padded
    # batch, these from the sample alone, so a near-tie between two classes may resolve either way
    prediction = int(meta["prediction"][0])
    assert 0 <= prediction < CLASSES
    assert float(logits[0, prediction]) >= float(logits.max()) - 1e-5 * max(1.0, float(logits.abs().max()))


def test_checkpoint_passes_cover_the_eval_set_with_exact_gradients(accumulated) -> None:
    _, model, _, store, train_set, val_set = accumulated
    for epoch in (0, 1):
        assert sorted(store.sample_ids(f"epoch-{epoch}/val").tolist()) == list(range(N_VAL))
        assert sorted(store.sample_ids(f"epoch-{epoch}/train").tolist()) == list(range(N_TRAIN))
    meta = store.metadata("epoch-1/val")
    assert [val_set[int(i)]["label"] for i in meta["sample_id"]] == meta["label"].tolist()
    for sid in (0, 7):
        item = val_set[sid]
        stored = store.restore(sid, capture_point="epoch-1/val")
        assert relative_error(stored, reference_gradient(model, item["input_ids"], item["label"])) < 1e-4
    item = train_set[5]
    stored = store.restore(5, capture_point="epoch-0/train")
    assert relative_error(stored, reference_gradient(model, item["input_ids"], item["label"])) < 1e-4


@pytest.fixture(scope="module")
def learning_run(tmp_path_factory: pytest.TempPathFactory):
    """SGD with lr > 0 (self-influence needs a learning rate), a plain torch dataset, no accumulation."""
    tmp_path = tmp_path_factory.mktemp("learning")
    callback = MetaStoreTrainerCallback(checkpoint_train_samples=12)
    run = simulate_train(tmp_path, make_model(), TorchDataset(N_TRAIN, 1), TorchDataset(N_VAL, 2), [callback], lr=0.5)
    return run, callback, open_store(callback.dirpath)


def test_plain_torch_dataset_ids_and_bounded_train_subset(learning_run) -> None:
    _, callback, store = learning_run
    meta = store.metadata("train")
    assert sorted(meta["sample_id"][meta["epoch"] == 1].tolist()) == list(range(N_TRAIN))
    subset = store.sample_ids("epoch-0/train").tolist()
    assert len(subset) == 12 and subset == store.sample_ids("epoch-1/train").tolist()  # the same fixed subset
    assert store.learning_rate("train") == pytest.approx(0.5)


def test_reports_in_the_trainers_tensorboard_dir_and_as_files(learning_run) -> None:
    run, callback, _ = learning_run
    reports = callback.dirpath / "reports"
    for name in ("outliers.json", "outliers.csv", "outliers.md", "influence.json", "influence.md", "summary.json"):
        assert (reports / name).is_file()
    rows = callback.report_result["outliers"]
    dataset = TorchDataset(N_TRAIN, 1)
    assert rows[0]["text"] == dataset.rows["text"][rows[0]["sample_id"]]  # decoded with the Trainer's tokenizer
    assert "| text |" in (reports / "outliers.md").read_text().splitlines()[0] + "|"
    influence = callback.report_result["influence"]
    assert influence and influence[0]["test_text"]
    events = EventAccumulator(
        str(run.log_dir), size_guidance={"tensors": 0, "histograms": 0, "images": 0, "scalars": 0}
    ).Reload()
    tags = events.Tags()
    assert "train/loss" in tags["scalars"]  # the Trainer's own curve, next to ours
    assert {"metastore/outliers/text_summary", "metastore/influence/text_summary"} <= set(tags["tensors"])
    assert any(t.startswith("metastore/self_influence/class_") for t in tags["histograms"])
    assert {"metastore/loss_vs_self_influence", "metastore/gradient_norms", "metastore/data_map"} == set(tags["images"])
    ours = [tag for tag in tags["scalars"] if tag.startswith("metastore/")]
    assert "metastore/grad_norm_total" in ours and len(ours) <= 5  # one heatmap, not a chart per layer
    text = events.Tensors("metastore/outliers/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| rank | sample_id |" in text and rows[0]["text"] in text
    table = events.Tensors("metastore/influence/text_summary")[0].tensor_proto.string_val[0].decode()
    shown = [line.split("|") for line in table.splitlines() if line.startswith(("| + |", "| - |"))]
    assert len(shown) == sum(len(row["proponents"]) + len(row["opponents"]) for row in influence)
    for cells in shown:  # | sign | train id | label | score | text |
        sid, text = int(cells[2]), cells[5].strip()
        assert text == " ".join(dataset.rows["text"][sid].split())  # the dataset's own text of that id
        assert int(cells[3]) == dataset.rows["label"][sid]
    assert table.count("; exact scores): ") == len(influence)


def test_no_tensorboard_reports_files_only(tmp_path: Path) -> None:
    callback = MetaStoreTrainerCallback(dirpath=tmp_path / "store", capture_train_steps=False)
    run = simulate_train(
        tmp_path, make_model(), make_dataset(8, 1), make_dataset(4, 2), [callback], epochs=1, lr=0.1, report_to=()
    )
    assert callback.dirpath == tmp_path / "store"
    assert open_store(callback.dirpath).capture_points() == ["epoch-0/train", "epoch-0/val"]
    assert (callback.dirpath / "reports" / "outliers.json").is_file()
    assert not (Path(run.args.output_dir) / "runs").exists()


def test_unwritable_store_fails_before_training(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    callback = MetaStoreTrainerCallback(dirpath=blocker / "store")
    with pytest.raises(ValueError, match="dirpath"):
        simulate_train(tmp_path, make_model(), make_dataset(8, 1), make_dataset(4, 2), [callback], epochs=1)


def test_outlier_source_is_checked_when_the_callback_is_made() -> None:
    with pytest.raises(ValueError, match=r"MetaStoreTrainerCallback\(outliers_from=\.\.\.\)"):
        MetaStoreTrainerCallback(outliers_from="steps")
    with pytest.raises(ValueError, match="capture_train_steps=True"):
        MetaStoreTrainerCallback(outliers_from="training", capture_train_steps=False)
    with pytest.raises(ValueError, match=r"MetaStoreTrainerCallback\(encoding=\.\.\.\) must be one of"):
        MetaStoreTrainerCallback(encoding="half")
    with pytest.raises(ValueError, match=r"MetaStoreTrainerCallback\(modules=\.\.\.\) takes a list"):
        MetaStoreTrainerCallback(modules="bert")


def test_unknown_modules_fail_before_training(tmp_path: Path) -> None:
    callback = MetaStoreTrainerCallback(modules=["bert.nope"])
    with pytest.raises(ValueError, match="bert.nope"):
        simulate_train(tmp_path, make_model(), make_dataset(8, 1), make_dataset(4, 2), [callback], epochs=1)


def test_modules_capture_only_those_layers(tmp_path: Path) -> None:
    callback = MetaStoreTrainerCallback(modules=["classifier"], encoding="fp32")
    simulate_train(tmp_path, make_model(), make_dataset(8, 1), make_dataset(4, 2), [callback], epochs=1)
    assert open_store(callback.dirpath).layers() == ["classifier"]


def test_iterable_dataset_is_refused_with_the_fix(tmp_path: Path) -> None:
    import torch

    from metastore_plugins.hf_callback import MetaStoreTrainerCallback as Callback

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([make_dataset(4, 1)[i] for i in range(4)])

    with pytest.raises(SampleIdError, match="capture_train_steps=False"):
        simulate_train(tmp_path, make_model(), Stream(), make_dataset(4, 2), [Callback()], epochs=1)


def test_classes_constant_matches_model() -> None:
    assert make_model().config.num_labels == CLASSES
    assert np.unique(make_dataset(30, 1)["label"]).tolist() == list(range(CLASSES))


def test_a_model_without_capturable_layers_fails_before_training(tmp_path: Path) -> None:
    """Only parameters that no rule covers are trainable: nothing could be stored.

    (Modules without a rule go through the generic rule; a parameter that a module's own rule
    leaves out, such as ``extra`` on a subclass of ``nn.Linear``, does not.)"""
    import torch

    class LinearWithExtra(torch.nn.Linear):  # the Linear rule covers weight and bias, not `extra`
        def __init__(self) -> None:
            super().__init__(4, 2)
            self.extra = torch.nn.Parameter(torch.zeros(2))

    model = make_model()
    model.requires_grad_(False)
    model.odd = LinearWithExtra()
    model.odd.requires_grad_(False)
    model.odd.extra.requires_grad_(True)
    with pytest.raises(ValueError, match="register_capture"):
        simulate_train(tmp_path, model, make_dataset(8, 1), make_dataset(4, 2), [MetaStoreTrainerCallback()], epochs=1)


def test_without_evaluation_one_pass_runs_at_the_end(tmp_path: Path) -> None:
    callback = MetaStoreTrainerCallback()
    simulate_train(tmp_path, make_model(), make_dataset(8, 1), None, [callback], epochs=1, lr=0.1, evaluate=False)
    store = open_store(callback.dirpath)
    assert store.capture_points() == ["step-2/train", "train"]
    assert callback.report_result is not None and callback.report_result["outliers"]
    assert callback.report_result["influence"] == []


def test_sum_loss_model_checkpoint_pass_is_rescaled(tmp_path: Path) -> None:
    """A model whose loss is a plain sum (no num_items_in_batch given): passes still store each sample's gradient."""
    import torch

    class SumBert(BertForSequenceClassification):
        accepts_loss_kwargs = False

        def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
            out = super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            if labels is not None:
                out.loss = torch.nn.functional.cross_entropy(out.logits, labels, reduction="sum")
            return out

    train_set = make_dataset(8, 1)
    model = make_model(cls=SumBert)
    callback = MetaStoreTrainerCallback(encoding="fp32")
    simulate_train(tmp_path, model, train_set, make_dataset(4, 2), [callback], epochs=1, accumulation=2)
    store = open_store(callback.dirpath)
    meta = store.metadata("train")
    for point, sid, step in [("epoch-0/train", 3, None), ("train", int(meta["sample_id"][5]), int(meta["step"][5]))]:
        stored = store.restore(sid, capture_point=point, step=step)
        item = train_set[sid]
        assert relative_error(stored, reference_gradient(model, item["input_ids"], item["label"])) < 1e-4


def test_resuming_mid_epoch_skips_the_batches_the_trainer_skips(tmp_path: Path) -> None:
    """The resumed run stores, for the remaining steps, exactly the ids a run without interruption stored."""
    train_set = make_dataset(N_TRAIN, 1)
    full, resumed = MetaStoreTrainerCallback(reports=False), MetaStoreTrainerCallback(reports=False)
    simulate_train(tmp_path / "full", make_model(), train_set, None, [full], epochs=1, accumulation=2, evaluate=False)
    simulate_train(
        tmp_path / "resumed",
        make_model(),
        train_set,
        None,
        [resumed],
        epochs=1,
        accumulation=2,
        evaluate=False,
        resume_step=1,
    )
    a, b = open_store(full.dirpath).metadata("train"), open_store(resumed.dirpath).metadata("train")
    assert sorted(set(b["step"].tolist())) == [1, 2]
    assert b["sample_id"].tolist() == a["sample_id"][a["step"] >= 1].tolist()
    assert b["micro_batch"].tolist() == a["micro_batch"][a["step"] >= 1].tolist()
