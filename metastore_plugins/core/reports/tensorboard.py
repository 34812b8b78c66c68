"""Write the report tables through a TensorBoard ``SummaryWriter`` (or any object with its methods).

- markdown tables (outliers, influence) via ``add_text``;
- self-influence of the training samples per labelled class via ``add_histogram``;
- a loss-vs-self-influence scatter figure via ``add_image``, drawn with PIL (no matplotlib);
- dynamics of the training steps: per-layer gradient-norm scalars over steps, gradient-norm
  histograms per epoch, and the fraction of exploding per-sample gradients per step;
- a projector view (``add_embedding``) of gradient sketches of the last training checkpoint pass.

Example::

    writer = summary_writer("runs/demo/tb")                  # torch.utils.tensorboard.SummaryWriter
    result = report_run("runs/demo/store", "runs/demo/reports", [writer])
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from metastore_plugins.core import ops
from metastore_plugins.core.analysis import GradientStore, open_store
from metastore_plugins.core.reports import OUTLIER_COLUMNS, RenderFn, write_reports
from metastore_plugins.core.reports.files import influence_markdown, markdown_table
from metastore_plugins.core.reports.render import SampleLookup, influence_grid, outlier_grid
from metastore_plugins.core.reports.tables import _last_metadata, checkpoint_points, outlier_points, self_influence_of

PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
           (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]  # fmt: skip


class SummaryWriterLike(Protocol):
    def add_text(self, tag: str, text_string: str, global_step: int | None = None) -> None: ...
    def add_histogram(self, tag: str, values: Any, global_step: int | None = None) -> None: ...
    def add_image(
        self, tag: str, img_tensor: Any, global_step: int | None = None, dataformats: str = "CHW"
    ) -> None: ...


def summary_writer(log_dir: str | os.PathLike[str]) -> Any:
    """A ``torch.utils.tensorboard.SummaryWriter`` for ``log_dir`` (tensorboard imported only now)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError(
            "TensorBoard reports need the tensorboard package: pip install 'metastore_plugins[lightning]' "
            "(or pip install tensorboard); file reports need nothing more"
        ) from exc
    return SummaryWriter(str(log_dir))


def self_influence_table(
    store: GradientStore, points: Sequence[str], scores: tuple[np.ndarray, np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    """Every training sample of ``points``: ``sample_id``, ``self_influence``, ``label``, ``loss``."""
    ids, values = scores if scores is not None else self_influence_of(store, points)
    meta = _last_metadata(store, points)
    labels = np.array([meta[int(i)]["label"] if isinstance(meta[int(i)]["label"], int) else -1 for i in ids])
    losses = np.array([meta[int(i)]["loss"] for i in ids], dtype=np.float64)
    return {"sample_id": np.asarray(ids), "self_influence": values, "label": labels, "loss": losses}


def scatter_image(
    x: np.ndarray,
    y: np.ndarray,
    classes: np.ndarray,
    *,
    title: str = "",
    x_label: str = "",
    y_label: str = "",
    size: tuple[int, int] = (480, 360),
) -> np.ndarray:
    """A scatter plot as an ``(H, W, 3)`` uint8 image, one colour per class (drawn with PIL)."""
    from PIL import Image, ImageDraw

    width, height = size
    left, right, top, bottom = 56, 16, 28, 40
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    draw.rectangle([left, top, width - right, height - bottom], outline=(0, 0, 0))
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    finite = np.isfinite(x) & np.isfinite(y)
    if finite.any():
        (x0, x1), (y0, y1) = (
            (float(x[finite].min()), float(x[finite].max())),
            (float(y[finite].min()), float(y[finite].max())),
        )
        x1, y1 = (x1 if x1 > x0 else x0 + 1.0), (y1 if y1 > y0 else y0 + 1.0)
        px = left + (x[finite] - x0) / (x1 - x0) * (width - left - right)
        py = height - bottom - (y[finite] - y0) / (y1 - y0) * (height - top - bottom)
        for u, v, c in zip(px, py, np.asarray(classes)[finite]):
            colour = PALETTE[int(c) % len(PALETTE)] if int(c) >= 0 else (0, 0, 0)
            draw.ellipse([u - 2, v - 2, u + 2, v + 2], fill=colour)
        draw.text((left, height - bottom + 4), f"{x0:.3g}", fill=(0, 0, 0))
        draw.text((width - right - 40, height - bottom + 4), f"{x1:.3g}", fill=(0, 0, 0))
        draw.text((4, height - bottom - 10), f"{y0:.3g}", fill=(0, 0, 0))
        draw.text((4, top), f"{y1:.3g}", fill=(0, 0, 0))
    draw.text((left, 8), title, fill=(0, 0, 0))
    draw.text(((width - len(x_label) * 6) // 2, height - 16), x_label, fill=(0, 0, 0))
    draw.text((4, top + 14), y_label, fill=(0, 0, 0))
    return np.asarray(image, dtype=np.uint8)


def write_tensorboard(
    writer: SummaryWriterLike,
    reports: dict[str, Any],
    table: dict[str, np.ndarray] | None = None,
    *,
    step: int = 0,
    prefix: str = "metastore",
) -> list[str]:
    """Write the outlier and influence tables, histograms and scatter; returns the tags written."""
    tags = []
    if reports.get("outliers"):
        columns = reports.get("outlier_columns", OUTLIER_COLUMNS)
        writer.add_text(f"{prefix}/outliers", markdown_table(reports["outliers"], columns), step)
        tags.append(f"{prefix}/outliers")
    if reports.get("influence"):
        writer.add_text(f"{prefix}/influence", influence_markdown(reports["influence"]), step)
        tags.append(f"{prefix}/influence")
    if table is not None and len(table["sample_id"]):
        for label in np.unique(table["label"]):
            values = table["self_influence"][table["label"] == label]
            writer.add_histogram(f"{prefix}/self_influence/class_{int(label)}", values, step)
            tags.append(f"{prefix}/self_influence/class_{int(label)}")
        image = scatter_image(
            table["loss"],
            np.log10(np.clip(table["self_influence"], 1e-12, None)),
            table["label"],
            title="training samples, coloured by label",
            x_label="loss",
            y_label="log10 self-influence",
        )
        writer.add_image(f"{prefix}/loss_vs_self_influence", image, step, dataformats="HWC")
        tags.append(f"{prefix}/loss_vs_self_influence")
    flush = getattr(writer, "flush", None)
    if callable(flush):
        flush()
    return tags


def write_dynamics(
    writer: Any,
    store: GradientStore,
    *,
    capture_point: str = "train",
    prefix: str = "metastore",
    explode_factor: float = 10.0,
) -> list[str]:
    """Gradient-norm scalars per layer and step, norm histograms per epoch, and exploding fractions.

    A per-sample gradient "explodes" when its norm exceeds ``explode_factor`` times the
    median norm of the run.
    """
    if capture_point not in store.capture_points():
        return []
    meta = store.metadata(capture_point)
    steps, epochs = meta["step"], meta["epoch"]
    tags = []
    by_layer = store.norms(capture_point, by_layer=True)  # {layer: (N,)}: the one pass over the records
    for layer, norms in by_layer.items():
        for step in np.unique(steps):
            writer.add_scalar(f"{prefix}/grad_norm/{layer}", float(norms[steps == step].mean()), int(step))
        tags.append(f"{prefix}/grad_norm/{layer}")
    total = np.sqrt(sum((norms**2 for norms in by_layer.values()), np.zeros(len(steps))))  # (N,) whole-model norms
    for epoch in np.unique(epochs):
        writer.add_histogram(f"{prefix}/grad_norm_per_epoch", total[epochs == epoch], int(epoch))
    threshold = explode_factor * float(np.median(total)) if len(total) else 0.0
    fractions = ops.step_exceed_fractions(
        torch.from_numpy(total), torch.from_numpy(np.asarray(steps, dtype=np.int64)), threshold
    )  # from the norms at hand
    for step, fraction in zip(*fractions):
        writer.add_scalar(f"{prefix}/exploding_fraction", float(fraction), int(step))
    return [*tags, f"{prefix}/grad_norm_per_epoch", f"{prefix}/exploding_fraction"]


def write_projector(
    writer: Any, store: GradientStore, capture_point: str, *, step: int = 0, dim: int = 8, prefix: str = "metastore"
) -> list[str]:
    """Gradient sketches (``dim * dim`` numbers per sample) with id and label metadata, via ``add_embedding``."""
    sketches = store.sketches(capture_point, dim=dim)  # (N, dim * dim)
    meta = store.metadata(capture_point)
    labels = [[str(int(i)), str(label)] for i, label in zip(meta["sample_id"], meta["label"].tolist())]
    tag = f"{prefix}/gradient_sketches"
    writer.add_embedding(
        sketches.astype(np.float32), metadata=labels, metadata_header=["sample_id", "label"], tag=tag, global_step=step
    )
    return [tag]


GRID_TAGS = {"outliers": "outlier_samples", "influence": "influence_samples"}


def sample_grids(
    reports: dict[str, Any],
    samples: SampleLookup | None,
    directory: Path | None = None,
    *,
    train_split: str = "train",
    test_split: str = "val",
) -> dict[str, np.ndarray]:
    """Thumbnail grids ``{"outliers": image, "influence": image}`` of image samples, saved as PNGs.

    None for other data."""
    if samples is None:
        return {}
    grids = {
        "outliers": outlier_grid(reports.get("outliers") or [], samples, split=train_split),
        "influence": influence_grid(
            reports.get("influence") or [], samples, train_split=train_split, test_split=test_split
        ),
    }
    grids = {name: grid for name, grid in grids.items() if grid is not None}
    if directory is not None and grids:
        from PIL import Image

        directory.mkdir(parents=True, exist_ok=True)
        for name, grid in grids.items():
            Image.fromarray(grid).save(directory / f"{name}.png")
    return grids


def report_run(
    store_dir: str | os.PathLike[str],
    reports_dir: str | os.PathLike[str],
    writers: Sequence[SummaryWriterLike] = (),
    *,
    step: int = 0,
    k: int = 20,
    train_split: str = "train",
    test_split: str = "val",
    dynamics: bool = True,
    projector: bool = True,
    render: RenderFn | None = None,
    samples: SampleLookup | None = None,
    outliers_from: str = "checkpoints",
) -> dict[str, Any] | None:
    """Files via :func:`write_reports` into ``reports_dir``, and the same reports to each writer.

    ``render(split, sample id)`` adds each sample's text to the tables (see :func:`write_reports`).
    ``outliers_from="training"`` ranks every trained sample by its in-run self-influence instead of
    the samples of the checkpoint passes (:func:`~metastore_plugins.core.reports.tables.outlier_points`).
    ``samples(split, sample id)`` returns dataset items: where they are small images, thumbnail
    grids of the top outliers and of the influence rows are written (``outliers.png``,
    ``influence.png`` and the images ``metastore/outlier_samples``, ``metastore/influence_samples``).

    Returns ``write_reports``'s result with ``"tags"`` added, or ``None`` (with a warning)
    when the store holds no checkpoint passes to report on.
    """
    store = open_store(store_dir)
    points = checkpoint_points(store, train_split)
    if not points:
        warnings.warn(
            f"no reports: the store {store_dir} holds no checkpoint passes 'epoch-*/{train_split}' "
            "(checkpoint passes were turned off or no epoch finished)",
            stacklevel=2,
        )
        return None
    sources = outlier_points(store, points, outliers_from)
    scores = self_influence_of(store, sources)  # read once, for the table and the histograms
    result = write_reports(
        store,
        Path(reports_dir),
        train_split=train_split,
        test_split=test_split,
        k=k,
        render=render,
        scores=scores,
        outliers_from=outliers_from,
    )
    table = self_influence_table(store, sources, scores) if writers else None
    grids = sample_grids(result, samples, Path(reports_dir), train_split=train_split, test_split=test_split)
    result["files"] += [str(Path(reports_dir) / f"{name}.png") for name in grids]
    result["grids"] = list(grids)
    result["tags"] = []
    for writer in writers:
        result["tags"] += write_tensorboard(writer, result, table, step=step)
        for name, grid in grids.items():
            tag = f"metastore/{GRID_TAGS[name]}"
            writer.add_image(tag, grid, step, dataformats="HWC")
            result["tags"].append(tag)
        if dynamics:
            result["tags"] += write_dynamics(writer, store)
        if projector:
            result["tags"] += write_projector(writer, store, points[-1], step=step)
        if callable(getattr(writer, "flush", None)):
            writer.flush()
    return result
