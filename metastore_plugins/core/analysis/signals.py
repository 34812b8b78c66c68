"""Training-dynamics signals per sample, from the per-step metadata the store already holds.

Every training step stores, per sample, its label, loss, arg-max prediction and margin
(:mod:`metastore_plugins.core.store`). Across the steps a sample was trained in
(``t = 1..T_i``, in step order) these give the label-noise signals of the literature,
with no gradient read:

- mean loss ``(1/T) sum_t loss_t``, and the loss at the last occurrence;
- area under the margin (AUM, Pleiss et al. 2020): ``(1/T) sum_t (z_{t,y} - max_{k != y} z_{t,k})``,
  the labelled class's logit minus the largest other one, averaged; mislabelled samples
  have low (negative) AUM;
- forgetting events (Toneva et al. 2019): the number of ``t`` with ``correct_{t-1}`` and not
  ``correct_t`` (``correct_t``: prediction equals label); a sample never predicted right
  is *never learned*, ranked above every forgettable one;
- data maps (Swayamdipta et al. 2020): confidence ``mu = (1/T) sum_t p_t`` and variability
  ``sigma = sqrt((1/T) sum_t (p_t - mu)^2)`` of the labelled class's probability
  ``p_t = exp(-loss_t)`` (exact for cross-entropy, the default loss), and correctness
  ``(1/T) sum_t correct_t``. Mislabelled samples sit at low confidence, low variability.

:func:`suspicion` turns a signal into a score that is larger for a more suspicious sample.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

import numpy as np

from metastore_plugins.core.errors import ConfigError, StoreError
from metastore_plugins.core.store import StoreReader

#: the capture point of the training steps
TRAINING_STEPS = "train"
Signal = Literal["mean_loss", "last_loss", "aum", "forgetting", "confidence", "variability", "correctness"]
SIGNALS: tuple[str, ...] = get_args(Signal)
#: +1: larger is more suspicious; -1: smaller is (mislabelled samples have low AUM, confidence, correctness)
_DIRECTION = {"mean_loss": 1, "last_loss": 1, "aum": -1, "forgetting": 1, "confidence": -1, "variability": 1}
_DIRECTION["correctness"] = -1


@dataclass(frozen=True)
class TrainingSignals:
    """Per-sample signals over the training steps, aligned with ``sample_ids`` (ascending).

    Float columns are ``(N,)`` float64; ``aum`` is NaN for samples with no stored margin
    (regression, or a store written before margins were kept).
    """

    sample_ids: np.ndarray  # (N,) int64
    occurrences: np.ndarray  # (N,) int64: training steps the sample was seen at
    mean_loss: np.ndarray
    last_loss: np.ndarray
    aum: np.ndarray
    forgetting: np.ndarray  # (N,) float64: forgetting events, +inf for a never-learned sample
    confidence: np.ndarray
    variability: np.ndarray
    correctness: np.ndarray

    def column(self, signal: str) -> np.ndarray:
        """The ``(N,)`` values of one signal by name (one of :data:`SIGNALS`)."""
        if signal not in SIGNALS:
            raise ConfigError(f"unknown training signal {signal!r}; choose one of {SIGNALS}")
        return np.asarray(getattr(self, signal))

    def rows(self) -> dict[int, dict[str, Any]]:
        """``{sample id: {signal: value}}`` (JSON-ready floats)."""
        names = [f.name for f in fields(self) if f.name != "sample_ids"]
        return {
            int(sid): {name: float(getattr(self, name)[k]) for name in names}
            for k, sid in enumerate(self.sample_ids.tolist())
        }


def suspicion(signals: TrainingSignals, signal: str) -> np.ndarray:
    """``(N,)`` scores, larger for a more suspicious sample (NaN stays NaN)."""
    return _DIRECTION[signal] * signals.column(signal)


def signals_from_metadata(meta: Mapping[str, np.ndarray]) -> TrainingSignals:
    """The signals of per-occurrence columns ``sample_id, step, loss, label, prediction`` (and ``margin``).

    Pure: rows may come in any order; each sample's occurrences are taken in step order
    (micro-batch order within a step). ``prediction`` -1 (not stored) counts as not correct.
    """
    for key in ("sample_id", "step", "loss"):
        if key not in meta:
            raise StoreError(f"training-step metadata needs a {key!r} column; it has {sorted(meta)}")
    sample_id = np.asarray(meta["sample_id"], dtype=np.int64)
    n_rows = len(sample_id)
    micro = np.asarray(meta.get("micro_batch", np.zeros(n_rows)), dtype=np.int64)
    order = np.lexsort((micro, np.asarray(meta["step"], dtype=np.int64), sample_id))  # by id, then step
    ids = sample_id[order]
    loss = np.asarray(meta["loss"], dtype=np.float64)[order]
    margin = np.asarray(meta.get("margin", np.full(n_rows, np.nan)), dtype=np.float64)[order]
    label, prediction = meta.get("label"), meta.get("prediction")
    correct = (
        np.zeros(n_rows, dtype=bool)
        if label is None or prediction is None
        else (np.asarray(prediction)[order] == np.asarray(label)[order]) & (np.asarray(prediction)[order] >= 0)
    )
    unique, starts, counts = np.unique(ids, return_index=True, return_counts=True)
    confidence_t = np.exp(-loss)  # (rows,) p_t of the labelled class under cross-entropy
    mean = lambda values: np.add.reduceat(values, starts) / counts if n_rows else np.zeros(0)  # noqa: E731
    confidence = mean(confidence_t)
    variability = np.sqrt(np.maximum(mean(confidence_t**2) - confidence**2, 0.0))
    first = np.zeros(n_rows, dtype=bool)
    first[starts] = True
    forgotten = np.zeros(n_rows)
    forgotten[1:] = correct[:-1] & ~correct[1:]
    forgotten[first] = 0.0  # no event across two samples
    learned = np.add.reduceat(correct.astype(np.float64), starts) if n_rows else np.zeros(0)
    forgetting = np.where(learned > 0, np.add.reduceat(forgotten, starts) if n_rows else 0.0, np.inf)
    return TrainingSignals(
        sample_ids=unique.astype(np.int64),
        occurrences=counts.astype(np.int64),
        mean_loss=mean(loss),
        last_loss=loss[starts + counts - 1] if n_rows else np.zeros(0),
        aum=mean(margin),
        forgetting=forgetting.astype(np.float64),
        confidence=confidence,
        variability=variability,
        correctness=learned / counts if n_rows else np.zeros(0),
    )


def training_signals(store: StoreReader, capture_point: str = TRAINING_STEPS, **where: Any) -> TrainingSignals:
    """Per-sample training-dynamics signals of ``capture_point`` (the training steps by default).

    Reads only the per-sample metadata (no gradient). ``where``: the selection filters of
    :meth:`~metastore_plugins.core.store.StoreReader.metadata` (``steps=``, ``epochs=``, ...).
    """
    if capture_point not in store.capture_points():
        raise StoreError(
            f"the store has no capture point {capture_point!r} (training steps captured with "
            f"capture_train_steps=True); it has {store.capture_points()}"
        )
    return signals_from_metadata(store.metadata(capture_point, **where))
