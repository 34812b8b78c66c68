"""The report figures, drawn with matplotlib: the loss-vs-self-influence scatter, and the sample images.

Every figure is a ``matplotlib.figure.Figure`` on the non-interactive Agg canvas, made without
``pyplot`` (no global figure registry, no display, safe off the main thread): log it with
``SummaryWriter.add_figure`` and save it with :func:`save_png`. matplotlib is imported only
when a figure is drawn; without it these functions raise ``ImportError`` naming the extra
to install (:func:`~metastore_plugins.core.reports.tensorboard.report_run` then skips the
figures with a warning and writes everything else).

Thumbnail grids of the samples are in :mod:`.thumbnails`.

A *sample lookup* ``(split, sample id) -> item`` returns the dataset item behind a sample id
(``"train"`` or ``"val"``), e.g. ``lambda split, i: train_set[i]``. Items may be ``(x, y, ...)``
tuples, dicts (``pixel_values``, ``image``, ``x``, ``input`` or ``inputs``), tensors, arrays
or PIL images; an input is drawn when it is a small image: ``(H, W)``, ``(C, H, W)`` or
``(H, W, C)`` with ``C`` in 1, 3 or 4 and sides between 2 and 256 pixels. Flat vectors are not
images; reshape them in the dataset (and flatten in the model) to have them drawn.

Example::

    figure = scatter_figure(table, flagged=[row["sample_id"] for row in report["outliers"]])
    writer.add_figure("metastore/loss_vs_self_influence", figure, 0)
"""

from __future__ import annotations

import io
import os
import sys
import warnings
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from metastore_plugins.core.errors import MissingDependencyError
from metastore_plugins.core.store.files import StoreDir

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: ``(split, sample id) -> dataset item`` (split ``"train"`` or ``"val"``).
SampleLookup = Callable[[str, int], Any]

INPUT_KEYS = ("pixel_values", "image", "images", "img", "x", "input", "inputs")
MAX_SIDE = 256
#: pixels per inch of every figure: sizes given in pixels (``cell``) are pixels of the PNG
DPI = 100
#: legend entries up to this many classes; more classes get a colour bar instead
MAX_LEGEND_CLASSES = 20

MISSING_MATPLOTLIB = (
    "report figures need matplotlib: pip install 'metastore_plugins[lightning]' (or [hf], or pip install matplotlib)"
)


def new_figure(width: float, height: float, *, layout: Literal["constrained"] | None = None) -> Figure:
    """A ``width`` x ``height`` inch Figure on its own Agg canvas (no pyplot, no display needed)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise MissingDependencyError(MISSING_MATPLOTLIB) from exc
    figure = Figure(figsize=(width, height), dpi=DPI, layout=layout)
    FigureCanvasAgg(figure)
    return figure


def save_png(figure: Figure, path: str | os.PathLike[str]) -> Path:
    """Write ``figure`` as a PNG file (its directory created) and return the path.

    The file is replaced atomically, never written through a link (:meth:`~.files.StoreDir.atomic_write`)."""
    path = Path(path)
    image = io.BytesIO()
    figure.savefig(image, format="png", dpi=DPI, facecolor="white")
    with StoreDir(path.parent, create=True) as directory:
        directory.atomic_write(path.name, image.getvalue())
    return path


def drawn_pixels(figure: Figure) -> np.ndarray | None:
    """``(H, W, 3)`` uint8: the figure as its Agg canvas last drew it (:func:`save_png` draws it), ``None`` if it
    was never drawn. TensorBoard then gets the pixels of the PNG file instead of a second drawing."""
    canvas = figure.canvas
    if getattr(canvas, "renderer", None) is None or not hasattr(canvas, "buffer_rgba"):
        return None
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def _axis_scale(values: np.ndarray) -> str:
    """``log`` when the positive values span two decades or more (``symlog`` if some are <= 0), else ``linear``."""
    if not len(values):
        return "linear"
    positive = values[values > 0]
    if not len(positive) or positive.max() < 100 * positive.min():
        return "linear"
    return "log" if len(positive) == len(values) else "symlog"


def scatter_figure(
    table: Mapping[str, np.ndarray],
    flagged: Collection[int] = (),
    *,
    title: str = "Training samples: loss against self-influence",
    flagged_label: str | None = None,
) -> Figure:
    """Loss (y) against self-influence (x) of each training sample, one colour per label.

    ``table``: ``sample_id``, ``self_influence``, ``label`` (``-1``: none) and ``loss`` arrays
    (:func:`~metastore_plugins.core.reports.tensorboard.self_influence_table`). Samples whose id
    is in ``flagged`` (e.g. the rows of the outlier report) get a black ring, named in the
    legend by ``flagged_label`` with the count of rings drawn, and of the flagged samples left
    out (no finite self-influence and loss in ``table``: not in the passes). An axis spanning
    two decades or more is drawn in log scale.
    """
    x = np.asarray(table["self_influence"], dtype=np.float64)
    y = np.asarray(table["loss"], dtype=np.float64)
    labels = np.asarray(table["label"])
    ids = np.asarray(table["sample_id"])
    finite = np.isfinite(x) & np.isfinite(y)
    x, y, labels, ids = x[finite], y[finite], labels[finite], ids[finite]
    classes = [int(c) for c in np.unique(labels)]
    figure = new_figure(8.0, 4.8, layout="constrained")
    axes = figure.add_subplot()
    if len(classes) <= MAX_LEGEND_CLASSES:
        colours = _class_colours(len([c for c in classes if c >= 0]))
        named = iter(colours)
        for label in classes:
            mine = labels == label
            axes.scatter(
                x[mine],
                y[mine],
                s=14,
                alpha=0.75,
                linewidths=0,
                color="#7f7f7f" if label < 0 else next(named),
                label=f"{'no label' if label < 0 else f'label {label}'} ({int(mine.sum())})",
            )
    else:
        points = axes.scatter(x, y, s=14, alpha=0.75, linewidths=0, c=labels, cmap="viridis")
        figure.colorbar(points, ax=axes, label="label")
    wanted = flagged_ids(flagged)
    ring = np.isin(ids, wanted)
    if ring.any():
        drawn = len(np.unique(ids[ring]))
        left = (
            f"; {len(wanted) - drawn} of the {len(wanted)} not drawn: no self-influence here"
            if drawn < len(wanted)
            else ""
        )
        ring_points(
            axes, x, y, ring, size=70, label=f"{flagged_label or 'flagged: outlier report'} ({drawn} drawn{left})"
        )
    for name, values in (("x", x), ("y", y)):
        scale = _axis_scale(values)
        options = {"linthresh": float(values[values > 0].min())} if scale == "symlog" else {}
        (axes.set_xscale if name == "x" else axes.set_yscale)(scale, **options)
    axes.set_xlabel(r"self-influence  $\sum_t \, \eta_t \, \|g_i(w_t)\|^2$  (TracIn)")
    axes.set_ylabel("loss at the last stored pass")
    axes.set_title(title)
    axes.grid(True, which="major", linewidth=0.4, alpha=0.5)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8, frameon=False)
    if not len(x):
        axes.text(0.5, 0.5, "no samples", transform=axes.transAxes, ha="center", va="center")
    return figure


def flagged_ids(flagged: Collection[int]) -> np.ndarray:
    """The distinct sample ids of ``flagged``, sorted, as int64."""
    return np.unique(np.fromiter((int(i) for i in flagged), dtype=np.int64, count=len(flagged)))


def ring_points(axes: Any, x: np.ndarray, y: np.ndarray, ring: np.ndarray, *, size: float, label: str) -> None:
    """A black ring (no fill) around each point ``(x, y)[ring]``, named ``label`` in the legend."""
    axes.scatter(x[ring], y[ring], s=size, facecolors="none", edgecolors="black", linewidths=1.1, label=label)


def _class_colours(count: int) -> list[Any]:
    from matplotlib import colormaps

    palette = colormaps["tab10" if count <= 10 else "tab20"]
    return [palette(i) for i in range(count)]


def sample_input(item: Any) -> Any:
    """The input part of a dataset item: the first element of a tuple, an image key of a dict, or the item."""
    if isinstance(item, Mapping):
        for key in INPUT_KEYS:
            if key in item:
                return item[key]
        return None
    if isinstance(item, (tuple, list)) and item and not _is_number(item[0]):
        return item[0]
    return item


def as_image(value: Any) -> np.ndarray | None:
    """``(H, W, 3)`` uint8 of a small image (scaled to its own min..max), ``None`` for anything else."""
    pil = sys.modules.get("PIL.Image")  # a PIL image exists only where PIL is imported: no import needed here
    if pil is not None and isinstance(value, pil.Image):
        return np.asarray(value.convert("RGB"), dtype=np.uint8)
    if hasattr(value, "detach"):  # a torch tensor, without importing torch here
        value = value.detach().float().cpu().numpy()
    elif isinstance(value, (list, tuple)):  # e.g. pixel_values of a Hugging Face dataset row
        try:
            value = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError):
            return None
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "biuf":
        return None
    array = value.astype(np.float64)
    if (
        array.ndim == 3
        and array.shape[0] in (1, 3, 4)
        and (array.shape[-1] not in (1, 3, 4) or array.shape[0] <= array.shape[-1])
    ):
        array = np.moveaxis(array, 0, -1)  # CHW -> HWC (PyTorch's layout wins where both ends could be channels)
    if array.ndim == 3 and array.shape[-1] in (1, 3, 4):
        array = array[..., :3] if array.shape[-1] >= 3 else np.repeat(array, 3, axis=-1)
    elif array.ndim == 2:
        array = np.repeat(array[..., None], 3, axis=-1)
    else:
        return None
    height, width = array.shape[:2]
    if not (2 <= height <= MAX_SIDE and 2 <= width <= MAX_SIDE):
        return None
    finite = np.isfinite(array)
    if not finite.any():
        return None
    low, high = float(array[finite].min()), float(array[finite].max())
    scaled = (np.where(finite, array, low) - low) / (high - low if high > low else 1.0)
    return (scaled * 255.0).round().astype(np.uint8)


def dataset_lookup(datasets: Mapping[str, Any]) -> SampleLookup | None:
    """A lookup over map-style datasets per split (``IndexedDataset`` unwrapped); ``None`` when there is none.

    Example: ``dataset_lookup({"train": train_loader.dataset, "val": val_loader.dataset})``.
    """
    from metastore_plugins.core.model.sample_ids import unwrap_dataset

    found = {split: unwrap_dataset(d) for split, d in datasets.items() if d is not None}
    found = {split: d for split, d in found.items() if hasattr(d, "__getitem__") and hasattr(d, "__len__")}
    if not found:
        return None

    def lookup(split: str, sample_id: int) -> Any:
        return found[split][sample_id]

    return lookup


def lookup_image(lookup: SampleLookup, split: str, sample_id: int) -> np.ndarray | None:
    """The image of a sample (:func:`as_image`), ``None`` when it is none or the lookup fails (with a warning)."""
    try:
        item = lookup(split, sample_id)
    except Exception as exc:  # noqa: BLE001 - a rendering must never fail the reports
        warnings.warn(
            f"sample lookup failed for {split} sample {sample_id} ({exc!r}); no thumbnail drawn", stacklevel=3
        )
        return None
    return as_image(sample_input(item))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) or (hasattr(value, "ndim") and value.ndim == 0)


def short_label(value: Any) -> str:
    """``value`` as a thumbnail caption: at most 6 characters."""
    text = str(value)
    return text if len(text) <= 6 else text[:5] + "~"


__all__ = [
    "MISSING_MATPLOTLIB",
    "SampleLookup",
    "as_image",
    "dataset_lookup",
    "lookup_image",
    "new_figure",
    "sample_input",
    "save_png",
    "scatter_figure",
    "short_label",
]
