"""The report figures are matplotlib figures: a titled scatter with axes, ticks and a legend, grids, real PNGs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("matplotlib")

from figurecases import cell_pixels  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.image import imread  # noqa: E402

from metastore_plugins import StoreWriter  # noqa: E402
from metastore_plugins.core.reports.render import (  # noqa: E402
    as_image,
    save_png,
    scatter_figure,
)
from metastore_plugins.core.reports.samples import influence_figure  # noqa: E402
from metastore_plugins.core.reports.tensorboard import write_tensorboard  # noqa: E402
from metastore_plugins.core.reports.thumbnails import MISMATCH, outlier_grid  # noqa: E402
from metastore_plugins.core.training.passes import capture_step, checkpoint_pass  # noqa: E402
from metastore_plugins.core.training.report_pass import report_run  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def small_table() -> dict[str, np.ndarray]:
    """Nine samples of three classes and one unlabelled sample; self-influence spans four decades."""
    return {
        "sample_id": np.arange(10, 20),
        "self_influence": np.array([1e-3, 2e-3, 5e-2, 0.1, 0.4, 1.0, 3.0, 8.0, 20.0, 0.02]),
        "label": np.array([0, 0, 0, 1, 1, 1, 2, 2, 2, -1]),
        "loss": np.array([0.01, 0.02, 0.1, 0.2, 0.3, 0.5, 1.2, 2.0, 3.5, 0.05]),
    }


def drawn(figure: Figure) -> Figure:
    figure.canvas.draw()  # tick labels get their text when drawn
    return figure


def test_scatter_has_title_axis_labels_ticks_and_a_legend_of_classes_and_flagged_samples() -> None:
    table = small_table()
    figure = drawn(scatter_figure(table, flagged=[17, 18], flagged_label="flagged: top 2"))
    (axes,) = figure.axes
    assert axes.get_title() and "self-influence" in axes.get_xlabel() and "loss" in axes.get_ylabel()
    for labels in (axes.get_xticklabels(), axes.get_yticklabels()):
        assert len([t for t in labels if t.get_text()]) >= 2
    assert axes.get_xscale() == "log"  # four decades of self-influence
    legend = axes.get_legend()
    assert legend is not None
    texts = [t.get_text() for t in legend.get_texts()]
    assert [t.split(" (")[0] for t in texts] == ["no label", "label 0", "label 1", "label 2", "flagged: top 2"]
    assert texts[1] == "label 0 (3)"
    ring = axes.collections[-1]
    assert ring.get_label() == "flagged: top 2 (2 drawn)" and len(ring.get_offsets()) == 2
    np.testing.assert_allclose(ring.get_offsets(), [[8.0, 2.0], [20.0, 3.5]])
    np.testing.assert_allclose(ring.get_edgecolor()[0], to_rgba("black"))
    assert ring.get_facecolor().size == 0 or ring.get_facecolor()[0][3] == 0  # a ring: no fill
    colours = {tuple(np.round(c.get_facecolor()[0], 3)) for c in axes.collections[:-1]}
    assert len(colours) == 4  # one colour per class


def test_the_scatter_legend_counts_the_rings_it_draws() -> None:
    """Issue 28, item 11: outlier rows outside the table (not in the passes) get no ring, and the legend says how
    many rings are drawn, not how many rows the report has."""
    import re

    from metastore_plugins.core.reports.tensorboard import draw_scatter

    table = small_table()
    rows = [{"sample_id": i} for i in (18, 99, 12, 98, 97)]  # 99, 98, 97: not in the table
    expected = len(set(table["sample_id"].tolist()) & {18, 99, 12, 98, 97})  # 2
    figure = draw_scatter({"outliers": rows}, table)
    assert figure is not None
    (axes,) = drawn(figure).axes
    (ring,) = [c for c in axes.collections if c.get_label().startswith("outlier report")]
    assert len(ring.get_offsets()) == expected
    (text,) = [t.get_text() for t in axes.get_legend().get_texts() if t.get_text().startswith("outlier report")]
    stated = re.search(r"\((\d+) drawn", text)
    assert stated is not None and int(stated.group(1)) == expected, text
    assert "3 of the 5 not drawn" in text


def test_scatter_png_is_a_real_image_of_the_figure_size(tmp_path: Path) -> None:
    figure = scatter_figure(small_table(), flagged=[19])
    path = save_png(figure, tmp_path / "reports" / "scatter.png")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = imread(path)
    width, height = (figure.get_size_inches() * figure.dpi).round().astype(int)
    assert image.shape[:2] == (height, width) and width >= 400 and height >= 300
    assert image[..., :3].std() > 0.05  # not a blank canvas


def test_scatter_keeps_linear_axes_for_narrow_ranges_and_skips_non_finite_points() -> None:
    table = {
        "sample_id": np.arange(4),
        "self_influence": np.array([1.0, 2.0, np.nan, 3.0]),
        "label": np.array([0, 1, 1, 1]),
        "loss": np.array([0.5, 0.6, 0.7, np.inf]),
    }
    (axes,) = drawn(scatter_figure(table)).axes
    assert axes.get_xscale() == "linear" and axes.get_yscale() == "linear"
    assert sum(len(c.get_offsets()) for c in axes.collections) == 2
    assert all("flagged" not in t.get_text() for t in axes.get_legend().get_texts())


def test_without_matplotlib_the_figure_names_the_extra_and_the_reports_warn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(ImportError, match=r"metastore_plugins\[lightning\]"):
        scatter_figure(small_table())
    writer = RecordingWriter()
    with pytest.warns(UserWarning, match="no report figures"):
        tags = write_tensorboard(writer, {"outliers": []}, small_table())
    assert not writer.figures and tags and all("self_influence/class" in tag for tag in tags)


def test_grids_draw_one_framed_thumbnail_per_sample() -> None:
    images = {i: torch.rand(1, 6, 6) for i in range(5)}

    def lookup(split: str, i: int) -> Any:
        return images[i], 0

    rows = [{"rank": r + 1, "sample_id": i, "label": i % 2, "pass_prediction": 0} for r, i in enumerate([4, 1, 2])]
    rows.append({"rank": 4, "sample_id": 3, "label": 1, "pass_prediction": None})  # not in the pass: not framed
    grid = outlier_grid(rows, lookup, cell=20, columns=2)
    assert isinstance(grid, Figure) and not grid.axes and len(grid.images) == 1  # the thumbnails: one pixel array
    frames = [a for a in grid.artists if a.get_gid()]
    assert [a.get_gid() for a in frames] == ["train/4", "train/1", "train/2", "train/3"]
    framed = [a.get_gid() for a in frames if a.get_edgecolor() == to_rgba(MISMATCH)]
    assert framed == ["train/1"]  # sample 1: label 1, prediction 0
    captions = [t.get_text() for t in grid.texts if t.get_gid()]
    assert captions[0] == "#1 id 4\ny 0 p 0" and len(captions) == 4 and len(grid.texts) == 5  # and a title
    for frame in frames:  # each frame holds its sample's image, scaled to the cell
        sid = int(frame.get_gid().split("/")[1])
        shown = cell_pixels(grid, frame, 6)[..., 0]  # (6, 6): the thumbnail at the image's pixel centres
        assert np.array_equal(shown, as_image(images[sid][0])[..., 0]), sid
    row = {
        "test_id": 0,
        "test_label": 1,
        "test_prediction": 1,
        "proponents": [{"sample_id": 3, "label": 1, "score": 0.5}],
    }
    grid = influence_figure(row, lookup, per_side=2)
    assert grid is not None and [a.get_gid() for a in grid.artists if a.get_gid()] == ["val/0", "train/3"]
    assert [t.get_gid() for t in grid.texts if t.get_gid()] == ["val/0", "train/3"]  # two empty cells: no caption
    assert grid.texts[0].get_text().endswith("scores: exact TracIn")  # a row without a method: TracIn's
    estimated = influence_figure({**row, "method": "ekfac", "exact": False}, lookup, per_side=2)
    assert estimated is not None and estimated.texts[0].get_text().endswith("estimated (projected gradients) EK-FAC")
    assert outlier_grid(rows, lambda split, i: torch.rand(7)) is None  # not images


def test_a_figure_drawn_for_its_png_goes_to_tensorboard_as_those_pixels(tmp_path: Path) -> None:
    """No second drawing: the writer gets the PNG file's pixels through ``add_image``; a figure never drawn, or a
    writer without ``add_image``, goes through ``add_figure``."""
    drawn, fresh = scatter_figure(small_table()), scatter_figure(small_table())
    path = save_png(drawn, tmp_path / "scatter.png")
    writer = ImageWriter()
    tags = write_tensorboard(writer, {"outliers": []}, small_table(), figures={"drawn": drawn, "fresh": fresh})
    assert {"metastore/drawn", "metastore/fresh"} <= set(tags)
    assert set(writer.images) == {"metastore/drawn"} and set(writer.figures) == {"metastore/fresh"}
    pixels, formats = writer.images["metastore/drawn"]
    saved = np.round(imread(path)[..., :3] * 255)  # (H, W, 3) of the PNG file
    assert formats == "HWC" and pixels.dtype == np.uint8 and pixels.shape == saved.shape
    assert np.abs(pixels.astype(np.float64) - saved).max() <= 1.0
    plain = RecordingWriter()  # no add_image: the figure is drawn by the writer
    write_tensorboard(plain, {"outliers": []}, small_table(), figures={"drawn": drawn})
    assert set(plain.figures) == {"metastore/drawn"}


def test_as_image_takes_pil_images() -> None:
    pil = pytest.importorskip("PIL.Image")
    assert as_image(pil.new("L", (5, 4))).shape == (4, 5, 3)


class RecordingWriter:
    def __init__(self) -> None:
        self.figures: dict[str, Figure] = {}
        self.texts: dict[str, str] = {}

    def add_text(self, tag: str, text: str, step: int | None = None) -> None:
        self.texts[tag] = text

    def add_histogram(self, tag: str, values: Any, step: int | None = None) -> None:
        pass

    def add_figure(self, tag: str, figure: Figure, step: int | None = None, close: bool = True) -> None:
        self.figures[tag] = figure


class ImageWriter(RecordingWriter):
    def __init__(self) -> None:
        super().__init__()
        self.images: dict[str, tuple[np.ndarray, str]] = {}

    def add_image(self, tag: str, image: np.ndarray, step: int | None = None, dataformats: str = "CHW") -> None:
        self.images[tag] = (image, dataformats)


def train_images(directory: Path) -> dict[str, list[tuple[torch.Tensor, int]]]:
    """One epoch on 24 tiny 1 x 4 x 4 images of 3 classes, with checkpoint passes over train and val."""
    generator = torch.Generator().manual_seed(0)
    data = {
        split: [(torch.rand(1, 4, 4, generator=generator), i % 3) for i in range(n)]
        for split, n in (("train", 24), ("val", 6))
    }
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, labels, reduction="none")

    def batches(split: str, size: int) -> Any:
        items = data[split]
        for lo in range(0, len(items), size):
            x = torch.stack([x for x, _ in items[lo : lo + size]])
            y = torch.tensor([y for _, y in items[lo : lo + size]])
            yield torch.arange(lo, lo + len(y)), (lambda x=x: model(x)), y

    with StoreWriter(directory, encoding="fp32") as writer:
        for step, (ids, forward, labels) in enumerate(batches("train", 8)):
            capture_step(model, forward, labels, ids, loss, writer, step=step, lr=0.5)
            optimizer.step()
            optimizer.zero_grad()
        for split in ("train", "val"):
            checkpoint_pass(model, batches(split, 12), loss, writer, capture_point=f"epoch-0/{split}", step=3, lr=0.5)
    return data


def test_report_run_logs_figures_and_writes_pngs_next_to_the_json_reports(tmp_path: Path) -> None:
    data = train_images(tmp_path / "store")
    writer = RecordingWriter()
    result = report_run(
        tmp_path / "store",
        tmp_path / "reports",
        [writer],
        k=5,
        dynamics=False,
        projector=False,
        samples=lambda split, i: data[split][i],
    )
    assert result is not None
    names = {"loss_vs_self_influence", "outlier_samples", *(f"influence_samples/val_{i}" for i in range(6))}
    assert set(result["figures"]) == names and {f"metastore/{name}" for name in names} <= set(writer.figures)
    assert result["grids"] == ["outliers", "influence"]
    for name in ("loss_vs_self_influence", "outliers", "influence-val_0"):
        path = tmp_path / "reports" / f"{name}.png"
        assert str(path) in result["files"] and path.read_bytes()[:8] == PNG_SIGNATURE
        assert min(imread(path).shape[:2]) > 50
    assert (tmp_path / "reports" / "outliers.json").is_file()
    scatter = writer.figures["metastore/loss_vs_self_influence"].axes[0]
    ring = scatter.collections[-1]
    assert ring.get_label() == "outlier report rows (5 drawn)" and len(ring.get_offsets()) == 5


def test_importing_the_package_and_the_report_modules_leaves_matplotlib_unimported() -> None:
    code = (
        "import sys, metastore_plugins, metastore_plugins.cli, metastore_plugins.core.reports.tensorboard; "
        "assert not [m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'PIL')], sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)
