"""The samples themselves in the reports: one influence figure per test sample, and user renderers.

- :func:`influence_figures`: for image data, one figure per test sample of the influence
  report: the test image beside its top proponents (+) and opponents (-), each with its id,
  label and score. Each panel's frame and caption carry the gid ``"{split}/{sample id}"``.
- :func:`renderers`: a user's ``sample_renderer(split, sample id)`` returning text (shown in
  the tables) or an image (drawn in the figures) becomes the report's text renderer and
  sample lookup.

Example::

    figures = influence_figures(report["influence"], lambda split, i: datasets[split][i])
    for name, figure in figures.items():
        writer.add_figure(f"metastore/influence_samples/{name}", figure, 0)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from metastore_plugins.core.analysis.method_table import TRACIN
from metastore_plugins.core.reports.influence_method import method_label
from metastore_plugins.core.reports.render import SampleLookup, lookup_image, short_label
from metastore_plugins.core.reports.thumbnails import thumbnail_grid

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: ``(split, sample id) -> text | image | None``: what a user's renderer returns for a sample
SampleRenderer = Callable[[str, int], Any]
#: ``(split, sample id) -> text`` (``None``: no text)
TextRenderer = Callable[[str, int], "str | None"]


def score_words(row: Mapping[str, Any]) -> str:
    """How an influence row's scores were computed, in the reports' words: its method, and whether exact."""
    method = method_label(str(row.get("method", TRACIN)))
    return f"{'exact' if row.get('exact', True) else 'estimated (projected gradients)'} {method}"


def influence_figure(
    row: Mapping[str, Any],
    lookup: SampleLookup,
    *,
    train_split: str = "train",
    test_split: str = "val",
    per_side: int = 5,
    cell: int = 56,
) -> Figure | None:
    """The test sample of ``row`` beside its proponents and opponents; ``None`` when it is not an image."""
    test_id = int(row["test_id"])
    test = lookup_image(lookup, test_split, test_id)
    if test is None:
        return None
    images: list[np.ndarray | None] = [test]
    gids: list[str | None] = [f"{test_split}/{test_id}"]
    label, predicted = row.get("test_label"), row.get("test_prediction")
    captions = [[f"{test_split} {test_id}", f"y {short_label(label)} p {short_label(predicted)}", ""]]
    for kind, sign in (("proponents", "+"), ("opponents", "-")):
        entries = list(row.get(kind, []))[:per_side]
        for entry in entries:
            sid = int(entry["sample_id"])
            images.append(lookup_image(lookup, train_split, sid))  # None: an empty cell
            gids.append(f"{train_split}/{sid}")
            captions.append([f"{sign} {sid}", f"y {short_label(entry.get('label'))}", f"{float(entry['score']):+.3g}"])
        images += [None] * (per_side - len(entries))
        gids += [None] * (per_side - len(entries))
        captions += [["", "", ""]] * (per_side - len(entries))
    figure = thumbnail_grid(
        images,
        captions,
        cell=cell,
        columns=len(images),
        highlight=[label is not None and predicted is not None and label != predicted] + [False] * (len(images) - 1),
        gids=gids,
        title=(
            f"{test_split} sample {test_id} (y {label}, p {predicted}) | {per_side} proponents (+) | "
            f"{per_side} opponents (-); scores: {score_words(row)}"
        ),
    )
    return figure


def influence_figures(
    rows: Sequence[Mapping[str, Any]],
    lookup: SampleLookup,
    *,
    train_split: str = "train",
    test_split: str = "val",
    limit: int = 16,
    per_side: int = 5,
) -> dict[str, Figure]:
    """``{"{test_split}_{test id}": Figure}`` of the first ``limit`` rows (:func:`influence_figure`); empty
    when the samples are not images."""
    figures: dict[str, Figure] = {}
    for row in rows[:limit]:
        figure = influence_figure(row, lookup, train_split=train_split, test_split=test_split, per_side=per_side)
        if figure is None:
            break
        figures[f"{test_split}_{int(row['test_id'])}"] = figure
    return figures


def renderers(renderer: SampleRenderer) -> tuple[TextRenderer, SampleLookup]:
    """A user's ``renderer`` as the reports' text renderer (its strings) and sample lookup (its images).

    A renderer that raises gives no text for that sample, with one warning."""
    failed: list[BaseException] = []

    def text(split: str, sample_id: int) -> str | None:
        try:
            value = renderer(split, sample_id)
        except Exception as exc:  # noqa: BLE001 - the user's code must never fail the reports
            if not failed:
                warnings.warn(f"sample_renderer failed for {split} sample {sample_id} ({exc!r})", stacklevel=2)
            failed.append(exc)
            return None
        return value if isinstance(value, str) else None

    return text, renderer


__all__ = ["SampleRenderer", "TextRenderer", "influence_figure", "influence_figures", "renderers", "score_words"]
