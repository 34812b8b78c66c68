"""``metastore influence --method/--damping/--relative-damping``: what runs, what the output says, what is refused.

Run in process (``main``); the stores are written straight through ``StoreWriter`` (tests/methodcases.py).
References: ``store.kfac_influence`` / ``store.influence`` of the same store, up to ties (``assert_top_ranking``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from methodcases import TRAIN, VAL, write_passes
from reportcases import assert_top_ranking

from metastore_plugins import open_store
from metastore_plugins.cli import main


@pytest.fixture(scope="module")
def exact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_passes(tmp_path_factory.mktemp("cli-exact") / "store")


@pytest.fixture(scope="module")
def projected(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_passes(tmp_path_factory.mktemp("cli-projected") / "store", projected=True)


def influence(capsys: pytest.CaptureFixture[str], *args: str) -> list[dict]:
    assert main(["influence", *args, "--json", "-k", "3"]) == 0
    return json.loads(capsys.readouterr().out)


def assert_proponents(rows: list[dict], scores: np.ndarray, row_ids: np.ndarray, col_ids: np.ndarray) -> None:
    tol = 1e-6 * float(np.abs(scores).max())
    for row in rows:
        column = scores[:, col_ids.tolist().index(row["test_id"])]
        got = [(p["sample_id"], p["score"]) for p in row["proponents"]]
        assert_top_ranking(got, list(zip(row_ids.tolist(), column.tolist())), tol)


def test_auto_is_ekfac_on_exact_factors_and_tracin_on_request(exact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = open_store(exact)
    rows = influence(capsys, str(exact))
    assert {(r["method"], r["relative_damping"], r["exact"]) for r in rows} == {("ekfac", 0.1, True)}
    ekfac = store.kfac_influence(TRAIN, VAL)
    assert_proponents(rows, ekfac.scores, ekfac.row_ids, ekfac.col_ids)
    rows = influence(capsys, str(exact), "--method", "tracin")
    assert {r["method"] for r in rows} == {"tracin"}
    tracin = store.influence(TRAIN, VAL)
    assert_proponents(rows, tracin.scores, tracin.row_ids, tracin.col_ids)
    rows = influence(capsys, str(exact), "--method", "kfac", "--damping", "0.05")
    assert {(r["method"], r["damping"], r["relative_damping"]) for r in rows} == {("kfac", 0.05, None)}
    kfac = store.kfac_influence(TRAIN, VAL, method="kfac", damping=0.05)
    assert_proponents(rows, kfac.scores, kfac.row_ids, kfac.col_ids)
    rows = influence(capsys, str(exact), "--method", "trak", "--relative-damping", "0.5")
    assert {(r["method"], r["relative_damping"], r["exact"]) for r in rows} == {("trak", 0.5, False)}


def test_the_text_output_says_the_method(exact: Path, projected: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["influence", str(exact), "-k", "2"]) == 0
    assert "Method: EK-FAC, damping 0.1 x each layer's mean curvature eigenvalue." in capsys.readouterr().out
    assert main(["influence", str(projected), "-k", "2"]) == 0
    out = capsys.readouterr().out
    assert "Method: TracIn" in out and "auto chose it because K-FAC cannot precondition 'epoch-0/train'" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--method", "tracin", "--damping", "0.1"],
            "method 'tracin' has no damping (it inverts nothing): drop --damping",
        ),
        (["--method", "trak", "--damping", "0.1"], "method 'trak' takes --relative-damping"),
    ],
)
def test_flags_a_method_does_not_take_are_named(
    exact: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["influence", str(exact), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("metastore influence: error: ") and message in err


def test_damping_where_auto_chose_tracin_says_why(projected: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["influence", str(projected), "--relative-damping", "0.2"]) == 2
    err = capsys.readouterr().err
    assert "--method auto chose tracin ('epoch-0/train': " in err and "drop --damping and --relative-damping" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--method", "best"], "argument --method: invalid choice: 'best'"),
        (["--damping", "-1"], "argument --damping: expected a positive number, got '-1'"),
        (["--relative-damping", "nan"], "argument --relative-damping: expected a positive number"),
    ],
)
def test_bad_values_are_argparse_errors(
    exact: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["influence", str(exact), *args])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_report_takes_the_method(exact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for method, expected in (("auto", "ekfac"), ("trak", "trak")):
        out = tmp_path / method
        assert main(["report", str(exact), "--out", str(out), "--method", method]) == 0
        capsys.readouterr()
        rows = json.loads((out / "influence.json").read_text())
        assert rows and {row["method"] for row in rows} == {expected}
