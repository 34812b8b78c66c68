"""The data map (Swayamdipta et al. 2020): each training sample's confidence against its variability.

Both come from the training steps' per-sample losses (:mod:`~metastore_plugins.core.analysis.signals`):
confidence is the mean probability of the labelled class over the sample's training steps,
``p_t = exp(-loss_t)`` (exact for cross-entropy, the default loss), and variability its standard
deviation. Easy samples sit top left, ambiguous ones to the right, and hard-to-learn ones
(mislabelled samples among them) bottom left. Colour is correctness (the fraction of steps
predicted right); the outlier report's samples are ringed.

Example::

    figure = data_map_figure(training_signals(store), flagged=[row["sample_id"] for row in rows])
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import numpy as np

from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.analysis.signals import TRAINING_STEPS, TrainingSignals, training_signals
from metastore_plugins.core.reports.render import flagged_ids, new_figure, ring_points

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def map_signals(store: GradientStore) -> TrainingSignals | None:
    """The training signals a data map needs, or ``None``: no training steps, no class predictions
    (regression), or no sample trained in two steps or more (no variability to show)."""
    if TRAINING_STEPS not in store.capture_points():
        return None
    meta = store.metadata(TRAINING_STEPS)
    if not len(meta["sample_id"]) or not (np.asarray(meta["prediction"]) >= 0).any():
        return None
    signals = training_signals(store)
    return signals if (signals.occurrences >= 2).any() else None


def data_map_figure(
    signals: TrainingSignals, flagged: Collection[int] = (), *, flagged_label: str = "outlier report rows"
) -> Figure:
    """Confidence (y) against variability (x) of every trained sample, coloured by correctness.

    Samples whose id is in ``flagged`` get a black ring, counted in the legend."""
    x, y = np.asarray(signals.variability), np.asarray(signals.confidence)
    figure = new_figure(8.0, 4.8, layout="constrained")
    axes = figure.add_subplot()
    points = axes.scatter(x, y, c=signals.correctness, cmap="RdYlBu", vmin=0.0, vmax=1.0, s=12, alpha=0.8, linewidths=0)
    figure.colorbar(points, ax=axes, label="correctness (fraction of steps predicted right)", pad=0.01)
    ring = np.isin(signals.sample_ids, flagged_ids(flagged))
    if ring.any():
        ring_points(axes, x, y, ring, size=60, label=f"{flagged_label} ({int(ring.sum())})")
        axes.legend(loc="upper right", fontsize=8, frameon=True)
    for text, (px, py) in (("easy to learn", (0.02, 0.97)), ("hard to learn", (0.02, 0.03))):
        axes.text(
            px, py, text, transform=axes.transAxes, fontsize=8, color="#555555", va="top" if py > 0.5 else "bottom"
        )
    axes.text(0.98, 0.5, "ambiguous", transform=axes.transAxes, fontsize=8, color="#555555", ha="right")
    axes.set_xlabel("variability: std of p(label) over the sample's training steps")
    axes.set_ylabel("confidence: mean p(label) = mean exp(-loss)")
    axes.set_ylim(-0.02, 1.02)
    axes.set_xlim(left=0.0)
    axes.set_title(f"Data map of {len(x)} training samples (Swayamdipta et al. 2020)", fontsize=10)
    axes.grid(True, linewidth=0.4, alpha=0.5)
    return figure


__all__ = ["data_map_figure", "map_signals"]
