"""Training-dynamics signals (AUM, forgetting events, data maps) against values worked out by hand,
and on a tiny real run against logits computed independently before each step."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core.analysis.signals import signals_from_metadata, suspicion, training_signals
from metastore_plugins.core.training.passes import capture_step


def _meta(rows: list[tuple[int, int, float, int, int, float]]) -> dict[str, np.ndarray]:
    """Rows ``(sample_id, step, loss, label, prediction, margin)``."""
    columns = list(zip(*rows))
    return {
        "sample_id": np.array(columns[0], dtype=np.int64),
        "step": np.array(columns[1], dtype=np.int64),
        "loss": np.array(columns[2], dtype=np.float32),
        "label": np.array(columns[3], dtype=np.int64),
        "prediction": np.array(columns[4], dtype=np.int64),
        "margin": np.array(columns[5], dtype=np.float32),
    }


def test_hand_computed_signals() -> None:
    ln = math.log
    rows = [  # shuffled on purpose: the signals take each sample's occurrences in step order
        (7, 2, -ln(0.5), 1, 1, 0.5),  # sample 7: correct, wrong, correct, wrong -> 2 forgetting events
        (3, 0, -ln(0.2), 0, 2, -1.0),  # sample 3: never predicted right -> never learned
        (7, 0, -ln(0.9), 1, 1, 2.0),
        (7, 3, -ln(0.1), 1, 0, -2.5),
        (3, 1, -ln(0.4), 0, 2, -0.25),
        (7, 1, -ln(0.3), 1, 2, -1.0),
        (9, 5, -ln(0.8), 2, 2, 1.5),  # sample 9: one occurrence, correct
    ]
    got = signals_from_metadata(_meta(rows))
    np.testing.assert_array_equal(got.sample_ids, [3, 7, 9])
    np.testing.assert_array_equal(got.occurrences, [2, 4, 1])
    np.testing.assert_allclose(got.aum, [(-1.0 - 0.25) / 2, (2.0 - 1.0 + 0.5 - 2.5) / 4, 1.5], rtol=1e-6)
    assert got.forgetting[0] == np.inf and got.forgetting[1] == pytest.approx(2.0) and got.forgetting[2] == 0.0
    np.testing.assert_allclose(got.correctness, [0.0, 0.5, 1.0])
    np.testing.assert_allclose(got.confidence, [0.3, (0.9 + 0.3 + 0.5 + 0.1) / 4, 0.8], rtol=1e-6)
    p7 = np.array([0.9, 0.3, 0.5, 0.1])
    np.testing.assert_allclose(got.variability, [0.1, p7.std(), 0.0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.mean_loss, [-(ln(0.2) + ln(0.4)) / 2, -np.log(p7).mean(), -ln(0.8)], rtol=1e-6)
    np.testing.assert_allclose(got.last_loss, [-ln(0.4), -ln(0.1), -ln(0.8)], rtol=1e-6)
    # suspicious is larger: low AUM, low confidence, never learned
    assert np.argmax(suspicion(got, "aum")) == 0 and np.argmax(suspicion(got, "confidence")) == 0
    assert np.argmax(suspicion(got, "forgetting")) == 0 and np.argmin(suspicion(got, "mean_loss")) == 2


def test_missing_margin_and_prediction_read_as_unknown() -> None:
    meta = _meta([(1, 0, 0.5, 0, -1, 0.0), (1, 1, 0.25, 0, -1, 0.0)])
    del meta["margin"]
    got = signals_from_metadata(meta)
    assert np.isnan(got.aum).all() and got.forgetting[0] == np.inf  # no prediction stored: never known correct
    with pytest.raises(ValueError, match="'loss'"):
        signals_from_metadata({"sample_id": np.zeros(1), "step": np.zeros(1)})
    with pytest.raises(ValueError, match="unknown training signal 'auc'"):
        got.column("auc")


def test_tiny_run_against_independent_logits(tmp_path: Path) -> None:
    """Three SGD steps on 6 samples (2 per step, 2 epochs): margins, correctness and p_t taken from the model's
    own logits before each step, computed here without the store."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    expected: dict[int, list[tuple[float, bool, float]]] = {i: [] for i in range(6)}
    step = 0
    with StoreWriter(tmp_path / "store", encoding="fp32") as writer:
        for epoch in range(2):
            for ids in torch.randperm(6).split(2):
                with torch.no_grad():
                    logits = model(x[ids]).double()  # (2, 3)
                for row, sid in enumerate(ids.tolist()):
                    z, label = logits[row], int(y[sid])
                    other = torch.cat([z[:label], z[label + 1 :]]).max()
                    p = torch.softmax(z, 0)[label]
                    expected[sid].append((float(z[label] - other), bool(z.argmax() == label), float(p)))
                per_sample = lambda out, labels: F.cross_entropy(out, labels, reduction="none")  # noqa: E731
                capture_step(
                    model, lambda ids=ids: model(x[ids]), y[ids], ids, per_sample, writer, step=step, epoch=epoch
                )
                optimizer.step()
                optimizer.zero_grad()
                step += 1
    got = training_signals(open_store(tmp_path / "store"))
    np.testing.assert_array_equal(got.sample_ids, np.arange(6))
    for sid in range(6):
        margins, correct, probs = (np.array(column) for column in zip(*expected[sid]))
        assert got.aum[sid] == pytest.approx(margins.mean(), rel=1e-5, abs=1e-6)
        assert got.confidence[sid] == pytest.approx(probs.mean(), rel=1e-5)
        assert got.variability[sid] == pytest.approx(probs.std(), rel=1e-4, abs=1e-6)
        assert got.correctness[sid] == pytest.approx(correct.mean())
        events = float(correct[0] and not correct[1]) if correct.any() else np.inf
        assert got.forgetting[sid] == events
