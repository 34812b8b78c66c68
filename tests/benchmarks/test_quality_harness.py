"""``python -m metastore_bench.quality --quick`` as a smoke test: every detector and attributor scored, docs written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("cleanlab")
pytest.importorskip("dattri")
pytest.importorskip("sklearn")

from metastore_bench.quality.__main__ import main  # noqa: E402
from metastore_bench.quality.detectors import STORE_DETECTORS  # noqa: E402
from metastore_bench.quality.label_errors import REPORT_DEFAULT  # noqa: E402


def test_quick_run(tmp_path: Path) -> None:
    doc = tmp_path / "quality.md"
    doc.write_text("# Quality\n")
    result = main(["--quick", "--out", str(tmp_path), "--doc", str(doc)])
    rows = result["label_errors"]["rows"]
    assert [(r["task"], r["noise"]) for r in rows] == [("digits-mlp", "uniform"), ("digits-cnn", "hard")]
    for row in rows:
        assert set(STORE_DETECTORS) | {REPORT_DEFAULT, "cleanlab label quality (5-fold)"} == set(row["detectors"])
        for scores in row["detectors"].values():
            assert 0.0 <= scores["precision"] <= 1.0 and 0.0 <= scores["auroc"] <= 1.0
        assert row["cleanlab_trainings"] == 5 and row["store_trainings"] == 1
        # 10% flipped: a random ranking finds about 0.1 of them; the margin finds most
        assert row["detectors"]["AUM"]["precision"] > 0.5
    saved = json.loads((tmp_path / "quality_label_errors_quick.json").read_text())
    assert saved["label_errors"]["rows"] == rows
    text = doc.read_text()
    assert "<!-- label-errors:start -->" in text and "| report default |" in text
    assert (tmp_path / "quality-precision.png").stat().st_size > 0
    lds = {row["attributor"]: row for row in result["lds"]["mlp"]["attributors"]}
    assert "error" not in lds["TracIn exact (checkpoint passes)"] and "<!-- lds:start -->" in text
    assert lds["TracIn exact (checkpoint passes)"]["lds"] > 0.1  # retraining follows the scores (0.35 measured)
    assert (tmp_path / "quality_lds_quick.json").is_file()
