"""The ``metastore`` command on a real example run: exit codes, --json checked against the Python API, bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from reportcases import assert_top_ranking
from safetensors.torch import load_file

from metastore_plugins import open_store
from metastore_plugins.core.analysis import Scores
from metastore_plugins.testing import max_relative_error

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "run"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "train_text_classifier.py"),
            "--out",
            str(out),
            "--epochs",
            "2",
            "--train-size",
            "128",
            "--encoding",
            "fp32",
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


def metastore(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "metastore_plugins.cli", *args], capture_output=True, text=True, timeout=120
    )


def json_of(*args: str) -> object:
    done = metastore(*args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def tolerance(values: object) -> float:
    """fp32 round-off of values computed by two processes from one fp32 store: 1e-6 of the largest."""
    return 1e-6 * float(np.abs(np.asarray(values, dtype=np.float64)).max())


def test_inspect_matches_the_store(run_dir: Path) -> None:
    data = json_of("inspect", str(run_dir))
    store = open_store(run_dir)
    assert data["samples"] == sum(len(store.sample_ids(cp)) for cp in store.capture_points())
    assert set(data["capture_points"]) == set(store.capture_points())
    assert data["problems"] == [] and set(data["layers_detail"]) == set(store.layers())
    assert "capture points:" in metastore("inspect", str(run_dir)).stdout


def test_outliers_match_self_influence(run_dir: Path) -> None:
    rows = json_of("outliers", str(run_dir), "-k", "5", "--by", "self_influence")
    store = open_store(run_dir)
    points = ["epoch-0/train", "epoch-1/train"]
    values = store.self_influence(points)
    ids = store.self_influence_ids(points)
    assert len(rows) == 5
    ranking = list(zip(ids.tolist(), values.tolist()))
    assert_top_ranking([(row["sample_id"], row["self_influence"]) for row in rows], ranking, tolerance(values))


def test_outliers_rank_by_lowest_area_under_the_margin_by_default(run_dir: Path) -> None:
    rows = json_of("outliers", str(run_dir), "-k", "6")
    meta = open_store(run_dir).metadata("train")
    ids = np.unique(meta["sample_id"])
    aum = np.array([meta["margin"][meta["sample_id"] == i].astype(np.float64).mean() for i in ids])  # (N,)
    assert np.isfinite(aum).all()
    ranking = list(zip(ids.tolist(), (-aum).tolist()))
    assert_top_ranking([(row["sample_id"], -row["aum"]) for row in rows], ranking, tolerance(aum))
    assert all(row["self_influence"] is None or row["self_influence"] >= 0 for row in rows)


def test_outliers_by_final_loss(run_dir: Path) -> None:
    rows = json_of("outliers", str(run_dir), "-k", "4", "--by", "loss")
    last = open_store(run_dir).metadata("epoch-1/train")  # the last checkpoint pass
    ranking = list(zip(last["sample_id"].tolist(), last["loss"].astype(np.float64).tolist()))
    assert_top_ranking([(row["sample_id"], row["pass_loss"]) for row in rows], ranking, tolerance(last["loss"]))
    assert all(row["aum"] is not None and row["self_influence"] is not None for row in rows)


def test_influence_of_chosen_test_samples(run_dir: Path) -> None:
    """Every training sample by default (the default answer); ``--train`` names the passes to rank instead."""
    store = open_store(run_dir)
    # the same test ids: the steps' scale factor is taken over the columns asked for
    default = store.influence(test=["epoch-0/val", "epoch-1/val"], method="auto", test_ids=[3, 5])
    rows = json_of("influence", str(run_dir), "--test", "3,5", "-k", "4")
    assert {row["train_side"] for row in rows} == {default.train_side}
    assert_proponents(rows, default)
    passes = ["--train", "epoch-0/train", "--train", "epoch-1/train"]
    rows = json_of("influence", str(run_dir), "--test", "3,5", "-k", "4", *passes)
    method = rows[0]["method"]  # --method auto: EK-FAC where the passes can be preconditioned, else TracIn
    assert_proponents(
        rows, store.influence(["epoch-0/train", "epoch-1/train"], ["epoch-0/val", "epoch-1/val"], method=method)
    )


def assert_proponents(rows: list[dict[str, Any]], scores: Scores) -> None:
    """The rows of test samples 3 and 5 hold a top 4 of their columns of ``scores``."""
    assert [row["test_id"] for row in rows] == [3, 5]
    for row in rows:
        column = scores.scores[:, list(scores.col_ids).index(row["test_id"])]
        assert len(row["proponents"]) == 4
        got = [(p["sample_id"], p["score"]) for p in row["proponents"]]
        assert_top_ranking(got, list(zip(scores.row_ids.tolist(), column.tolist())), tolerance(column))


def test_similar_and_restore(run_dir: Path, tmp_path: Path) -> None:
    held = int(open_store(run_dir).sample_ids("epoch-1/train")[0])  # a sample of the last training pass
    rows = json_of("similar", str(run_dir), "--sample", str(held), "-k", "3")
    assert len(rows) == 3 and all(-1.0 - 1e-6 <= r["cosine"] <= 1.0 + 1e-6 for r in rows)
    out = tmp_path / "g.safetensors"
    done = metastore("restore", str(run_dir), "--sample", "7", "--capture-point", "epoch-1/val", "--out", str(out))
    assert done.returncode == 0, done.stderr
    expected = open_store(run_dir).restore(7, capture_point="epoch-1/val")
    assert max_relative_error(load_file(str(out)), expected) <= 1e-6  # the same fp32 factors: fp32 round-off


@pytest.mark.parametrize(
    "args, message",
    [
        (["inspect", "{tmp}/not-a-store"], "is not a metastore store"),
        (
            ["restore", "{run}", "--sample", "99999", "--capture-point", "epoch-1/val", "--out", "{tmp}/x.safetensors"],
            "is not stored",
        ),
        (["similar", "{run}", "--sample", "99999"], "is not stored"),
        (["influence", "{run}", "--test", "99999"], "are not stored"),
        (["outliers", "{run}", "--capture-point", "nope"], "unknown capture point"),
        (
            [
                "restore",
                "{run}",
                "--sample",
                "1",
                "--capture-point",
                "epoch-1/val",
                "--layer",
                "nope",
                "--out",
                "{tmp}/x",
            ],
            "unknown layer",
        ),
    ],
)
def test_user_mistakes_are_one_line_errors(run_dir: Path, tmp_path: Path, args: list[str], message: str) -> None:
    done = metastore(*[a.format(run=run_dir, tmp=tmp_path) for a in args])
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr and done.stderr.count("\n") == 1


def test_a_damaged_shard_is_reported(run_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "damaged"
    shutil.copytree(run_dir / "metastore", copy)
    shard = sorted(copy.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    done = metastore("inspect", str(copy), "--json")
    assert done.returncode == 1
    assert any(shard.name in p and "sha256" in p for p in json.loads(done.stdout)["problems"])


def test_query_changed_and_contributors_match_the_python_api(run_dir: Path) -> None:
    store = open_store(run_dir)
    rows = json_of("query", str(run_dir), "changed", "--layer", "classifier", "-k", "3")
    every = store.changed_most("classifier", 10**6)  # every entry of every parameter of the layer, ranked
    params = list(dict.fromkeys(c.param for c in every))
    assert list(dict.fromkeys(r["param"] for r in rows)) == params  # grouped by parameter, in the API's order
    for param in params:
        ranking = [(tuple(c.index), c.value) for c in every if c.param == param]
        got = [(tuple(r["index"]), r["value"]) for r in rows if r["param"] == param]
        assert len(got) == min(3, len(ranking))
        assert_top_ranking(got, ranking, tolerance([v for _, v in ranking]))
    rows = json_of("query", str(run_dir), "contributors", "--layer", "classifier", "-k", "2", "--steps", "0:5")
    # the entries: the 10 weight entries that changed most over steps 0..5
    changed = store.changed_most("classifier", 10**6, steps=(0, 5))
    changes = {tuple(c.index): c.value for c in changed if c.param == "classifier.weight"}
    entries = [tuple(r["entry"]) for r in rows]
    assert len(entries) == min(10, len(changes))
    got = sorted(((e, changes[e]) for e in entries), key=lambda pair: -pair[1])
    assert_top_ranking(got, list(changes.items()), tolerance(list(changes.values())))
    for row in rows:  # each entry's contributors: the occurrences with the largest |g_i[entry]|
        every_one = store.top_contributors("classifier", 10**6, steps=(0, 5), entries=[tuple(row["entry"])]).rows()[0]
        signed = {(sid, step): value for sid, step, value in every_one["contributors"]}
        tol = tolerance(list(signed.values()))
        got = [((sid, step), abs(value)) for sid, step, value in row["contributors"]]
        assert len(got) == 2
        assert_top_ranking(got, [(key, abs(value)) for key, value in signed.items()], tol)
        assert all(abs(value - signed[(sid, step)]) <= tol for sid, step, value in row["contributors"])


def test_query_spikes_and_compare(run_dir: Path) -> None:
    store = open_store(run_dir)
    # a threshold and a fraction far from every per-sample norm and every step's fraction: no sample and no
    # step sits on either, so the command and the API (computing the norms apart) must agree exactly
    norms = np.sort(store.norms("train"))
    k = max(range(len(norms) // 4, 3 * len(norms) // 4), key=lambda j: norms[j + 1] - norms[j])
    assert norms[k + 1] - norms[k] > 1e-3 * norms[-1]
    threshold = float(0.5 * (norms[k] + norms[k + 1]))
    levels = sorted(set(store.exceed_fractions(threshold)[1].tolist()))
    assert len(levels) >= 2, levels  # some steps are spikes and some are not: the comparison means something
    fraction = 0.5 * (levels[-2] + levels[-1])
    args = ("--threshold", repr(threshold), "--fraction", repr(fraction), "--before", "2")
    rows = json_of("query", str(run_dir), "spikes", *args)
    expected = store.spikes(threshold, fraction, 2)
    assert expected and [r["step"] for r in rows] == [s.step for s in expected]
    data = json_of("query", str(run_dir), "compare", "--other", str(run_dir))
    assert all(layer["ratio"] == pytest.approx(1.0) for layer in data["layers"])
    done = metastore("query", str(run_dir), "contributors")
    assert done.returncode == 2 and "--layer" in done.stderr


def test_report_writes_files_and_tensorboard_events(run_dir: Path, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    done = metastore("report", str(run_dir), "--out", str(tmp_path / "reports"), "--logdir", str(tmp_path / "tb"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "reports" / "outliers.md").exists()
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0, "images": 0, "histograms": 0})
    events.Reload()
    tags = events.Tags()
    assert any("outlier" in tag for tag in tags["tensors"]), tags  # markdown tables (text plugin)
    assert tags["histograms"] and tags["images"], tags
