"""The training steps' gradient dynamics at a glance: one layer x step picture and a few scalars.

:func:`gradient_map` turns the per-sample, per-layer gradient norms of the training steps
(``store.norms("train", by_layer=True)``) into a ``layers x steps`` matrix: the mean
per-sample norm of each layer at each step. :func:`heatmap_figure` draws it in log colour,
layers in model order, with the spikes ringed; :func:`write_dynamics` logs the summary
scalars (at most three charts; one per layer only with ``per_layer_scalars=True``).

Example::

    gmap = gradient_map(store.norms("train", by_layer=True), store.metadata("train")["step"])
    save_png(heatmap_figure(gmap), "gradient_norms.png")
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from metastore_plugins.core import ops
from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.reports.render import new_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: a layer "spikes" at a step where its mean norm is more than this many times its median over the steps
SPIKE_FACTOR = 10.0
#: the most layer names written on the heatmap's axis (every n-th beyond it)
MAX_LAYER_LABELS = 80


@dataclass(frozen=True)
class GradientMap:
    """Mean per-sample gradient norms of each layer at each training step.

    ``values[l, s]``: the mean over step ``steps[s]``'s samples of layer ``layers[l]``'s per-sample
    gradient norm (NaN where the step keeps nothing of the layer). Layers are in model order.
    ``spikes[l, s]``: the value exceeds :data:`SPIKE_FACTOR` times the layer's median over the steps.
    ``worst``: the layer whose largest value is the largest multiple of its own median (``None``
    without values); ``peak``: that multiple.
    """

    layers: list[str]
    steps: np.ndarray  # (S,) int64, ascending
    values: np.ndarray  # (L, S) float64
    spikes: np.ndarray  # (L, S) bool
    worst: str | None
    peak: float


def step_means(values: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(unique steps, mean of the finite values at each)``; NaN for a step without one."""
    unique, inverse = np.unique(np.asarray(steps, dtype=np.int64), return_inverse=True)
    finite = np.isfinite(values)
    sums = np.bincount(inverse, weights=np.where(finite, values, 0.0), minlength=len(unique))
    counts = np.bincount(inverse, weights=finite.astype(np.float64), minlength=len(unique))
    with np.errstate(invalid="ignore", divide="ignore"):
        return unique, np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def gradient_map(norms: Mapping[str, np.ndarray], steps: np.ndarray, spike_factor: float = SPIKE_FACTOR) -> GradientMap:
    """The :class:`GradientMap` of per-sample norms ``{layer: (N,)}`` at ``steps`` ``(N,)``.

    ``norms`` in the store's order, which is the order back-propagation reaches the layers:
    reversed, that is the model's forward order.
    """
    layers = list(norms)[::-1]
    unique = np.unique(np.asarray(steps, dtype=np.int64))
    values = np.full((len(layers), len(unique)), np.nan)
    for row, layer in enumerate(layers):
        values[row] = step_means(np.asarray(norms[layer], dtype=np.float64), steps)[1]  # (S,)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a layer with no values: all-NaN rows
        medians = np.nanmedian(values, axis=1) if values.size else np.zeros(len(layers))  # (L,)
        ratios = values / np.where(medians > 0, medians, np.nan)[:, None]  # (L, S)
    spikes = np.nan_to_num(ratios, nan=0.0) > spike_factor
    peaks = np.nanmax(np.where(np.isfinite(ratios), ratios, -np.inf), axis=1) if values.size else np.zeros(0)
    worst = int(np.argmax(peaks)) if len(peaks) and np.isfinite(peaks).any() else None
    return GradientMap(
        layers,
        unique,
        values,
        spikes,
        None if worst is None else layers[worst],
        float(peaks[worst]) if worst is not None else float("nan"),
    )


def heatmap_figure(gmap: GradientMap, *, spike_factor: float = SPIKE_FACTOR) -> Figure:
    """The layer x step heatmap of ``gmap``: log colour, model order top to bottom, spikes ringed in red.

    The worst layer's name is red; cells without a value are grey."""
    rows, columns = gmap.values.shape
    figure = new_figure(9.0, min(2.4 + 0.14 * rows, 16.0), layout="constrained")  # ImportError naming the extra
    from matplotlib import colormaps
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    axes = figure.add_subplot()
    positive = gmap.values[np.isfinite(gmap.values) & (gmap.values > 0)]
    low, high = (float(positive.min()), float(positive.max())) if len(positive) else (1e-12, 1.0)
    cmap = colormaps["viridis"].with_extremes(bad="#d9d9d9")
    shown = np.ma.masked_invalid(np.where(gmap.values > 0, gmap.values, np.nan))
    image = axes.imshow(
        shown, aspect="auto", interpolation="nearest", cmap=cmap, norm=LogNorm(low, max(high, low * 1.0001))
    )
    figure.colorbar(image, ax=axes, label="mean per-sample norm", pad=0.01, fraction=0.04, aspect=30)
    spike_rows, spike_cols = np.nonzero(gmap.spikes)
    if len(spike_rows):
        axes.scatter(spike_cols, spike_rows, s=36, facecolors="none", edgecolors="red", linewidths=1.0)
    every = max(1, -(-rows // MAX_LAYER_LABELS))
    axes.set_yticks(range(0, rows, every), [gmap.layers[r] for r in range(0, rows, every)], fontsize=7)
    for label in axes.get_yticklabels():
        if label.get_text() == gmap.worst:
            label.set_color("red")
    steps = gmap.steps
    axes.xaxis.set_major_locator(MaxNLocator(nbins=12, integer=True))
    axes.xaxis.set_major_formatter(
        FuncFormatter(lambda x, _: str(int(steps[int(round(x))])) if 0 <= round(x) < len(steps) else "")
    )
    axes.set_xlabel("training step")
    worst = f"\nworst layer (red): {gmap.worst}, peak {gmap.peak:.3g}x its median" if gmap.worst else ""
    figure.suptitle(
        f"Per-sample gradient norm, mean per layer and step: {rows} layers, {columns} steps (log colour){worst}\n"
        f"red rings: {len(spike_rows)} spikes (> {spike_factor:g}x the layer's median)",
        fontsize=9,
    )
    return figure


def write_dynamics(
    writer: Any,
    store: GradientStore,
    *,
    capture_point: str = "train",
    prefix: str = "metastore",
    explode_factor: float = 10.0,
    norms: dict[str, np.ndarray] | None = None,
    per_layer_scalars: bool = False,
) -> list[str]:
    """Summary scalars of the training steps, gradient-norm histograms per epoch; returns the tags.

    Scalars per step: ``grad_norm_total`` (the mean per-sample whole-model gradient norm),
    ``exploding_fraction`` (of the per-sample gradients whose norm exceeds ``explode_factor``
    times the run's median) and ``grad_norm_worst_layer/{layer}`` (the mean norm of
    :attr:`GradientMap.worst`). ``per_layer_scalars``: also ``grad_norm/{layer}`` for every
    layer (the heatmap shows them all in one figure). ``norms``: :func:`dynamics_norms` when at hand.
    """
    by_layer = norms if norms is not None else dynamics_norms(store, capture_point)
    if by_layer is None:
        return []
    meta = store.metadata(capture_point)
    steps, epochs = meta["step"], meta["epoch"]
    total = np.sqrt(sum((values**2 for values in by_layer.values()), np.zeros(len(steps))))  # (N,) whole-model norms
    tags = []
    series = {"grad_norm_total": total}
    worst = gradient_map(by_layer, steps).worst
    if worst is not None:
        series[f"grad_norm_worst_layer/{worst}"] = by_layer[worst]
    if per_layer_scalars:
        series.update({f"grad_norm/{layer}": values for layer, values in by_layer.items()})
    for name, values in series.items():
        for step, mean in zip(*step_means(values, steps)):
            if np.isfinite(mean):
                writer.add_scalar(f"{prefix}/{name}", float(mean), int(step))
        tags.append(f"{prefix}/{name}")
    for epoch in np.unique(epochs):
        held = total[(epochs == epoch) & np.isfinite(total)]  # steps kept as metadata only have no norm
        if len(held):
            writer.add_histogram(f"{prefix}/grad_norm_per_epoch", held, int(epoch))
    threshold = explode_factor * float(np.median(total)) if len(total) else 0.0
    fractions = ops.step_exceed_fractions(
        torch.from_numpy(total), torch.from_numpy(np.asarray(steps, dtype=np.int64)), threshold
    )  # from the norms at hand
    for step, fraction in zip(*fractions):
        writer.add_scalar(f"{prefix}/exploding_fraction", float(fraction), int(step))
    return [*tags, f"{prefix}/grad_norm_per_epoch", f"{prefix}/exploding_fraction"]


def dynamics_norms(store: GradientStore, capture_point: str = "train") -> dict[str, np.ndarray] | None:
    """Per-layer gradient norms ``{layer: (N,)}`` of ``capture_point`` (one pass over its records), or ``None``."""
    if capture_point not in store.capture_points():
        return None
    return dict(store.norms(capture_point, by_layer=True))


__all__ = [
    "SPIKE_FACTOR",
    "GradientMap",
    "dynamics_norms",
    "gradient_map",
    "heatmap_figure",
    "step_means",
    "write_dynamics",
]
