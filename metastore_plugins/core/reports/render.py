"""Readable renderings of samples for the reports: thumbnail grids of small images (PIL, no matplotlib).

A *sample lookup* ``(split, sample id) -> item`` returns the dataset item behind a sample id
(``"train"`` or ``"val"``), e.g. ``lambda split, i: train_set[i]``. Items may be ``(x, y, ...)``
tuples, dicts (``pixel_values``, ``image``, ``x``, ``input`` or ``inputs``), tensors, arrays
or PIL images; an input is drawn when it is a small image: ``(H, W)``, ``(C, H, W)`` or
``(H, W, C)`` with ``C`` in 1, 3 or 4 and sides between 2 and 256 pixels. Flat vectors are not
images; reshape them in the dataset (and flatten in the model) to have them drawn.

Example::

    grid = outlier_grid(report["outliers"], lambda split, i: digits[i])   # (H, W, 3) uint8 or None
    Image.fromarray(grid).save("outliers.png")
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

#: ``(split, sample id) -> dataset item`` (split ``"train"`` or ``"val"``).
SampleLookup = Callable[[str, int], Any]

INPUT_KEYS = ("pixel_values", "image", "images", "img", "x", "input", "inputs")
MAX_SIDE = 256


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
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow comes with the lightning and hf extras
        return None
    if isinstance(value, Image.Image):
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


def thumbnail_grid(
    images: Sequence[np.ndarray],
    captions: Sequence[Sequence[str]],
    *,
    cell: int = 56,
    columns: int = 8,
    title: str = "",
    highlight: Sequence[bool] | None = None,
) -> np.ndarray:
    """A grid of ``images`` (each ``(h, w, 3)`` uint8), scaled to ``cell`` pixels, each with caption lines.

    ``highlight[i]`` draws a red frame around image ``i`` (e.g. label differs from prediction).
    Returns an ``(H, W, 3)`` uint8 image.
    """
    from PIL import Image, ImageDraw

    line_height = 11
    lines = max((len(c) for c in captions), default=0)
    columns = max(1, min(columns, len(images)))
    rows = (len(images) + columns - 1) // columns
    pad, top = 4, (16 if title else 4)
    cell_w, cell_h = cell + pad, cell + lines * line_height + pad
    canvas = Image.new("RGB", (columns * cell_w + pad, top + rows * cell_h + pad), "white")
    draw = ImageDraw.Draw(canvas)
    if title:
        draw.text((pad, 2), title, fill=(0, 0, 0))
    for i, (image, caption) in enumerate(zip(images, captions)):
        x, y = pad + (i % columns) * cell_w, top + (i // columns) * cell_h
        h, w = image.shape[:2]
        scale = cell / max(h, w)
        size = (max(1, round(w * scale)), max(1, round(h * scale)))
        canvas.paste(Image.fromarray(image).resize(size, Image.NEAREST), (x, y))
        if highlight is not None and highlight[i]:
            draw.rectangle([x - 1, y - 1, x + size[0], y + size[1]], outline=(214, 39, 40), width=2)
        for j, text in enumerate(caption):
            draw.text((x, y + cell + 1 + j * line_height), text, fill=(0, 0, 0))
    return np.asarray(canvas, dtype=np.uint8)


def outlier_grid(
    rows: Sequence[Mapping[str, Any]],
    lookup: SampleLookup,
    *,
    split: str = "train",
    limit: int = 32,
    cell: int = 56,
    columns: int = 8,
) -> np.ndarray | None:
    """Thumbnails of the top outlier rows with ``#rank id``, ``y label p prediction``; ``None`` if they are not images.

    Rows whose label differs from the prediction are framed in red.
    """
    images, captions, frames = [], [], []
    for row in rows[:limit]:
        image = _lookup_image(lookup, split, int(row["sample_id"]))
        if image is None:
            if not images:
                return None  # not image data: no grid
            continue
        images.append(image)
        captions.append(
            [
                f"#{row.get('rank', len(images))} id {row['sample_id']}",
                f"y {_short(row.get('label'))} p {_short(row.get('prediction'))}",
            ]
        )
        frames.append(row.get("label") != row.get("prediction"))
    if not images:
        return None
    return thumbnail_grid(
        images,
        captions,
        cell=cell,
        columns=columns,
        highlight=frames,
        title="most self-influential training samples (y: label, p: prediction; red: y != p)",
    )


def influence_grid(
    rows: Sequence[Mapping[str, Any]],
    lookup: SampleLookup,
    *,
    train_split: str = "train",
    test_split: str = "val",
    limit: int = 8,
    per_side: int = 5,
    cell: int = 40,
) -> np.ndarray | None:
    """One line per test sample: the test image, then its top proponents and opponents; ``None`` if not images."""
    images, captions = [], []
    width = 1 + 2 * per_side
    blank = None
    for row in rows[:limit]:
        test = _lookup_image(lookup, test_split, int(row["test_id"]))
        if test is None:
            return None
        blank = np.full_like(test, 255) if blank is None else blank
        images.append(test)
        captions.append(
            [f"test {row['test_id']}", f"y {_short(row.get('test_label'))} p {_short(row.get('test_prediction'))}"]
        )
        for kind in ("proponents", "opponents"):
            entries = list(row.get(kind, []))[:per_side]
            for entry in entries:
                image = _lookup_image(lookup, train_split, int(entry["sample_id"]))
                images.append(image if image is not None else blank)
                captions.append(
                    [f"{'+' if kind == 'proponents' else '-'} {entry['sample_id']}", f"y {_short(entry.get('label'))}"]
                )
            for _ in range(per_side - len(entries)):
                images.append(np.full((2, 2, 3), 255, np.uint8))
                captions.append(["", ""])
    if not images:
        return None
    return thumbnail_grid(
        images,
        captions,
        cell=cell,
        columns=width,
        title=f"validation sample | {per_side} proponents (+) | {per_side} opponents (-)",
    )


def dataset_lookup(datasets: Mapping[str, Any]) -> SampleLookup | None:
    """A lookup over map-style datasets per split (``IndexedDataset`` unwrapped); ``None`` when there is none.

    Example: ``dataset_lookup({"train": train_loader.dataset, "val": val_loader.dataset})``.
    """
    from metastore_plugins.core.sample_ids import unwrap_dataset

    found = {split: unwrap_dataset(d) for split, d in datasets.items() if d is not None}
    found = {split: d for split, d in found.items() if hasattr(d, "__getitem__") and hasattr(d, "__len__")}
    if not found:
        return None

    def lookup(split: str, sample_id: int) -> Any:
        return found[split][sample_id]

    return lookup


def _lookup_image(lookup: SampleLookup, split: str, sample_id: int) -> np.ndarray | None:
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


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 6 else text[:5] + "~"


__all__ = [
    "SampleLookup",
    "as_image",
    "dataset_lookup",
    "influence_grid",
    "outlier_grid",
    "sample_input",
    "thumbnail_grid",
]
