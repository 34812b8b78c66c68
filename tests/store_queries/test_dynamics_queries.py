"""Training-dynamics and sketch queries of the store against references kept during training.

References: ``.grad`` of each step and ``torch.func`` per-sample gradients (see conftest);
the weights before and after training for the cumulative updates of ``compare``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from reportcases import assert_top_ranking
from runcases import Run, expected_sketch, make_data, occurrences, per_sample_ce
from torch import Tensor

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core import ops
from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.training.passes import capture_step

TOL = 1e-5
LAYERS = ("3", "2", "0")  # store.layers(): the order records come in (backward order)


def rel(actual: Tensor | np.ndarray, expected: Tensor | np.ndarray) -> float:
    a, e = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    assert a.shape == e.shape, (a.shape, e.shape)
    return float((a - e).abs().max() / e.abs().max().clamp_min(1e-30))


def flat_norm(grads: dict[str, Tensor], names: list[str] | None = None) -> float:
    return float(torch.cat([grads[n].reshape(-1).double() for n in (names or sorted(grads))]).norm())


def gap_threshold(values: list[float]) -> float:
    """A threshold in the widest gap of the middle half of ``values``: far from every value.

    The gap is checked to be 100 times wider than the store's error (``TOL`` of the largest value),
    so every value computed by the store is on the same side of the threshold as its reference.
    """
    v = sorted(values)
    lo, hi = len(v) // 4, 3 * len(v) // 4
    k = max(range(lo, hi), key=lambda j: v[j + 1] - v[j])
    assert v[k + 1] - v[k] > 100 * TOL * max(abs(v[0]), abs(v[-1])), (
        "no clear gap: the data would put a value on the threshold"
    )
    return 0.5 * (v[k] + v[k + 1])


def ranking_of(values: Tensor) -> list[tuple[tuple[int, ...], float]]:
    """Every entry of ``values`` as ``(index, value)``: the candidates of a top-k query."""
    return [
        (tuple(int(i) for i in np.unravel_index(j, tuple(values.shape))), float(v))
        for j, v in enumerate(values.reshape(-1))
    ]


def contributor_ranking(
    run: Run, name: str, entry: tuple[int, ...], first: int, last: int
) -> dict[tuple[int, int], float]:
    """``(sample id, step) -> g_i[entry]`` of every occurrence in the range (the candidates of top_contributors)."""
    return {(sid, step): float(g[name][entry]) for step, sid, g, _ in occurrences(run, first, last)}


def assert_contributors(
    ids: list[int], steps: list[int], values: list[float], reference: dict[tuple[int, int], float]
) -> None:
    """Reported contributors are a top-k of the reference by ``|g|`` (up to ties), each with its signed value."""
    tol = TOL * max(abs(v) for v in reference.values())
    keys = list(zip(ids, steps))
    assert_top_ranking(
        [(key, abs(v)) for key, v in zip(keys, values)], [(key, abs(v)) for key, v in reference.items()], tol
    )
    assert all(abs(v - reference[key]) <= tol for key, v in zip(keys, values)), (keys, values)


# -- batch_gradient --------------------------------------------------------------------------


def test_batch_gradient_equals_the_grad_of_each_step(run_a: Run) -> None:
    store = run_a.store
    assert store.steps("train") == run_a.steps
    for step, grad, refs in zip(run_a.steps, run_a.grads, run_a.refs):
        restored = store.batch_gradient(step)
        assert set(restored) == set(grad)
        for name in grad:
            assert rel(restored[name], grad[name]) <= TOL, (step, name)
            assert rel(store.batch_gradient(step, reduction="sum")[name], refs[name].sum(0)) <= TOL
    only = store.batch_gradient(2, layers=["0"])
    assert set(only) == {"0.weight", "0.bias"}


def test_batch_gradient_with_gradient_accumulation(run_accum: Run) -> None:
    store = run_accum.store
    assert {int(m) for m in store.metadata("train")["micro_batch"]} == {0, 1}
    for step, grad, refs in zip(run_accum.steps, run_accum.grads, run_accum.refs):
        restored = store.batch_gradient(step, reduction="mean_of_batches")
        for name in grad:
            assert rel(restored[name], grad[name]) <= TOL, (step, name)
        mean = store.batch_gradient(step, reduction="mean")
        for name in grad:
            assert rel(mean[name], refs[name].mean(0)) <= TOL
            if step < 2:  # equal micro-batches: the plain mean is what the optimizer saw
                assert rel(mean[name], grad[name]) <= TOL
        if step >= 2:  # 5 + 3: the plain mean is not .grad, and the store must not pretend it is
            assert max(rel(mean[n], grad[n]) for n in grad) > 1e-3


# -- changed_most, top_contributors ------------------------------------------------------------


def reference_changes(run: Run, first: int = 0, last: int = 10**9) -> dict[str, Tensor]:
    total: dict[str, Tensor] = {}
    for _, _, grads, lr in occurrences(run, first, last):
        for name, g in grads.items():
            total[name] = total.get(name, 0) + lr * g.double().abs()
    return total


def test_changed_most_per_parameter(run_a: Run) -> None:
    expected = reference_changes(run_a, 2, 5)
    rows = run_a.store.changed_most("0", k=4, steps=(2, 5))
    assert [row.param for row in rows] == ["0.weight"] * 4 + ["0.bias"] * 4
    for name in ("0.weight", "0.bias"):
        mine = [(row.index, row.value) for row in rows if row.param == name]
        assert_top_ranking(mine, ranking_of(expected[name]), TOL * float(expected[name].max()))


def test_changed_most_over_every_parameter_and_by_epoch(run_a: Run) -> None:
    expected = reference_changes(run_a, 4, 7)  # epoch 1 = steps 4..7
    rows = run_a.store.changed_most(k=3, epochs=1, per_param=False)
    ranking = [((name, index), value) for name, v in expected.items() for index, value in ranking_of(v)]
    tol = TOL * max(value for _, value in ranking)
    assert len(rows) == 3
    assert_top_ranking([((r.param, r.index), r.value) for r in rows], ranking, tol)
    every = run_a.store.changed_most(k=2)
    assert {row.param for row in every} == set(run_a.grads[0])


def test_top_contributors_of_given_entries(run_a: Run) -> None:
    entries = [(0, 0), (3, 5), (7, 2)]
    result = run_a.store.top_contributors("0", k=3, entries=entries, steps=(1, 6))
    assert result.param == "0.weight" and result.entries == entries
    assert result.sample_ids.shape == result.steps.shape == result.values.shape == (3, 3)
    for e, entry in enumerate(entries):
        reference = contributor_ranking(run_a, "0.weight", entry, 1, 6)
        assert_contributors(
            result.sample_ids[e].tolist(), result.steps[e].tolist(), result.values[e].tolist(), reference
        )
    assert result.rows()[0]["contributors"][0][:2] == (int(result.sample_ids[0, 0]), int(result.steps[0, 0]))


def test_top_contributors_default_entries_are_those_that_changed_most(run_a: Run) -> None:
    result = run_a.store.top_contributors("0", k=2, epochs=0, n_entries=5)
    changes = reference_changes(run_a, 0, 3)["0.weight"]
    chosen = [(entry, float(changes[entry])) for entry in result.entries]
    assert len(chosen) == 5
    assert_top_ranking(chosen, ranking_of(changes), TOL * float(changes.max()))
    for e, entry in enumerate(result.entries):
        reference = contributor_ranking(run_a, "0.weight", entry, 0, 3)
        assert_contributors(
            result.sample_ids[e].tolist(), result.steps[e].tolist(), result.values[e].tolist(), reference
        )


def test_top_contributors_of_a_bias_and_of_a_dense_layer(run_a: Run) -> None:
    for layer, name, entry in (("3", "3.bias", (1,)), ("2", "2.weight", (4,))):
        role = name.split(".")[1]
        result = run_a.store.top_contributors(layer, k=40, role=role, entries=[entry])
        reference = contributor_ranking(
            run_a, name, entry, 0, 10**9
        )  # 48 occurrences; two |g| of 2.weight differ by 1e-5
        assert result.values.shape == (1, 40)
        assert_contributors(
            result.sample_ids[0].tolist(), result.steps[0].tolist(), result.values[0].tolist(), reference
        )


# -- exceed fractions and spikes ---------------------------------------------------------------


def test_exceed_fractions_of_samples_and_of_weights(run_a: Run) -> None:
    norms = {s: [flat_norm(g) for st, _, g, _ in occurrences(run_a) if st == s] for s in run_a.steps}
    threshold = gap_threshold([n for values in norms.values() for n in values])
    steps, fractions = run_a.store.exceed_fractions(threshold)
    assert steps.tolist() == run_a.steps
    expected = [sum(n > threshold for n in norms[s]) / len(norms[s]) for s in run_a.steps]
    assert fractions.tolist() == pytest.approx(expected, abs=1e-9)  # multiples of 1/6
    entries = torch.cat([g.abs().reshape(-1) for grads in run_a.grads for g in grads.values()])
    w_threshold = gap_threshold(entries.tolist())
    steps, fractions = run_a.store.exceed_fractions(w_threshold, of="weights", steps=(2, 4))
    assert steps.tolist() == [2, 3, 4]
    for step, fraction in zip(steps.tolist(), fractions.tolist()):
        grads = run_a.grads[step]
        above = sum(int((g.abs() > w_threshold).sum()) for g in grads.values())
        assert fraction == pytest.approx(above / sum(g.numel() for g in grads.values()), abs=1e-9)


def test_spikes_and_the_samples_seen_before_them(run_a: Run) -> None:
    norms = {s: [flat_norm(g) for st, _, g, _ in occurrences(run_a) if st == s] for s in run_a.steps}
    threshold = gap_threshold([n for values in norms.values() for n in values])
    fractions = {s: sum(n > threshold for n in norms[s]) / len(norms[s]) for s in run_a.steps}
    levels = sorted(set(fractions.values()))
    assert len(levels) >= 2, "the run should give steps with different exceed fractions"
    fraction = 0.5 * (levels[-2] + levels[-1]) if levels[-1] < 1 else levels[-2]
    expected = [s for s in run_a.steps if fractions[s] > fraction]
    spikes = run_a.store.spikes(threshold, fraction=fraction, before=2)
    assert [spike.step for spike in spikes] == expected
    for spike in spikes:
        window = [s for s in run_a.steps if spike.step - 2 <= s < spike.step]
        assert spike.steps_before == window
        seen = [int(i) for s in window for i in run_a.ids[s]]
        assert spike.sample_ids.tolist() == list(dict.fromkeys(seen))
        assert spike.fraction == pytest.approx(fractions[spike.step], abs=1e-9)
    at_level = run_a.store.spikes(threshold, fraction=levels[-2], before=2)  # "more than": strictly
    assert [spike.step for spike in at_level] == [s for s in run_a.steps if fractions[s] > levels[-2]]
    first_only = run_a.store.spikes(threshold, fraction=fraction, before=0)
    assert [s.step for s in first_only] == expected and all(s.sample_ids.size == 0 for s in first_only)


# -- sketches and clusters ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 7])
def test_sketches_are_the_projections_of_the_reference_gradients(run_a: Run, seed: int) -> None:
    dim, grads = 4, [g for _, _, g, _ in occurrences(run_a)]
    per_layer = torch.stack([torch.stack([expected_sketch(g, layer, dim, seed) for layer in LAYERS]) for g in grads])
    assert run_a.store.layers() == list(LAYERS)
    summed = run_a.store.sketches("train", dim=dim, seed=seed)
    assert summed.shape == (len(grads), dim * dim)
    assert rel(summed, per_layer.sum(1)) <= TOL
    side_by_side = run_a.store.sketches("train", dim=dim, seed=seed, combine="concat")
    assert rel(side_by_side, per_layer.reshape(len(grads), -1)) <= TOL
    some = run_a.store.sketches("train", dim=dim, seed=seed, layers=["0", "3"], steps=(0, 1))
    assert rel(some, per_layer[:12, [2, 0]].sum(1)) <= TOL


def test_sketch_inner_products_estimate_the_true_ones(run_a: Run) -> None:
    """Unbiasedness seen through the store: over many seeds, sketched dots average to the true dots."""
    grads = [g for _, _, g, _ in occurrences(run_a, 0, 0)]
    flat = torch.stack([torch.cat([g[n].reshape(-1) for n in sorted(g)]) for g in grads]).double()  # (6, P)
    true, seeds = flat @ flat.T, 400
    sketches = (run_a.store.sketches("train", 8, seed, steps=0) for seed in range(seeds))
    estimates = torch.stack([torch.from_numpy(s @ s.T) for s in sketches])  # (seeds, 6, 6)
    error = estimates.mean(0) - true
    standard_error = estimates.std(0) / math.sqrt(seeds)
    assert float((error.abs() / standard_error).max()) <= 4.5  # no bias beyond sampling noise
    assert float(error.abs().max()) <= 0.1 * float(true.diagonal().max())


def test_clusters_are_kmeans_of_the_sketches(run_a: Run) -> None:
    result = run_a.store.clusters("train", 3, dim=4, seed=1)
    grads = [g for _, _, g, _ in occurrences(run_a)]
    points = torch.stack([sum(expected_sketch(g, layer, 4, 1) for layer in LAYERS) for g in grads]).double()
    expected = ops.kmeans(points, 3, seed=1)
    distances = torch.cdist(points, expected.centroids.double()).sort(dim=1).values  # (N, 3)
    # every point is clearly nearer one centroid than the next (by 1%, the store's sketches err by 1e-5): the
    # labels cannot depend on rounding
    assert float(((distances[:, 1] - distances[:, 0]) / distances[:, 1]).min()) > 1e-2
    assert np.array_equal(result.sample_ids, np.concatenate([ids.numpy() for ids in run_a.ids]))
    assert result.labels.tolist() == expected.labels.tolist()
    assert math.isclose(result.inertia, expected.inertia, rel_tol=1e-4)
    with pytest.raises(ValueError, match="k must be"):
        run_a.store.clusters("train", 10_000)


def test_a_layer_called_twice(run_twice: Run) -> None:
    """Per-sample gradients of a shared parameter sum both calls: |.| and norms are taken after the sum."""
    store = run_twice.store
    assert max(len(b.records) for b in store.select("train", layers=["lin"]).batches()) == 2
    for step, grad in zip(run_twice.steps, run_twice.grads):
        assert all(rel(store.batch_gradient(step)[n], grad[n]) <= TOL for n in grad)
    expected = reference_changes(run_twice)

    def check_changed(rows: list[Any]) -> None:
        for name in ("lin.weight", "lin.bias"):
            mine = [(r.index, r.value) for r in rows if r.param == name]
            assert len(mine) == 3
            assert_top_ranking(mine, ranking_of(expected[name]), TOL * float(expected[name].max()))

    def check_contributors(result: Any) -> None:
        assert result.entries == [(2, 3), (5, 0)]
        for e, entry in enumerate(result.entries):
            reference = contributor_ranking(run_twice, "lin.weight", entry, 0, 10**9)
            assert_contributors(
                result.sample_ids[e].tolist(), result.steps[e].tolist(), result.values[e].tolist(), reference
            )

    check_changed(store.changed_most("lin", k=3))
    check_contributors(store.top_contributors("lin", k=4, entries=[(2, 3), (5, 0)]))
    norms = [flat_norm(g) for _, _, g, _ in occurrences(run_twice)]
    threshold = gap_threshold(norms)
    _, fractions = store.exceed_fractions(threshold)
    per_step = np.array(norms).reshape(len(run_twice.steps), -1)
    assert fractions.tolist() == pytest.approx([float(np.mean(row > threshold)) for row in per_step], abs=1e-9)
    check_changed(store.changed_most("lin", k=3, max_bytes=1))  # one sample at a time: the same answer
    check_contributors(store.top_contributors("lin", k=4, entries=[(2, 3), (5, 0)], max_bytes=1))
    sketched = store.sketches("train", dim=3, seed=2, layers=["lin"])
    expected_sk = torch.stack([expected_sketch(g, "lin", 3, 2) for _, _, g, _ in occurrences(run_twice)])
    assert rel(sketched, expected_sk) <= TOL


# -- compare -----------------------------------------------------------------------------------


def test_compare_two_runs(run_a: Run, run_b: Run) -> None:
    result = run_a.store.compare(run_b.store)
    assert [row.layer for row in result.layers] == list(LAYERS)
    for row in result.layers:
        names = [f"{row.layer}.weight", f"{row.layer}.bias"]
        mine = np.mean([flat_norm(g, names) for _, _, g, _ in occurrences(run_a)])
        theirs = np.mean([flat_norm(g, names) for _, _, g, _ in occurrences(run_b)])
        assert math.isclose(row.mean_norm, mine, rel_tol=TOL) and math.isclose(row.other_mean_norm, theirs, rel_tol=TOL)
        assert math.isclose(row.ratio, mine / theirs, rel_tol=2 * TOL)
        moved_a = torch.cat([(run_a.start[n] - run_a.end[n]).reshape(-1) for n in names]).double()
        moved_b = torch.cat([(run_b.start[n] - run_b.end[n]).reshape(-1) for n in names]).double()
        cosine = float(moved_a @ moved_b / (moved_a.norm() * moved_b.norm()))
        assert abs(row.update_cosine - cosine) <= 1e-5
    assert result.steps.tolist() == list(range(8)) and run_b.steps == list(range(6))
    for k, step in enumerate(range(8)):
        norms = [flat_norm(g) for st, _, g, _ in occurrences(run_a) if st == step]
        assert math.isclose(result.norm[k], np.mean(norms), rel_tol=TOL)
        assert math.isclose(result.loss[k], float(run_a.losses[step].mean()), rel_tol=TOL)
        if step < 6:
            assert math.isclose(result.other_loss[k], float(run_b.losses[step].mean()), rel_tol=TOL)
        else:
            assert math.isnan(result.other_norm[k]) and math.isnan(result.other_loss[k])
    by_path = run_a.store.compare(str(run_b.store.path), layers=["0"])
    assert [row.layer for row in by_path.layers] == ["0"]


def test_compare_refuses_another_model(run_a: Run, tmp_path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(6, 3))
    x, y = make_data()
    with StoreWriter(tmp_path, encoding="fp32") as writer:
        capture_step(model, lambda: model(x[:4]), y[:4], torch.arange(4), per_sample_ce, writer, step=0)
    with pytest.raises(StoreError, match="no layer is in both"):
        run_a.store.compare(open_store(tmp_path))
    with pytest.raises(StoreError, match="'3' are not in both"):
        run_a.store.compare(open_store(tmp_path), layers=["3"])


# -- bad input ---------------------------------------------------------------------------------


def test_bad_input_names_the_argument(run_a: Run) -> None:
    store = run_a.store
    cases = [
        (StoreError, "unknown layer", lambda: store.top_contributors("nope")),
        (StoreError, "role 'kernel'", lambda: store.top_contributors("0", role="kernel")),
        (StoreError, "unknown layer", lambda: store.changed_most("nope")),
        (StoreError, "step 99 is not stored", lambda: store.batch_gradient(99)),
        (StoreError, "unknown capture point", lambda: store.batch_gradient(0, capture_point="val")),
        (StoreError, "no batch", lambda: store.changed_most(steps=(50, 60))),
        (ValueError, "reduction", lambda: store.batch_gradient(0, reduction="max")),
        (ValueError, "step must be", lambda: store.batch_gradient("0")),
        (ValueError, "fraction", lambda: store.spikes(1.0, fraction=1.5)),
        (ValueError, "fraction", lambda: store.spikes(1.0, fraction="0.1")),
        (ValueError, "before", lambda: store.spikes(1.0, before=-1)),
        (ValueError, "threshold", lambda: store.spikes(-1.0)),
        (ValueError, "threshold", lambda: store.exceed_fractions(float("nan"))),
        (ValueError, "of must be", lambda: store.exceed_fractions(1.0, of="layers")),
        (ValueError, "k must be", lambda: store.top_contributors("0", k=0)),
        (ValueError, "k must be", lambda: store.changed_most(k=-2)),
        (ValueError, "out of range", lambda: store.top_contributors("0", entries=[(8, 0)])),
        (ValueError, "entries must", lambda: store.top_contributors("0", entries=[(1, 2, 3)])),
        (ValueError, "entries must", lambda: store.top_contributors("0", entries=[[1, 2, 3], [4, 5, 6]])),
        (ValueError, "entries must", lambda: store.top_contributors("0", entries=[(1, 2), (3,)])),
        (ValueError, "entries must", lambda: store.top_contributors("0", entries=[(0.5, 1)])),
        (ValueError, "dim must be", lambda: store.sketches("train", dim=0)),
        (ValueError, "combine", lambda: store.sketches("train", combine="mean")),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()


def test_in_run_influence_restricted_to_train_and_test_ids(run_a: Run) -> None:
    """``in_run_influence(train_ids=, test_ids=)`` as ``influence`` has them (issue 28, item 13): every occurrence
    of a chosen train sample against every occurrence of a chosen test sample, weighted by the train step's lr."""
    train_ids, test_ids = [3, 17, 5], [0, 11]
    scores = run_a.store.in_run_influence("train", train="train", steps=(0, 5), train_ids=train_ids, test_ids=test_ids)
    assert sorted(scores.row_ids.tolist()) == sorted(train_ids) and sorted(scores.col_ids.tolist()) == test_ids
    trained, tested = occurrences(run_a, 0, 5), occurrences(run_a)  # the test side: every step
    for r, i in enumerate(scores.row_ids.tolist()):
        for c, j in enumerate(scores.col_ids.tolist()):
            expected = sum(
                lr * float(sum((g[n].double() * h[n].double()).sum() for n in g))
                for _, sid, g, lr in trained
                if sid == i
                for _, tid, h, _ in tested
                if tid == j
            )
            assert abs(scores.scores[r, c] - expected) <= TOL * np.abs(scores.scores).max(), (i, j)
