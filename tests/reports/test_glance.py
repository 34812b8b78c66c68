"""Reports read at a glance (issue 34): the samples in the tables and figures, one heatmap of the gradient
norms, a few summary scalars, the data map. Each is checked against an independent read of the data or
against the store's own queries."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("matplotlib")

from figurecases import cell_pixels  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from metastore_plugins import StoreWriter, open_store  # noqa: E402
from metastore_plugins.core.reports.dynamics import SPIKE_FACTOR  # noqa: E402
from metastore_plugins.core.reports.samples import renderers  # noqa: E402
from metastore_plugins.core.training.passes import capture_step, checkpoint_pass  # noqa: E402
from metastore_plugins.core.training.report_pass import report_run  # noqa: E402

MODEL_ORDER = ["1", "3"]  # the Linear layers of Sequential(Flatten, Linear, ReLU, Linear), input to output
SPIKE_STEP = 4  # this step's inputs are scaled up 200 times: its gradient norms spike
EPOCHS, BATCH = 3, 8


class RecordingWriter:
    """What the reports call on a SummaryWriter, kept in memory."""

    def __init__(self) -> None:
        self.figures: dict[str, Figure] = {}
        self.texts: dict[str, str] = {}
        self.scalars: dict[str, dict[int, float]] = defaultdict(dict)

    def add_text(self, tag: str, text: str, step: int | None = None) -> None:
        self.texts[tag] = text

    def add_histogram(self, tag: str, values: Any, step: int | None = None) -> None:
        pass

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars[tag][step] = value

    def add_figure(self, tag: str, figure: Figure, step: int | None = None, close: bool = True) -> None:
        self.figures[tag] = figure


def train(directory: Path) -> dict[str, list[tuple[torch.Tensor, int]]]:
    """Three epochs of SGD on 24 tiny 1 x 4 x 4 images of 3 classes (step 4 spiking), a checkpoint pass per epoch."""
    generator = torch.Generator().manual_seed(0)
    data = {
        split: [(torch.rand(1, 4, 4, generator=generator), i % 3) for i in range(n)]
        for split, n in (("train", 24), ("val", 6))
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, labels, reduction="none")

    def batches(split: str, size: int, scale: float = 1.0) -> Any:
        items = data[split]
        for lo in range(0, len(items), size):
            x = scale * torch.stack([x for x, _ in items[lo : lo + size]])
            y = torch.tensor([y for _, y in items[lo : lo + size]])
            yield torch.arange(lo, lo + len(y)), (lambda x=x: model(x)), y

    step = 0
    with StoreWriter(directory, encoding="fp32") as writer:
        for epoch in range(EPOCHS):
            for ids, forward, labels in batches("train", BATCH):
                if step == SPIKE_STEP:
                    ids, forward, labels = next(batches("train", BATCH, scale=200.0))
                capture_step(model, forward, labels, ids, loss, writer, step=step, epoch=epoch, lr=0.3)
                if step != SPIKE_STEP:  # the spike is the inputs': the weights do not take its step
                    optimizer.step()
                optimizer.zero_grad()
                step += 1
            for split in ("train", "val"):
                checkpoint_pass(
                    model, batches(split, 12), loss, writer, capture_point=f"epoch-{epoch}/{split}", step=step, lr=0.3
                )
    return data


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[tuple[torch.Tensor, int]]]]:
    directory = tmp_path_factory.mktemp("glance")
    return directory, train(directory / "store")


def report(directory: Path, **options: Any) -> tuple[dict[str, Any], RecordingWriter]:
    writer = RecordingWriter()
    result = report_run(directory / "store", directory / "reports", [writer], k=5, projector=False, **options)
    assert result is not None
    return result, writer


def expected_step_means(store: Any) -> dict[str, dict[int, float]]:
    """``{layer: {step: mean per-sample norm}}`` from ``store.norms(by_layer=True)`` and the step column."""
    steps = store.metadata("train")["step"]
    return {
        layer: {int(s): float(norms[steps == s].mean()) for s in np.unique(steps)}
        for layer, norms in store.norms("train", by_layer=True).items()
    }


def test_heatmap_values_are_the_stores_norms_by_layer_in_model_order_with_the_spike_marked(run) -> None:
    directory, _ = run
    result, writer = report(directory)
    figure = writer.figures["metastore/gradient_norms"]
    assert (directory / "reports" / "gradient_norms.png").is_file()
    axes = figure.axes[0]
    figure.canvas.draw()
    assert [label.get_text() for label in axes.get_yticklabels()] == MODEL_ORDER
    shown = np.ma.getdata(axes.images[0].get_array())  # (layers, steps)
    expected = expected_step_means(open_store(directory / "store"))
    steps = sorted(expected[MODEL_ORDER[0]])
    assert shown.shape == (2, EPOCHS * 3) and steps == list(range(EPOCHS * 3))
    np.testing.assert_allclose(shown, [[expected[layer][s] for s in steps] for layer in MODEL_ORDER], rtol=1e-6)
    assert axes.images[0].norm.__class__.__name__ == "LogNorm"
    ((cols, rows),) = {tuple(map(tuple, np.asarray(c.get_offsets()).T)) for c in axes.collections}
    marked = set(zip(rows, cols))
    reference = {
        (r, s)
        for r, layer in enumerate(MODEL_ORDER)
        for s in steps
        if expected[layer][s] > SPIKE_FACTOR * np.median(list(expected[layer].values()))
    }
    assert (0, SPIKE_STEP) in reference and marked == reference


def test_a_few_summary_scalars_by_default_and_every_layer_on_request(run) -> None:
    directory, _ = run
    _, writer = report(directory)
    charts = sorted(writer.scalars)
    assert len(charts) <= 5, charts
    store = open_store(directory / "store")
    expected = expected_step_means(store)
    (worst,) = [tag for tag in charts if tag.startswith("metastore/grad_norm_worst_layer/")]
    layer = worst.rsplit("/", 1)[1]
    ratios = {name: max(v.values()) / np.median(list(v.values())) for name, v in expected.items()}
    assert layer == max(ratios, key=ratios.__getitem__)
    np.testing.assert_allclose(
        [writer.scalars[worst][s] for s in sorted(expected[layer])],
        [expected[layer][s] for s in sorted(expected[layer])],
        rtol=1e-6,
    )
    steps, total = store.metadata("train")["step"], store.norms("train")
    np.testing.assert_allclose(
        [writer.scalars["metastore/grad_norm_total"][int(s)] for s in np.unique(steps)],
        [total[steps == s].mean() for s in np.unique(steps)],
        rtol=1e-6,
    )
    assert "metastore/exploding_fraction" in charts
    _, writer = report(directory, per_layer_scalars=True)
    for name in MODEL_ORDER:
        values = writer.scalars[f"metastore/grad_norm/{name}"]
        np.testing.assert_allclose([values[s] for s in sorted(values)], [expected[name][s] for s in sorted(values)])


def test_influence_figures_show_the_datasets_images_for_the_reported_ids(run) -> None:
    directory, data = run
    result, writer = report(directory, samples=lambda split, i: data[split][i])
    rows = result["influence"]
    assert rows and result["grids"] == ["outliers", "influence"]
    for row in rows:
        tag = f"metastore/influence_samples/val_{row['test_id']}"
        assert (directory / "reports" / f"influence-val_{row['test_id']}.png").is_file()
        figure = writer.figures[tag]
        panels = [frame for frame in figure.artists if frame.get_gid()]
        wanted = [("val", row["test_id"])] + [("train", e["sample_id"]) for e in row["proponents"] + row["opponents"]]
        assert [frame.get_gid() for frame in panels] == [f"{split}/{sid}" for split, sid in wanted]
        for frame, (split, sid) in zip(panels, wanted):
            pixels = data[split][sid][0][0].double().numpy()  # (4, 4) the dataset's image, read here
            scaled = np.round((pixels - pixels.min()) / (pixels.max() - pixels.min()) * 255)
            np.testing.assert_array_equal(cell_pixels(figure, frame, 4)[..., 0], scaled)
        captions = [t.get_text() for t in figure.texts if t.get_gid()][1:]
        scores = [e["score"] for e in row["proponents"] + row["opponents"]]
        assert [float(c.splitlines()[-1]) for c in captions] == pytest.approx(scores, rel=1e-2)


def cut_of(shown: str, original: str, limit: int) -> bool:
    """``shown`` is ``original``, or its first ``limit - 1`` characters (less trailing blanks) and an ellipsis."""
    return shown == original if len(original) <= limit else shown == original[: limit - 1].rstrip() + "…"


def test_influence_table_shows_each_proponents_text_label_score_and_exactness(run) -> None:
    directory, _ = run
    texts = {
        split: [f"{split} sample {i}: " + "word " * (3 + 7 * i) for i in range(n)]
        for split, n in (("train", 24), ("val", 6))
    }
    result, writer = report(directory, render=lambda split, i: texts[split][i])
    table = writer.texts["metastore/influence"]
    blocks = table.split("**test ")[1:]
    assert len(blocks) == len(result["influence"])
    for row, block in zip(result["influence"], blocks):
        assert block.startswith(f"{row['test_id']}** (label {row['test_label']}")
        heading, shown = block.split("\n", 1)[0].split("; exact scores): ")
        assert cut_of(shown, " ".join(texts["val"][row["test_id"]].split()), 160)  # the test sample's own text
        lines = [line for line in block.splitlines() if line.startswith(("| + |", "| - |"))]
        entries = row["proponents"] + row["opponents"]
        assert len(lines) == len(entries)
        for line, entry in zip(lines, entries):
            _, sign, sid, label, score, text, _ = [cell.strip() for cell in line.split("|")]
            assert int(sid) == entry["sample_id"] and int(label) == entry["label"]
            assert float(score) == pytest.approx(entry["score"], rel=1e-2)  # 3 significant digits
            assert cut_of(text, " ".join(texts["train"][int(sid)].split()), 80)  # the dataset's text for that id


def test_data_map_plots_confidence_against_variability_with_the_outliers_ringed(run) -> None:
    directory, _ = run
    result, writer = report(directory)
    axes = writer.figures["metastore/data_map"].axes[0]
    points, ring = axes.collections[0], axes.collections[1]
    meta = open_store(directory / "store").metadata("train")
    ids = np.unique(meta["sample_id"])
    p = {int(i): np.exp(-meta["loss"][meta["sample_id"] == i].astype(np.float64)) for i in ids}  # p(label) per step
    expected = np.array([[p[int(i)].std(), p[int(i)].mean()] for i in ids])
    np.testing.assert_allclose(
        np.asarray(points.get_offsets()), expected, rtol=1e-6, atol=1e-7
    )  # std by the one-pass formula
    flagged = [row["sample_id"] for row in result["outliers"]]
    np.testing.assert_allclose(
        np.asarray(ring.get_offsets()), expected[np.isin(ids, flagged)], rtol=1e-6, atol=1e-7
    )  # std by the one-pass formula


def test_a_user_renderer_gives_the_tables_its_text_and_the_figures_its_images(run) -> None:
    directory, data = run
    text, lookup = renderers(lambda split, i: f"{split} #{i}" if split == "train" else data[split][i][0])
    assert text("train", 3) == "train #3" and text("val", 1) is None and lookup("val", 1) is data["val"][1][0]
    with pytest.warns(UserWarning, match="sample_renderer failed"):
        assert renderers(lambda split, i: 1 / 0)[0]("train", 0) is None


def test_influence_markdown_is_one_line_per_test_sample_where_no_sample_has_a_text() -> None:
    from metastore_plugins.core.reports.files import influence_markdown

    entry = {"sample_id": 4, "label": 1, "score": 0.5}
    rows = [
        {"test_id": 2, "test_label": 1, "test_prediction": 0, "proponents": [entry], "opponents": [], "exact": False}
    ]
    compact = influence_markdown(rows).splitlines()
    assert compact[0].startswith("| test id | label | prediction |") and compact[2] == "| 2 | 1 | 0 | 4:1 |  |"
    blank = [{**rows[0], "test_text": None, "proponents": [{**entry, "text": None}]}]  # a renderer that found none
    assert influence_markdown(blank) == influence_markdown(rows)
    shown = influence_markdown([{**rows[0], "proponents": [{**entry, "text": "a | b"}]}])
    assert "| + | 4 | 1 | +0.5 | a \\| b |" in shown.splitlines() and "; estimated scores): " in shown


def test_the_report_settings_are_checked_where_they_are_given() -> None:
    from metastore_plugins.core.training.settings import CallbackOptions

    with pytest.raises(ValueError, match=r"Owner\(sample_renderer=...\) must be a function"):
        CallbackOptions("Owner", sample_renderer="text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Owner\(per_layer_scalars=...\) must be True or False"):
        CallbackOptions("Owner", per_layer_scalars=1)  # type: ignore[arg-type]
    assert CallbackOptions("Owner").per_layer_scalars is False
