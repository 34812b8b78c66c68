"""Write the report tables through a TensorBoard ``SummaryWriter`` (or any object with its methods).

- markdown tables (outliers, influence) via ``add_text``;
- self-influence of the training samples per labelled class via ``add_histogram``;
- figures drawn with matplotlib, saved as PNGs next to the JSON reports and logged with the pixels of that
  drawing (``add_image``; ``add_figure`` for a writer without it, or a figure not drawn yet):
  the loss-vs-self-influence scatter (``loss_vs_self_influence.png``), the data map
  (``data_map.png``, :mod:`~.datamap`), the layer x step heatmap of gradient norms
  (``gradient_norms.png``, :mod:`~.dynamics`) and, for image samples, a thumbnail grid of the
  top outliers (``outliers.png``) and one figure per test sample of the influence report
  (``influence-val_{id}.png``, :mod:`~.samples`); without matplotlib they are skipped with a warning;
- dynamics of the training steps: three summary scalars (total gradient norm, exploding
  fraction, the worst layer's norm; per-layer scalars with ``per_layer_scalars=True``) and
  gradient-norm histograms per epoch;
- a projector view (``add_embedding``) of gradient sketches of the last training checkpoint pass.

The report pass that runs the queries and calls these is
:func:`metastore_plugins.core.training.report_pass.report_run` (``report_run`` here is its deprecated path).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from metastore_plugins.core._moved import moved_module
from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.errors import MissingDependencyError
from metastore_plugins.core.reports import OUTLIER_COLUMNS
from metastore_plugins.core.reports.datamap import data_map_figure, map_signals
from metastore_plugins.core.reports.dynamics import GradientMap, heatmap_figure
from metastore_plugins.core.reports.dynamics import write_dynamics as write_dynamics
from metastore_plugins.core.reports.files import influence_markdown
from metastore_plugins.core.reports.render import SampleLookup, drawn_pixels, save_png, scatter_figure
from metastore_plugins.core.reports.samples import influence_figures
from metastore_plugins.core.reports.tables import (
    last_metadata,
    outlier_markdown,
    self_influence_of,
)
from metastore_plugins.core.reports.thumbnails import outlier_grid

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: the scatter's tag (under the prefix) and file name (``.png``)
SCATTER = "loss_vs_self_influence"


class SummaryWriterLike(Protocol):
    """What the reports call on a writer: ``torch.utils.tensorboard.SummaryWriter`` (Lightning's
    ``TensorBoardLogger.experiment``, the HF path's :func:`summary_writer`) and ``tensorboardX``'s have it."""

    def add_text(self, tag: str, text_string: str, global_step: int | None = None) -> None: ...
    def add_histogram(self, tag: str, values: Any, global_step: int | None = None) -> None: ...
    def add_figure(self, tag: str, figure: Any, global_step: int | None = None, close: bool = True) -> None: ...


def summary_writer(log_dir: str | os.PathLike[str]) -> Any:
    """A ``torch.utils.tensorboard.SummaryWriter`` for ``log_dir`` (tensorboard imported only now)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise MissingDependencyError(
            "TensorBoard reports need the tensorboard package: pip install 'metastore_plugins[lightning]' "
            "(or pip install tensorboard); file reports need nothing more"
        ) from exc
    return SummaryWriter(str(log_dir))


def self_influence_table(
    store: GradientStore, points: Sequence[str], scores: tuple[np.ndarray, np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    """Every training sample of ``points``: ``sample_id``, ``self_influence``, ``label``, ``loss``."""
    ids, values = scores if scores is not None else self_influence_of(store, points)
    meta = last_metadata(store, points)
    labels = np.array([meta[int(i)]["label"] if isinstance(meta[int(i)]["label"], int) else -1 for i in ids])
    losses = np.array([meta[int(i)]["loss"] for i in ids], dtype=np.float64)
    return {"sample_id": np.asarray(ids), "self_influence": values, "label": labels, "loss": losses}


def flagged_ids(reports: Mapping[str, Any]) -> list[int]:
    """The sample ids of the outlier report's rows (the samples the scatter rings)."""
    return [int(row["sample_id"]) for row in reports.get("outliers") or [] if "sample_id" in row]


def draw_scatter(reports: Mapping[str, Any], table: Mapping[str, np.ndarray] | None) -> Figure | None:
    """The loss-vs-self-influence scatter of ``table``, outlier rows ringed; ``None`` with no samples.

    Raises ``ImportError`` (naming the extra to install) without matplotlib."""
    if table is None or not len(table["sample_id"]):
        return None
    return scatter_figure(table, flagged_ids(reports), flagged_label="outlier report rows")


def _no_figures(exc: ImportError) -> None:
    warnings.warn(f"no report figures: {exc}; the tables and histograms are written", stacklevel=3)


def write_tensorboard(
    writer: SummaryWriterLike,
    reports: dict[str, Any],
    table: dict[str, np.ndarray] | None = None,
    *,
    step: int = 0,
    prefix: str = "metastore",
    figures: Mapping[str, Figure] | None = None,
) -> list[str]:
    """Write the outlier and influence tables, histograms and figures; returns the tags written.

    ``figures``: ``{tag: Figure}`` to log under ``prefix/tag`` (as drawn by :func:`report_figures`);
    by default the scatter of ``table`` is drawn here.
    """
    tags = []
    if reports.get("outliers"):
        columns = reports.get("outlier_columns", OUTLIER_COLUMNS)
        caption = reports.get("outlier_caption", [])
        writer.add_text(f"{prefix}/outliers", outlier_markdown(reports["outliers"], columns, caption), step)
        tags.append(f"{prefix}/outliers")
    if reports.get("influence"):
        text = influence_markdown(reports["influence"])
        pictured = [tag for tag in figures or () if tag.startswith("influence_samples/")]
        if pictured:  # image samples: the table gives ids, the figures show the samples
            text += (
                f"\nThe samples themselves, with labels and scores: the Images tab, {prefix}/influence_samples/ "
                f"(the first {len(pictured)} test samples).\n"
            )
        writer.add_text(f"{prefix}/influence", text, step)
        tags.append(f"{prefix}/influence")
    if table is not None and len(table["sample_id"]):
        for label in np.unique(table["label"]):
            values = table["self_influence"][table["label"] == label]
            values = values[np.isfinite(values)]  # samples of batches kept as metadata only have none
            if len(values):
                writer.add_histogram(f"{prefix}/self_influence/class_{int(label)}", values, step)
            tags.append(f"{prefix}/self_influence/class_{int(label)}")
    if figures is None:
        try:
            scatter = draw_scatter(reports, table)
        except ImportError as exc:
            _no_figures(exc)
            scatter = None
        figures = {} if scatter is None else {SCATTER: scatter}
    for name, figure in figures.items():
        add_image = getattr(writer, "add_image", None)  # SummaryWriter's; not every writer-like object has it
        pixels = drawn_pixels(figure) if callable(add_image) else None
        if add_image is not None and pixels is not None:  # drawn for its PNG file: not drawn again
            add_image(f"{prefix}/{name}", pixels, step, dataformats="HWC")
        else:
            writer.add_figure(f"{prefix}/{name}", figure, step, close=False)  # our figures are not pyplot's to close
        tags.append(f"{prefix}/{name}")
    flush = getattr(writer, "flush", None)
    if callable(flush):
        flush()
    return tags


def write_projector(
    writer: Any,
    store: GradientStore,
    capture_point: str,
    *,
    step: int = 0,
    dim: int = 8,
    prefix: str = "metastore",
    sketches: np.ndarray | None = None,
) -> list[str]:
    """Gradient sketches (``dim * dim`` numbers per sample) with id and label metadata, via ``add_embedding``.

    ``sketches``: ``store.sketches(capture_point, dim=dim)`` when at hand."""
    if sketches is None:
        sketches = store.sketches(capture_point, dim=dim)  # (N, dim * dim)
    meta = store.metadata(capture_point)
    labels = [[str(int(i)), str(label)] for i, label in zip(meta["sample_id"], meta["label"].tolist())]
    tag = f"{prefix}/gradient_sketches"
    writer.add_embedding(
        sketches.astype(np.float32), metadata=labels, metadata_header=["sample_id", "label"], tag=tag, global_step=step
    )
    return [tag]


#: the tag (under the prefix) and file name of each figure; an influence figure per test sample adds ``/{split}_{id}``
FIGURES = {
    SCATTER: SCATTER,
    "data_map": "data_map",
    "gradient_norms": "gradient_norms",
    "outlier_samples": "outliers",
    "influence_samples": "influence",
}


#: influence figures of image samples: the first test samples of the report, this many (with the other
#: figures, one page of TensorBoard's Images tab)
INFLUENCE_FIGURES = 8


def sample_figures(
    reports: dict[str, Any],
    samples: SampleLookup | None,
    *,
    train_split: str = "train",
    test_split: str = "val",
) -> dict[str, Figure]:
    """Image samples' figures: ``outlier_samples`` (a thumbnail grid of the top outliers) and
    ``influence_samples/{test_split}_{id}`` (one for each of the first :data:`INFLUENCE_FIGURES` test samples,
    :func:`~.samples.influence_figures`).

    Empty for other data."""
    if samples is None:
        return {}
    figures: dict[str, Figure] = {}
    grid = outlier_grid(reports.get("outliers") or [], samples, split=train_split)
    if grid is not None:
        figures["outlier_samples"] = grid
    rows = reports.get("influence") or []
    pictured = influence_figures(rows, samples, train_split=train_split, test_split=test_split, limit=INFLUENCE_FIGURES)
    for name, figure in pictured.items():
        figures[f"influence_samples/{name}"] = figure
    return figures


def figure_file(tag: str) -> str:
    """The PNG file name of a figure's tag (:data:`FIGURES`)."""
    kind, _, name = tag.partition("/")
    return FIGURES[kind] + (f"-{name}" if name else "") + ".png"


def report_figures(
    reports: dict[str, Any],
    table: dict[str, np.ndarray] | None,
    samples: SampleLookup | None,
    directory: Path,
    *,
    train_split: str = "train",
    test_split: str = "val",
    gmap: GradientMap | None = None,
    store: GradientStore | None = None,
) -> tuple[dict[str, Figure], list[Path]]:
    """The report figures ``{tag: Figure}`` and the PNG files written for them into ``directory``.

    The scatter of ``table``; the data map of ``store``'s training steps (:func:`~.datamap.map_signals`);
    the heatmap of ``gmap``; and the figures of image samples (:func:`sample_figures`).
    Without matplotlib: nothing, and a warning.
    """
    figures: dict[str, Figure] = {}
    try:
        scatter = draw_scatter(reports, table)
        if scatter is not None:
            figures[SCATTER] = scatter
        signals = map_signals(store) if store is not None else None
        if signals is not None:
            figures["data_map"] = data_map_figure(signals, flagged_ids(reports))
        if gmap is not None and gmap.layers and len(gmap.steps):
            figures["gradient_norms"] = heatmap_figure(gmap)
        figures.update(sample_figures(reports, samples, train_split=train_split, test_split=test_split))
    except ImportError as exc:
        _no_figures(exc)
        return {}, []
    return figures, [save_png(figure, directory / figure_file(tag)) for tag, figure in figures.items()]


#: ``report_run`` and ``projector_dim`` moved to :mod:`metastore_plugins.core.training.report_pass` (the report
#: pass sits above the reports): found there by name, with a ``DeprecationWarning``.
__getattr__ = moved_module(__name__, ["metastore_plugins.core.training.report_pass"])
