"""The result types of store queries (public: ``from metastore_plugins.core.analysis import Scores, ...``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from metastore_plugins.core import ops


@dataclass(frozen=True)
class Scores:
    """A score matrix with the sample ids of its rows (train) and columns (test)."""

    scores: np.ndarray  # (N, M)
    row_ids: np.ndarray  # (N,)
    col_ids: np.ndarray  # (M,)

    def top(self, k: int = 10) -> list[dict[str, Any]]:
        """Per column: the ``k`` rows with the largest (proponents) and smallest (opponents) scores."""
        ranked = ops.topk(torch.from_numpy(self.scores), k, dim=0)
        out = []
        for j, col in enumerate(self.col_ids.tolist()):
            pro = [(int(self.row_ids[i]), float(v)) for i, v in zip(ranked.proponents[j], ranked.proponent_scores[j])]
            opp = [(int(self.row_ids[i]), float(v)) for i, v in zip(ranked.opponents[j], ranked.opponent_scores[j])]
            out.append({"sample_id": col, "proponents": pro, "opponents": opp})
        return out


@dataclass(frozen=True)
class DefaultScores(Scores):
    """``store.influence(test=...)`` with ``train`` left out: every training sample's row, and what scored it.

    Attributes:
        train_side: ``"passes"``, ``"steps"`` or ``"passes and steps"``: where the training side came from.
        methods: per side (``"passes"``, ``"steps"``), the method that scored it.
        sources: ``(N,)`` per row, ``"passes"``, ``"steps"``, ``"passes and steps"`` (the mean of the two) or
            ``"none"`` (no scorable record: zeros).
        notes: what the store chose and why (a fallback to TracIn, the steps' scale factor), in words.
    """

    train_side: str = ""
    methods: dict[str, str] = field(default_factory=dict)
    sources: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=object))  # (N,)
    notes: list[str] = field(default_factory=list)


class WeightChange(NamedTuple):
    """One weight entry and its aggregated ``sum_t lr_t sum_i |g_i[index]|``."""

    param: str
    index: tuple[int, ...]  # type: ignore[assignment]  # the entry's index; shadows tuple.index on purpose
    value: float


@dataclass(frozen=True)
class Contributors:
    """Per entry of one parameter, the sample occurrences with the largest ``|g_i[entry]|``.

    Attributes:
        param: the parameter's name.
        entries: ``E`` index tuples into the parameter.
        sample_ids, steps: ``(E, k)`` int64: who, and at which step.
        values: ``(E, k)`` float64 signed per-sample gradients, largest magnitude first.
    """

    param: str
    entries: list[tuple[int, ...]]
    sample_ids: np.ndarray
    steps: np.ndarray
    values: np.ndarray

    def rows(self) -> list[dict[str, Any]]:
        """One dict per entry: ``{"entry", "contributors": [(sample_id, step, value), ...]}``."""
        return [
            {
                "entry": entry,
                "contributors": [
                    (int(i), int(s), float(v)) for i, s, v in zip(self.sample_ids[e], self.steps[e], self.values[e])
                ],
            }
            for e, entry in enumerate(self.entries)
        ]


@dataclass(frozen=True)
class Spike:
    """A step where too many per-sample gradient norms exceeded the threshold.

    Attributes:
        step: the step.
        fraction: fraction of its samples whose norm exceeded the threshold.
        steps_before: the stored steps of the look-back window, ascending.
        sample_ids: ``(n,)`` the samples seen in them (unique, in the order seen).
    """

    step: int
    fraction: float
    steps_before: list[int]
    sample_ids: np.ndarray


@dataclass(frozen=True)
class Clusters:
    """k-means of gradient sketches: ``labels[n]`` is the cluster of occurrence ``sample_ids[n]``."""

    sample_ids: np.ndarray  # (N,)
    labels: np.ndarray  # (N,)
    centroids: np.ndarray  # (k, dim)
    inertia: float


@dataclass(frozen=True)
class LayerComparison:
    """One layer in two runs: mean per-sample gradient norms, ``ratio = mean_norm / other_mean_norm``,
    and the cosine between the cumulative updates ``sum_t lr_t g_t`` of the two runs: ``None`` where a run
    does not hold them (the layer kept projected or as norms only at some step; a zero update), which
    :attr:`RunComparison.notes` says."""

    layer: str
    mean_norm: float
    other_mean_norm: float
    ratio: float
    update_cosine: float | None


@dataclass(frozen=True)
class RunComparison:
    """:meth:`GradientStore.compare`: per layer, and per step (union of both runs' steps, NaN where absent)."""

    layers: list[LayerComparison]
    steps: np.ndarray  # (S,)
    norm: np.ndarray  # (S,) mean whole-model per-sample gradient norm of this run
    other_norm: np.ndarray
    loss: np.ndarray  # (S,) mean recorded loss
    other_loss: np.ndarray
    notes: list[str] = field(default_factory=list)  # why a value is missing (an update_cosine of None)
