"""The digits example finds its flipped labels, and image samples get thumbnail grids in the reports."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("tensorboard")
pytest.importorskip("PIL")

from matplotlib.image import imread  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from metastore_plugins.core.reports.render import as_image, dataset_lookup, sample_input  # noqa: E402
from metastore_plugins.core.reports.thumbnails import outlier_grid  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--train-size", "600", "--epochs", "3"]  # measured: 52 of the 60 flipped labels in the top 10% (87%)


@pytest.mark.slow  # the example trains in a subprocess
def test_digits_example_finds_flipped_labels(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    out = tmp_path / "digits"
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "lightning_digits.py"), "--out", str(out), *FAST],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((out / "result.json").read_text())
    assert result["train_size"] == 600 and result["flipped"] == 60 and result["top"] == 60
    assert result["random_baseline"] == pytest.approx(0.1)
    assert result["recall"] >= 0.6, result  # the outlier report's top 10% holds >= 60% of the flipped labels
    assert "flipped labels" in done.stdout and "a random 10% would hold 10%" in done.stdout

    outliers = json.loads((out / "store" / "reports" / "outliers.json").read_text())
    assert [row["rank"] for row in outliers] == list(range(1, 61))
    influence = json.loads((out / "store" / "reports" / "influence.json").read_text())
    assert (out / "store" / "reports" / "outliers.png").is_file() and (
        out / "store" / "reports" / f"influence-val_{influence[0]['test_id']}.png"
    ).is_file()
    events = EventAccumulator(str(out / "tb" / "version_0"), size_guidance={"images": 0, "tensors": 0}).Reload()
    images = set(events.Tags()["images"])
    per_test = {f"metastore/influence_samples/val_{row['test_id']}" for row in influence[:8]}  # the first 8
    assert {"metastore/outlier_samples", "metastore/loss_vs_self_influence", "metastore/gradient_norms"} <= images
    assert per_test == {tag for tag in images if tag.startswith("metastore/influence_samples/")}
    assert "metastore/data_map" in images
    grid = events.Images("metastore/outlier_samples")[0]
    assert grid.width >= 8 * 56 and grid.height >= 4 * 56  # 32 thumbnails, 8 a row
    logged = imread(io.BytesIO(grid.encoded_image_string), format="png")[..., :3]  # the grid as TensorBoard shows it
    saved = imread(out / "store" / "reports" / "outliers.png")[..., :3]
    assert logged.shape == saved.shape and np.abs(logged - saved).max() <= 1.5 / 255  # the PNG file's pixels
    assert "metastore/outliers/text_summary" in events.Tags()["tensors"]


def test_as_image_accepts_small_images_only() -> None:
    rng = np.random.default_rng(0)
    assert as_image(torch.rand(1, 8, 8)).shape == (8, 8, 3)
    assert as_image(torch.rand(3, 16, 12)).shape == (16, 12, 3)
    assert as_image(rng.random((10, 9, 3))).shape == (10, 9, 3)
    assert as_image(rng.random((4, 4, 3))).shape == (4, 4, 3)  # HWC where C < H
    assert as_image(np.arange(64.0).reshape(8, 8)).dtype == np.uint8
    assert as_image(np.zeros((1, 4, 4)).tolist()).shape == (4, 4, 3)  # nested lists, as in dataset rows
    for value in (torch.rand(64), torch.rand(2, 3, 8, 8), torch.rand(1, 300, 300), "text", torch.tensor([1, 2, 3])):
        assert as_image(value) is None
    image = as_image(torch.tensor([[0.0, 2.0], [1.0, 2.0]]))
    assert image[0, 0, 0] == 0 and image[0, 1, 0] == 255  # scaled to the image's own range


def test_sample_input_and_grid() -> None:
    x = torch.rand(1, 8, 8)
    assert sample_input((x, 3)) is x and sample_input({"pixel_values": x, "labels": 1}) is x and sample_input(x) is x
    lookup = dataset_lookup(
        {"train": torch.utils.data.TensorDataset(torch.rand(5, 1, 8, 8), torch.arange(5)), "val": None}
    )
    rows = [{"rank": r + 1, "sample_id": i, "label": i, "prediction": 0} for r, i in enumerate([4, 1, 2])]
    grid = outlier_grid(rows, lookup, cell=20, columns=2)
    assert grid is not None and [a.get_gid() for a in grid.artists] == ["train/4", "train/1", "train/2"]  # a frame
    assert len(grid.images) == 1  # per row, around its place in the grid's one pixel array
    vectors = dataset_lookup({"train": torch.utils.data.TensorDataset(torch.rand(5, 6), torch.arange(5))})
    assert outlier_grid(rows, vectors) is None  # not images: no grid
    with pytest.warns(UserWarning, match="sample lookup failed"):
        assert outlier_grid([{"sample_id": 99, "label": 0, "prediction": 0}], lookup) is None
