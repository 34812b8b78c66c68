"""Thumbnail grids: sample images in a grid with captions and frames, and the grid of the top outliers.

:func:`thumbnail_grid` draws one pixel array for the whole grid (the frames and captions carry a gid
per cell); :func:`outlier_grid` fills one from the outlier report through a sample lookup
(:mod:`.render`: what a lookup is and which items are drawn as images).

Example::

    figure = outlier_grid(report["outliers"], lambda split, i: digits[i])   # a Figure, or None
    save_png(figure, "outliers.png")
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from metastore_plugins.core.reports.render import DPI, SampleLookup, lookup_image, new_figure, short_label

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: the frame colour of thumbnails whose label differs from the prediction
MISMATCH = "#d62728"


def thumbnail_grid(
    images: Sequence[np.ndarray | None],
    captions: Sequence[Sequence[str]],
    *,
    cell: int = 56,
    columns: int = 8,
    title: str = "",
    highlight: Sequence[bool] | None = None,
    gids: Sequence[str | None] | None = None,
) -> Figure:
    """A Figure with a grid of ``images`` (each ``(h, w, 3)`` uint8, ``None``: an empty cell).

    Each image fills a ``cell`` x ``cell`` pixel box (nearest-neighbour, aspect kept, centred) with its
    caption lines under it; ``highlight[i]`` frames image ``i`` in red (e.g. label differs from
    prediction). The thumbnails are one pixel array placed as it is (``figimage``), the frames
    rectangles and the captions texts, each frame and caption with ``gids[i]`` (e.g. ``"train/17"``):
    one drawing for the whole grid instead of an axes per thumbnail.
    """
    from matplotlib.patches import Rectangle

    pad, line = 6, 10  # pixels: gap between cells, height of a caption line
    lines = max((len(c) for c in captions), default=0)
    columns = max(1, min(columns, len(images)))
    rows = max(1, (len(images) + columns - 1) // columns)
    top = 22 if title else pad
    cell_w, cell_h = cell + pad, cell + lines * line + pad
    width, height = columns * cell_w + pad, top + rows * cell_h
    figure = new_figure(width / DPI, height / DPI)
    pixels = np.full((height, width, 3), 255, dtype=np.uint8)  # (H, W, 3), row 0 at the top
    if title:
        figure.text(pad / width, 1 - 4 / height, title, ha="left", va="top", fontsize=8)
    for i, (image, caption) in enumerate(zip(images, captions)):
        left, upper = pad + (i % columns) * cell_w, top + (i // columns) * cell_h
        gid = gids[i] if gids is not None else None
        if image is not None:
            _place(pixels, image, left, upper, cell)
            framed = highlight is not None and bool(highlight[i])
            box = Rectangle(
                (left / width, 1 - (upper + cell) / height),
                cell / width,
                cell / height,
                transform=figure.transFigure,
                fill=False,
                edgecolor=MISMATCH if framed else "#bbbbbb",
                linewidth=2.0 if framed else 0.6,
                gid=gid,
            )
            figure.add_artist(box)
        if any(caption):
            x, y = (left + cell / 2) / width, 1 - (upper + 1.04 * cell) / height
            figure.text(x, y, "\n".join(caption), ha="center", va="top", fontsize=6.5, gid=gid)
    figure.figimage(pixels, xo=0, yo=0, origin="upper")
    return figure


def _place(pixels: np.ndarray, image: np.ndarray, left: int, upper: int, cell: int) -> None:
    """Write ``image`` ``(h, w, 3)`` into ``pixels`` scaled to fit the ``cell`` box at ``(left, upper)``: nearest
    neighbour, aspect kept, centred (as ``imshow`` in a square axes shows it)."""
    h, w = image.shape[:2]
    scale = cell / max(h, w)
    out_h, out_w = max(1, round(h * scale)), max(1, round(w * scale))
    rows = ((np.arange(out_h) + 0.5) * h / out_h).astype(int)  # (out_h,) source row of each pixel row
    cols = ((np.arange(out_w) + 0.5) * w / out_w).astype(int)  # (out_w,)
    y0, x0 = upper + (cell - out_h) // 2, left + (cell - out_w) // 2
    pixels[y0 : y0 + out_h, x0 : x0 + out_w] = image[rows][:, cols]


def outlier_grid(
    rows: Sequence[Mapping[str, Any]],
    lookup: SampleLookup,
    *,
    split: str = "train",
    limit: int = 32,
    cell: int = 56,
    columns: int = 8,
) -> Figure | None:
    """Thumbnails of the top outlier rows with ``#rank id``, ``y label p prediction``; ``None`` if they are not images.

    The prediction is the one at the last checkpoint pass (``pass_prediction``; ``None`` for a sample
    it does not hold); rows whose label differs from it are framed in red.
    """
    images: list[np.ndarray | None] = []
    captions: list[list[str]] = []
    frames: list[bool] = []
    gids: list[str | None] = []
    for row in rows[:limit]:
        image = lookup_image(lookup, split, int(row["sample_id"]))
        if image is None:
            if not images:
                return None  # not image data: no grid
            continue
        images.append(image)
        gids.append(f"{split}/{row['sample_id']}")
        captions.append(
            [
                f"#{row.get('rank', len(images))} id {row['sample_id']}",
                f"y {short_label(row.get('label'))} p {short_label(row.get('pass_prediction'))}",
            ]
        )
        predicted = row.get("pass_prediction")  # None: not in the last pass, nothing to compare
        frames.append(predicted is not None and row.get("label") != predicted)
    if not images:
        return None
    return thumbnail_grid(
        images,
        captions,
        cell=cell,
        columns=columns,
        highlight=frames,
        gids=gids,
        title="top outlier training samples (y: label, p: prediction at the last pass; red: y != p)",
    )


__all__ = [
    "MISMATCH",
    "outlier_grid",
    "thumbnail_grid",
]
