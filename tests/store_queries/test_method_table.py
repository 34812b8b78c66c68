"""The table of influence methods: a method registered in one module (docs/design.md's worked example, run as
written) is served by ``store.influence``, its top-k, the reports' influence table and ``metastore influence``, with
its arguments checked by the table; an unknown method is refused naming the choices.

The example is "TracIn at the last pass": ``lr_C <g_i(w_C), g_j(w_C)>`` over the last pair of checkpoint passes
only. Reference: ``torch.func`` per-sample gradients of the float64 model
at the last weights, knowing nothing of the store (written by pairedcases.py). Tolerance: fp32 records against
the float64 reference, ``1e-5`` relative to the largest score (tests/README.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pairedcases import LRS, N_TEST, N_TRAIN, TEST, TEST_IDS, TRAIN, checkpoints, data, write_paired
from torch import Tensor, nn

from metastore_plugins import open_store
from metastore_plugins.cli import main
from metastore_plugins.core.analysis.method_table import Method
from metastore_plugins.core.analysis.methods import METHODS, influence, method_choices, register_method
from metastore_plugins.core.errors import ConfigError
from metastore_plugins.core.training.settings import CallbackOptions
from metastore_plugins.testing import reference_per_sample_gradients

#: docs/design.md's worked example, run as written
DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"
NAME = "tracin-last"


@pytest.fixture
def registered() -> Iterator[Method]:
    """The method the example of docs/design.md registers, unregistered after the test."""
    section = DESIGN.read_text().split("## A new influence method")[1]
    exec(section.split("```python")[1].split("```")[0], {})
    try:
        yield METHODS[NAME]
    finally:
        METHODS.pop(NAME)


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_paired(tmp_path_factory.mktemp("method-table") / "store")


def reference() -> np.ndarray:
    """``(N_TRAIN, N_TEST)`` ``lr_C g_i^T g_j`` at the last weights, from ``torch.func`` per-sample gradients."""

    def loss_fn(m: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        return F.cross_entropy(m(batch["x"]), batch["y"])

    model = checkpoints()[-1]
    flat = []
    for x, y in (data(N_TRAIN, 1), data(N_TEST, 2)):
        grads = reference_per_sample_gradients(model, loss_fn, {"x": x, "y": y})
        flat.append(torch.cat([g.flatten(1) for g in grads.values()], 1))  # (N, P)
    return (LRS[-1] * flat[0] @ flat[1].T).numpy()


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


def test_a_registered_method_is_served_by_store_influence(path: Path, registered: Method) -> None:
    store, expected = open_store(path), reference()
    scores = store.influence(TRAIN, TEST, method=registered.name)
    assert scores.row_ids.tolist() == list(range(N_TRAIN)) and scores.col_ids.tolist() == TEST_IDS
    assert rel_err(scores.scores, expected) <= 1e-5
    every = store.influence(TRAIN, TEST)  # TracIn over both passes: another matrix
    assert rel_err(every.scores, expected) > 1e-2
    part = store.influence(TRAIN, TEST, method=registered.name, train_ids=[3, 8], test_ids=[102])
    assert part.row_ids.tolist() == [3, 8] and part.col_ids.tolist() == [102]
    assert rel_err(part.scores, expected[[3, 8]][:, [2]]) <= 1e-5


def test_its_arguments_are_checked_by_the_table(path: Path, registered: Method) -> None:
    store = open_store(path)
    with pytest.raises(ConfigError, match="method 'tracin-last' has no damping"):
        store.influence(TRAIN, TEST, method=registered.name, relative_damping=0.1)
    with pytest.raises(ConfigError, match="recompute= belongs to method='tracin'"):
        store.influence(TRAIN, TEST, method=registered.name, k=2, recompute=print)
    with pytest.raises(ConfigError, match="method 'tracin-last' has no self-influence; choose one of 'tracin'"):
        store.self_influence(TRAIN, method=registered.name)
    with pytest.raises(ConfigError, match="must be one of 'tracin', 'kfac', 'ekfac'; got 'tracin-last'"):
        store.in_run_influence(TEST[-1], train=TRAIN[-1], method=registered.name)


def test_its_top_k_is_the_top_of_every_row(path: Path, registered: Method) -> None:
    expected = reference()
    top = open_store(path).influence(TRAIN, TEST, method=registered.name, k=2).top(2)
    order = np.argsort(-expected, axis=0)  # (N_TRAIN, N_TEST)
    gaps = -np.diff(np.sort(expected, axis=0)[::-1][:3], axis=0)  # the top three of each column are apart
    assert gaps.min() > 1e-3 * np.abs(expected).max()
    for j, entry in enumerate(top):
        assert entry["sample_id"] == TEST_IDS[j]
        assert [i for i, _ in entry["proponents"]] == order[:2, j].tolist()


def test_the_command_line_and_the_report_caption_take_it(
    path: Path, registered: Method, capsys: pytest.CaptureFixture[str]
) -> None:
    assert registered.name in method_choices()
    expected = reference()
    assert main(["influence", str(path), "--method", registered.name, "-k", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["test_id"] for row in rows] == TEST_IDS
    for row in rows:
        column = expected[:, TEST_IDS.index(row["test_id"])]
        assert [p["sample_id"] for p in row["proponents"]] == np.argsort(-column)[:2].tolist()
        got = np.array([p["score"] for p in row["proponents"]])
        assert np.abs(got - np.sort(column)[::-1][:2]).max() <= 1e-5 * np.abs(expected).max()
        assert row["method"] == registered.name and row["damping"] is None and row["relative_damping"] is None
    assert main(["influence", str(path), "--method", registered.name, "-k", "2"]) == 0
    out = capsys.readouterr().out
    assert "Method: TracIn at the last pass (lr x gradient inner products at the last weights)." in out
    assert "Scores are exact TracIn at the last pass scores." in out
    assert main(["influence", str(path), "--method", registered.name, "--damping", "0.1"]) == 2
    assert "method 'tracin-last' has no damping (it inverts nothing): drop --damping" in capsys.readouterr().err


def test_an_unknown_method_names_the_choices(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = open_store(path)
    with pytest.raises(ConfigError, match="method must be one of 'auto', 'tracin', 'kfac', 'ekfac', 'trak'; got 'x'"):
        store.influence(TRAIN, TEST, method="x")
    with pytest.raises(ConfigError, match="method must be one of 'tracin', 'kfac', 'ekfac', 'trak'; got 'x'"):
        influence(store, TRAIN, TEST, method="x")
    with pytest.raises(ConfigError, match="method must be one of 'tracin', 'kfac', 'ekfac', 'trak'; got 'tracin-last'"):
        store.self_influence(TRAIN, method="tracin-last")  # registered by no one here
    with pytest.raises(SystemExit) as exited:
        main(["influence", str(path), "--method", "tracin-last"])
    assert exited.value.code == 2 and "invalid choice: 'tracin-last'" in capsys.readouterr().err


def test_a_name_is_registered_once(registered: Method) -> None:
    with pytest.raises(ConfigError, match="an influence method named 'tracin-last' is already registered"):
        register_method(registered)
    with pytest.raises(ConfigError, match="already registered"):
        register_method(METHODS["ekfac"])


def test_the_reports_and_the_callbacks_settings_take_it(
    path: Path, registered: Method, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    options = CallbackOptions.of("MetaStoreCallback", {"influence_method": registered.name})
    assert options.influence_method == registered.name
    out = tmp_path / "reports"
    assert main(["report", str(path), "--out", str(out), "--method", registered.name]) == 0
    capsys.readouterr()
    rows = json.loads((out / "influence.json").read_text())
    assert rows and {row["method"] for row in rows} == {registered.name}
    expected = reference()
    for row in rows:
        column = expected[:, TEST_IDS.index(row["test_id"])]
        assert row["proponents"][0]["sample_id"] == int(np.argmax(column))
    assert "Method: TracIn at the last pass" in (out / "influence.md").read_text()
