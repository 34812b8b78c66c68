"""The digits MLP and CNN as label-error tasks (:class:`~.label_errors.Task`).

One captured run trains 4 epochs of SGD (lr 0.1, momentum 0.9, batch 32, as
``examples/lightning_digits.py``) and records every training step and a checkpoint pass of
all training samples at each epoch end, exact in fp32.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from metastore_plugins import StoreWriter

from .digits import Capture, ModelKind, load_digits_arrays, make_model, train_model


class DigitsTask:
    """scikit-learn's digits (the example's split) with the MLP or the CNN of :mod:`.digits`."""

    classes = 10

    def __init__(self, kind: ModelKind, train_size: int = 1497, epochs: int = 4) -> None:
        self.kind, self.epochs = kind, epochs
        self.x, clean, _, _ = load_digits_arrays(0, train_size)
        self.labels = clean.numpy()

    def _train(
        self, rows: np.ndarray, labels: np.ndarray, seed: int, capture: Capture | None = None
    ) -> torch.nn.Module:
        model = make_model(self.kind, seed)
        y = torch.from_numpy(labels[rows])
        return train_model(model, self.x[rows], y, epochs=self.epochs, seed=seed, capture=capture)

    def _probs(self, model: torch.nn.Module, rows: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return torch.softmax(model(self.x[rows]).double(), 1).numpy()  # (R, 10)

    def clean_probs(self, seed: int) -> np.ndarray:
        """``(N, 10)`` probabilities of a model trained on the clean labels, on its own training samples."""
        rows = np.arange(len(self.labels))
        return self._probs(self._train(rows, self.labels, seed + 1000), rows)

    def captured_run(self, labels: np.ndarray, out: Path, seed: int) -> tuple[Path, float]:
        """Train on ``labels`` with every step and a pass per epoch captured; ``(store directory, seconds)``."""
        rows = np.arange(len(labels))
        start = time.perf_counter()
        with StoreWriter(out / "store", encoding="fp32") as writer:
            passes = {"train": (self.x, torch.from_numpy(labels))}
            self._train(rows, labels, seed, Capture(writer, passes=passes))
        return out / "store", time.perf_counter() - start

    def fold_probs(self, labels: np.ndarray, train_rows: np.ndarray, held_rows: np.ndarray, seed: int) -> np.ndarray:
        """``(len(held_rows), 10)`` probabilities of a model trained on ``train_rows`` only."""
        return self._probs(self._train(train_rows, labels, seed), held_rows)
