"""The dynamics report (one pass over the records) shows what the store's own queries say."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
from reportcases import assert_top_ranking
from runcases import Run, occurrences

from metastore_plugins.core.reports.tensorboard import write_dynamics


class RecordingWriter:
    def __init__(self) -> None:
        self.scalars: dict[str, dict[int, float]] = defaultdict(dict)
        self.histograms: dict[str, dict[int, np.ndarray]] = defaultdict(dict)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars[tag][step] = value

    def add_histogram(self, tag: str, values: Any, step: int) -> None:
        self.histograms[tag][step] = np.asarray(values)


def test_dynamics_scalars_equal_the_norm_and_exceed_queries(run_a: Run) -> None:
    store = run_a.store
    writer = RecordingWriter()
    write_dynamics(writer, store, explode_factor=1.2, per_layer_scalars=True)
    meta, total = store.metadata("train"), store.norms("train")
    threshold = 1.2 * float(np.median(total))  # what write_dynamics uses with explode_factor=1.2
    # no norm within 1e-4 of it (0.7% is the closest): the report's norms and these, computed apart,
    # put every sample on the same side of the threshold
    assert float(np.abs(total - threshold).min()) > 1e-4 * threshold
    steps, fractions = store.exceed_fractions(threshold, "train")
    assert 0 < fractions.max() < 1  # the threshold splits some steps: the comparison means something
    np.testing.assert_allclose([writer.scalars["metastore/exploding_fraction"][int(s)] for s in steps], fractions)
    for layer, norms in store.norms("train", by_layer=True).items():
        expected = {int(s): norms[meta["step"] == s].mean() for s in np.unique(meta["step"])}
        np.testing.assert_allclose(
            [writer.scalars[f"metastore/grad_norm/{layer}"][s] for s in expected], list(expected.values()), rtol=1e-6
        )
    for epoch, values in writer.histograms["metastore/grad_norm_per_epoch"].items():
        np.testing.assert_allclose(values, total[meta["epoch"] == epoch], rtol=1e-6)


def test_in_run_outlier_scores_sum_every_training_occurrence_of_a_sample(run_a: Run) -> None:
    """``outliers_from="training"``: ``sum_t lr_t ||g_i(w_t)||^2`` over the steps sample i was trained in.

    Against a torch.func reference."""
    from metastore_plugins.core.reports.tables import outlier_points, outlier_rows, self_influence_of

    expected: dict[int, float] = defaultdict(float)
    for _, sid, grads, lr in occurrences(run_a):
        expected[sid] += lr * float(sum(g.double().pow(2).sum() for g in grads.values()))
    assert len(expected) < len(occurrences(run_a))  # samples recur across steps: the sum is exercised
    points = outlier_points(run_a.store, [], "training")
    ids, values = self_influence_of(run_a.store, points)
    assert sorted(ids.tolist()) == sorted(expected)
    np.testing.assert_allclose(values, [expected[int(i)] for i in ids], rtol=1e-5)
    rows = outlier_rows(run_a.store, points, k=3, rank_by="self_influence")
    assert len(rows) == 3
    got = [(row["sample_id"], expected[row["sample_id"]]) for row in rows]
    assert_top_ranking(got, list(expected.items()), 1e-5 * max(expected.values()))
