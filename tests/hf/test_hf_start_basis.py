"""The HF callback's start basis: where the plan projects the passes, the curvature eigenbasis is fitted on training
samples before the first step (the Trainer has no evaluation loader yet, so no start pass), the first evaluation's
pass keeps it, and so every training step has a test pass on its own basis. Before, the steps before the first
evaluation were seeded projections no test pass shared: a one-epoch fine-tune's default answer could not pair any
step and fell back to the passes' 32 training samples.

References: the store's records read back (each record's basis and its block), the dataset's ids, and the
plan's own list of fits; the default answer's rows against every training id.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("datasets")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")

from hf_cases import make_dataset, make_model, train  # noqa: E402

from metastore_plugins import MetaStoreTrainerCallback, open_store  # noqa: E402
from metastore_plugins.core.analysis import DefaultScores, GradientStore  # noqa: E402

N_TRAIN, N_VAL, BATCH = 48, 16, 4
#: a budget under which this BERT's plan projects the steps and the passes over 3 epochs (measured: 1.7 MB keeps
#: norms only in the steps, 3.8 MB keeps the passes exact; 2.0-3.0 MB project both)
BUDGET = 2_500_000


def _run(tmp_path: Path, epochs: int) -> GradientStore:
    callback = MetaStoreTrainerCallback(budget=BUDGET, reports=False)
    train(tmp_path, make_model(hidden=128), make_dataset(N_TRAIN, 1), make_dataset(N_VAL, 2), [callback],
          num_train_epochs=epochs, learning_rate=1e-3, per_device_train_batch_size=BATCH)  # fmt: skip
    return open_store(callback.dirpath)


def _bases(store: GradientStore, point: str, step: int | None = None) -> set[int | None]:
    """The eigenbases (fit steps) the projected records of ``point`` (at ``step``) are kept on."""
    steps = None if step is None else (step, step)
    return {r.basis for b in store.select(point, steps=steps).batches() for r in b.records if "projected" in r.tensors}


@pytest.fixture(scope="module")
def three_epochs(tmp_path_factory: pytest.TempPathFactory) -> GradientStore:
    return _run(tmp_path_factory.mktemp("start-basis-3"), 3)


def test_the_first_pass_keeps_the_start_basis_the_second_refits_and_the_last_keeps_it(
    three_epochs: GradientStore,
) -> None:
    """The last pass keeps the latest basis: no step follows it, and its 32 training samples are no more than a fit
    (``RunCapture.basis_samples``) would take."""
    store, per_epoch = three_epochs, N_TRAIN // BATCH
    assert store.config["capture_plan"]["bases"] == [0, 2 * per_epoch]  # fitted before step 0, at the second pass
    for step in (0, per_epoch - 1, per_epoch, 2 * per_epoch - 1):  # the first two epochs' steps: the start basis
        assert _bases(store, "train", step) == {0}
    for step in (2 * per_epoch, 3 * per_epoch - 1):  # the last epoch's steps: the second pass's
        assert _bases(store, "train", step) == {2 * per_epoch}
    assert _bases(store, "epoch-0/val") == _bases(store, "epoch-0/train") == {0}
    assert _bases(store, "epoch-1/val") == _bases(store, "epoch-2/val") == {2 * per_epoch}


def test_every_training_sample_is_scored_from_its_steps(three_epochs: GradientStore) -> None:
    store = three_epochs
    tests = sorted((p for p in store.capture_points() if p.endswith("/val")), key=lambda p: store.steps(p)[0])
    scores = store.influence(test=tests, method="auto")
    assert isinstance(scores, DefaultScores)
    assert scores.row_ids.tolist() == list(range(N_TRAIN))  # every training sample, not the passes' 32
    assert scores.methods["steps"] == "ekfac"  # the steps are preconditioned on their basis, not seeded TracIn
    steps_only = sorted(set(range(N_TRAIN)) - set(store.sample_ids("epoch-1/train").tolist()))
    assert steps_only and all(scores.sources[i] == "steps" for i in steps_only)
    assert (abs(scores.scores[steps_only]).sum(1) > 0).all()  # scored, not rows of zeros


def test_the_steps_before_the_first_evaluation_pair_with_it(three_epochs: GradientStore) -> None:
    """A one-epoch fine-tune's case: every step comes before the first (and only) evaluation's pass."""
    store, per_epoch = three_epochs, N_TRAIN // BATCH
    first = store.in_run_influence(
        ["epoch-0/val", "epoch-1/val", "epoch-2/val"], method="ekfac", steps=(0, per_epoch - 1)
    )
    assert sorted(first.row_ids.tolist()) == list(range(N_TRAIN))  # each sample once in the first epoch
    assert (abs(first.scores).sum(1) > 0).all()
