"""LDS harness: the score against scipy's Spearman, the digits split, pass learning rates, and a tiny run.

The tiny run is a smoke test (seconds), not a measurement: the figures are in docs/quality-lds.md.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # ``metastore_bench`` is not installed: found from the repository

pytest.importorskip("sklearn")

from metastore_bench.quality import lds, lds_defaults, lds_peers, tokens  # noqa: E402
from metastore_bench.quality.digits import Capture, ModelKind, load_digits_arrays, make_model, train_model  # noqa: E402
from metastore_bench.quality.lds_tasks import build_model  # noqa: E402
from metastore_plugins import StoreWriter, open_store  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread, as ``lds.main`` runs: on a busy 2-core machine two threads made the tiny runs 10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_lds_is_spearman_of_subset_sums_against_outputs() -> None:
    rng = np.random.default_rng(3)
    scores = rng.normal(size=(12, 5))  # (N, M)
    masks = rng.random((9, 12)) < 0.5  # (S, N)
    outputs = rng.integers(0, 4, size=(9, 5)).astype(float)  # (S, M): ties, as margins rarely have
    outputs[:, 4] = 1.0  # a constant output: no correlation defined
    got = lds.lds_per_sample(scores, masks, outputs)
    for j in range(4):
        predicted = [scores[masks[s], j].sum() for s in range(9)]  # sum over the subset, by hand
        assert got[j] == pytest.approx(spearmanr(predicted, outputs[:, j]).statistic, abs=1e-12)
    assert np.isnan(got[4])


def test_lds_signs_and_bootstrap() -> None:
    rng = np.random.default_rng(0)
    tau = rng.normal(size=(40, 3))  # (N, M)
    masks = rng.random((60, 40)) < 0.5  # (S, N)
    outputs = masks @ tau  # (S, M): a linear datamodel exactly
    assert np.allclose(lds.lds_per_sample(tau, masks, outputs), 1.0)
    assert np.allclose(lds.lds_per_sample(-tau, masks, outputs), -1.0)
    values = rng.normal(0.3, 0.1, size=200)
    lo, hi = lds.bootstrap_interval(values, reps=500)
    assert lo < values.mean() < hi and hi - lo < 0.05


def test_subsets_hold_half_the_samples_and_are_seeded() -> None:
    masks = lds.subset_masks(11, 50, 0.5, seed=4)
    assert masks.shape == (50, 11) and (masks.sum(1) == 6).all()
    assert np.array_equal(masks, lds.subset_masks(11, 50, 0.5, seed=4))
    assert len({row.tobytes() for row in masks}) > 40


def test_the_split_is_the_lightning_example_s() -> None:
    pytest.importorskip("lightning")
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from lightning_digits import load_digits_split
    finally:
        sys.path.remove(str(REPO / "examples"))
    train, val, flipped = load_digits_split(1497, 0, 0.1)
    x, y, x_test, y_test = load_digits_arrays(seed=0, flip=0.1)
    assert x.shape == (1497, 1, 8, 8) and x_test.shape == (300, 1, 8, 8) and x.dtype == torch.float32
    assert torch.equal(x, train.tensors[0]) and torch.equal(y, train.tensors[1])
    assert torch.equal(x_test, val.tensors[0]) and torch.equal(y_test, val.tensors[1])
    clean = load_digits_arrays(seed=0)[1]
    assert np.array_equal(np.flatnonzero((clean != y).numpy()), flipped)
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_checkpoint_passes_carry_the_sum_of_the_step_learning_rates(kind: ModelKind, tmp_path: Path) -> None:
    x, y, x_test, y_test = load_digits_arrays(train_size=40)
    schedule = [0.1 / (1 + t) for t in range(15)]  # 5 steps per epoch, 3 epochs

    with StoreWriter(tmp_path / "store", encoding="fp32") as writer:
        capture = Capture(writer, passes={"train": (x[:10], y[:10]), "test": (x_test[:4], y_test[:4])})
        train_model(
            make_model(kind, 0), x, y, epochs=3, batch_size=8, seed=0, capture=capture, lr_at=schedule.__getitem__
        )
    store = open_store(tmp_path / "store")
    steps = store.metadata("train")
    assert np.allclose(steps["lr"], np.array(schedule)[steps["step"]])  # each step: its own lr
    for epoch in range(3):
        expected = sum(schedule[5 * epoch : 5 * epoch + 5])  # the steps since the previous pass
        for name in ("train", "test"):
            meta = store.metadata(f"epoch-{epoch}/{name}")
            assert np.allclose(meta["lr"], expected) and (meta["step"] == 5 * epoch + 5).all()
    assert np.array_equal(store.sample_ids("epoch-0/train"), np.arange(10))


@pytest.mark.parametrize("kind", ["mlp", "tokens", "positions"])
def test_a_tiny_run_reports_every_attributor(kind: lds.Kind) -> None:
    setup = lds.Setup(
        kind=kind, train_size=100, test_samples=8, tune_samples=6, subsets=50, tune_subsets=50, epochs=2,
        sketch_dims=(4,), ensemble=2, trak_regularizations=(0.1, 1.0), influence_functions=False, kronfluence=False,
        bootstrap=100, projected_dims=(8,),
    )  # fmt: skip
    result = lds.run(setup)
    rows = {row["attributor"]: row for row in result["attributors"]}
    for name in (
        "TracIn exact (checkpoint passes)",
        "TracIn in-run (training steps)",
        "EK-FAC in-run (each epoch's steps with its test pass)",
        "TracIn projected 4x4 (checkpoint passes)",
        "EK-FAC (checkpoint passes)",
        "K-FAC (checkpoint passes)",
        "EK-FAC (checkpoint passes), default damping: what the reports use",
        "EK-FAC (passes projected 8x8 on the eigenbasis)",
        "TracIn (passes projected 8x8 on the eigenbasis)",
        "EK-FAC in-run (steps projected 16x16 on the eigenbasis, basis_from='checkpoint')",
        "EK-FAC in-run (steps projected 16x16 on the eigenbasis, basis_from='steps')",
        "Default answer: influence(test=..., method='auto'), steps 16x16 + 256-sample passes",
        "Default answer: influence(test=..., method='auto'), exact steps + 256-sample passes",
        lds_defaults.ROW,
    ):
        row = rows[name]
        assert -1 <= row["ci95"][0] <= row["lds"] <= row["ci95"][1] <= 1 and row["trainings"] == 1
    assert rows["TracIn exact (checkpoint passes)"]["minus_exact_tracin"] == 0.0
    # the one line's answer: a row per training sample; the passes hold the attribution allowance's share (both sides
    # score those), the steps every other sample
    sources = rows[lds_defaults.ROW]["sources"]
    assert sum(sources.values()) == 100 and set(sources) == {"passes and steps", "steps"}, sources
    assert result["subset_trainings"] == 100
    assert "| TracIn exact (checkpoint passes) |" in lds.table(result)
    assert not any(name.startswith("Kronfluence") for name in rows)


def test_the_token_task_is_seeded_and_follows_its_rule() -> None:
    x, y, x_test, y_test = tokens.load_token_arrays(seed=0, train_size=500, noise=0.0)
    assert x.shape == (500, tokens.LENGTH) and x_test.shape == (tokens.TEST_SIZE, tokens.LENGTH)
    assert x.dtype == torch.long and 0 <= int(x.min()) and int(x.max()) < tokens.VOCAB
    assert np.array_equal(y.numpy(), tokens.token_rule(x.numpy())) and set(y.tolist()) == set(range(tokens.CLASSES))
    # a keyword votes for its class; after the negation token, against it
    row = np.full((1, tokens.LENGTH), tokens.NEGATION)  # votes nothing itself
    row[0, 0] = 1  # class 0's first keyword
    assert tokens.token_rule(row)[0] == 0
    row[0, :2] = [tokens.NEGATION, 1]
    assert tokens.token_rule(row)[0] != 0
    noisy = tokens.load_token_arrays(seed=0, train_size=500)
    assert torch.equal(noisy[0], x) and torch.equal(noisy[2], x_test)  # the same sequences
    flipped = (noisy[1] != y).float().mean().item()
    assert 0.05 < flipped < 0.15
    assert torch.equal(tokens.load_token_arrays(seed=0, train_size=200)[2], x_test)  # test set independent of N
    model = tokens.make_token_model(0)
    assert model(x[:5]).shape == (5, tokens.CLASSES)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), tokens.make_token_model(0).parameters()))


def test_the_learned_position_table_is_the_root_s_and_the_generic_rule_captures_it(tmp_path: Path) -> None:
    """The ``positions`` task: an ``nn.Parameter`` of the root module (no ``nn.Embedding``), stored as layer ``""``
    with each sample's dense ``(LENGTH, WIDTH)`` gradient, against torch.func's per-sample gradients."""
    from metastore_plugins.testing import reference_per_sample_gradients

    x, y, _, _ = tokens.load_token_arrays(seed=0, train_size=6)
    model = build_model("positions", 0)
    own = dict(model.named_parameters(recurse=False))
    assert list(own) == ["positions"] and own["positions"].shape == (tokens.LENGTH, tokens.WIDTH)
    assert not any(isinstance(m, torch.nn.Embedding) and m.weight is own["positions"] for m in model.modules())
    with StoreWriter(tmp_path / "store", encoding="fp32") as writer:
        train_model(model, x, y, epochs=1, batch_size=6, seed=0, capture=Capture(writer))
    store = open_store(tmp_path / "store")
    assert "" in store.layers() and "embed" in store.layers()
    (batch,) = list(store.select("train", layers=[""]).batches())
    (record,) = batch.records
    fresh = build_model("positions", 0)  # the weights of the step (the run above has since taken it)
    order = torch.randperm(6, generator=torch.Generator().manual_seed(0))  # train_model's shuffle
    expected = reference_per_sample_gradients(
        fresh, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]), (x[order], y[order])
    )["positions"]  # (B, LENGTH, WIDTH)
    got = record.dense_grad(next(iter(record.params)))  # (B, LENGTH, WIDTH), in the batch's order
    assert record.kind == "dense" and got.shape == expected.shape
    assert torch.allclose(got.double(), expected.double(), rtol=1e-4, atol=1e-6)


def test_kronfluence_is_skipped_when_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in sys.modules if name == "kronfluence" or name.startswith("kronfluence.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "kronfluence", None)  # import kronfluence raises ImportError
    setup = lds.Setup(train_size=60, test_samples=5, tune_samples=0, epochs=1)
    x, y, x_test, y_test = load_digits_arrays(train_size=60)
    rows = lds_peers.kronfluence_attributors(setup, (x, y, x_test[:5], y_test[:5]), [], None)
    assert list(rows) == ["Kronfluence EK-FAC"] and "not installed" in rows["Kronfluence EK-FAC"]["skipped"]
    result = {"attributors": [{"attributor": "Kronfluence EK-FAC", **rows["Kronfluence EK-FAC"]}]}
    assert "| Kronfluence EK-FAC | skipped: kronfluence is not installed" in lds.table(result)


def test_kronfluence_peer_runs_and_is_tuned() -> None:
    pytest.importorskip("kronfluence")
    setup = lds.Setup(
        train_size=60, test_samples=5, tune_samples=5, subsets=50, tune_subsets=50, epochs=2, sketch_dims=(),
        ensemble=1, trak_regularizations=(0.1,), kronfluence_dampings=(None, 0.01), influence_functions=False,
        bootstrap=100,
    )  # fmt: skip
    rows = {row["attributor"]: row for row in lds.run(setup)["attributors"]}
    for name in ("Kronfluence EK-FAC (final model)", "Kronfluence EK-FAC (2 epoch checkpoints)"):
        row = rows[name]
        assert "error" not in row, row.get("trace")
        assert np.isfinite(row["lds"]) and row["value"] in ("0.1 x mean eigenvalue", 0.01)
        assert set(row["tuning"]) == {"0.1 x mean eigenvalue", "0.01"} and row["trainings"] == 1


def test_dattri_peers_run_and_are_tuned() -> None:
    pytest.importorskip("dattri")
    setup = lds.Setup(
        train_size=60,
        test_samples=5,
        tune_samples=5,
        subsets=50,
        tune_subsets=50,
        epochs=1,
        sketch_dims=(),
        ensemble=2,
        trak_regularizations=(0.1, 1.0),
        dampings=(3.0,),
        kronfluence=False,
        bootstrap=100,
    )  # fmt: skip  (one damping: tuning it diagonalises a 4810 x 4810 Hessian, a minute here)
    rows = {row["attributor"]: row for row in lds.run(setup)["attributors"]}
    for name in (
        "dattri TRAK (final model)",
        "dattri TRAK (1 epoch checkpoints)",
        "dattri TRAK (ensemble of 2 models)",
    ):
        row = rows[name]
        assert "error" not in row, row.get("trace")
        assert np.isfinite(row["lds"]) and row["value"] in (0.1, 1.0) and len(row["tuning"]) == 2
    explicit = rows["dattri IF explicit (final model)"]
    assert "error" not in explicit, explicit.get("trace")
    assert np.isfinite(explicit["lds"]) and explicit["value"] == 3.0 and explicit["tuning"] == {}
    assert rows["dattri TRAK (ensemble of 2 models)"]["trainings"] == 2
