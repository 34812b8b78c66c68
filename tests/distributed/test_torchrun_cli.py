"""``torchrun --nproc-per-node 2 -m metastore_plugins.cli influence RUN`` prints what one process prints, and
``report`` writes what one process writes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ddp_store import write_ddp_store
from reportcases import assert_tables_match, assert_top_ranking, read_tables

from metastore_plugins import open_store
from metastore_plugins.cli import main
from metastore_plugins.core.training.report_pass import report_run

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_ddp_store(tmp_path_factory.mktemp("ddp-cli") / "store")


def _torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    command = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "metastore_plugins.cli", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.slow
@pytest.mark.torchrun
def test_influence_and_outliers_under_torchrun_print_the_single_process_answer(
    store_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["influence", str(store_dir), "--json", "-k", "3"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert main(["outliers", str(store_dir), "--json", "-k", "5"]) == 0
    outliers = json.loads(capsys.readouterr().out)
    done = _torchrun("influence", str(store_dir), "--json", "-k", "3")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)  # printed once: by rank 0
    points = (["epoch-0/train", "epoch-1/train"], ["epoch-0/val", "epoch-1/val"])
    full = open_store(store_dir).influence(*points, method=alone[0]["method"])  # --method auto: EK-FAC or TracIn
    tol = 1e-6 * float(np.abs(full.scores).max())
    assert [r["test_id"] for r in rows] == [r["test_id"] for r in alone] == full.col_ids.tolist()
    for j, row in enumerate(rows):
        ranking = list(zip(full.row_ids.tolist(), full.scores[:, j].tolist()))
        assert_top_ranking([(p["sample_id"], p["score"]) for p in row["proponents"]], ranking, tol)
    done = _torchrun("outliers", str(store_dir), "--json", "-k", "5")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    values = open_store(store_dir).self_influence(["epoch-0/train", "epoch-1/train"])
    ids = open_store(store_dir).self_influence_ids(["epoch-0/train", "epoch-1/train"])
    reference = dict(zip(ids.tolist(), values.tolist()))
    assert [r["sample_id"] for r in rows] == [r["sample_id"] for r in outliers]  # the report's own order
    for row in rows:
        assert abs(row["self_influence"] - reference[row["sample_id"]]) <= 1e-6 * float(values.max())


@pytest.mark.slow
@pytest.mark.torchrun
def test_report_under_torchrun_writes_the_single_process_reports(store_dir: Path, tmp_path: Path) -> None:
    alone = report_run(store_dir, tmp_path / "alone")
    assert alone is not None
    done = _torchrun(
        "report", str(store_dir), "--out", str(tmp_path / "ddp"), "--logdir", str(tmp_path / "tb"), "--json"
    )
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)  # printed once: by rank 0
    assert {"outliers.json", "influence.json", "summary.json"} <= {Path(f).name for f in printed["files"]}
    assert_tables_match(store_dir, read_tables(tmp_path / "ddp"), alone)
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1  # rank 0's writer only


def test_a_command_that_does_not_run_partitioned_refuses(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["inspect", str(store_dir)]) == 2
    assert "does not run partitioned; run it without torchrun" in capsys.readouterr().err


def test_device_runs_the_partitioned_code_in_one_process(store_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["similar", str(store_dir), "--sample", "3", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert main(["similar", str(store_dir), "--sample", "3", "--json", "--device", "cpu"]) == 0
    rows = json.loads(capsys.readouterr().out)
    full = open_store(store_dir).similar("epoch-1/train", "epoch-1/train", query_ids=[3])
    ranking = [(i, s) for i, s in zip(full.row_ids.tolist(), full.scores[:, 0].tolist()) if i != 3]
    assert len(rows) == len(alone)
    assert_top_ranking([(r["sample_id"], r["cosine"]) for r in rows], ranking, 1e-6)
