"""The benchmark harness runs end to end at its smallest sizes (not a timing test).

It runs ``python -m metastore_bench run --smoke`` in a subprocess from the repository root
(the harness is not installed with the package: the repository on ``sys.path`` finds it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
METHODS = ["plain", "capture+store", "torch.func", "opacus", "backpack"]

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("bench")
    doc = out / "benchmarks.md"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "metastore_bench", "run", "--smoke", "--threads", "1"]
    done = subprocess.run(
        [*command, "--out", str(out), "--doc", str(doc)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "smoke.json").read_text()), doc


@pytest.mark.slow  # its fixture runs the benchmark in a subprocess
def test_result_structure(smoke_run: tuple[dict, Path]) -> None:
    result, _ = smoke_run
    assert {"meta", "capture", "storage", "analytics", "scaling", "checks"} <= set(result)
    assert result["meta"]["mode"] == "smoke"
    assert {"torch", "transformers", "opacus", "backpack-for-pytorch", "captum"} <= set(result["meta"]["versions"])
    assert result["meta"]["threads"] == 1
    for case in result["capture"]:
        assert list(case["methods"]) == METHODS
        for name, method in case["methods"].items():
            status = method["status"]
            assert status == "ok" or status == "skipped (not installed)" or status.startswith("failed: "), (
                name,
                status,
            )
            if status == "ok":
                assert method["median_s"] > 0 and method["ratio_to_plain"] > 0
        assert case["methods"]["plain"]["status"] == "ok"
        assert case["methods"]["capture+store"]["status"] == "ok"
        assert case["methods"]["capture+store"]["bytes_written"] > 0
    for case in result["storage"]:
        assert set(case["encodings"]) == {"fp32", "fp16", "bf16", "int8"}
        sizes = {enc: e["store_per_sample"] for enc, e in case["encodings"].items()}
        assert sizes["int8"] < sizes["fp16"] < sizes["fp32"] < case["dense_fp32_per_sample"]
        for e in case["encodings"].values():
            assert e["store_per_sample_unpruned"] >= e["store_per_sample"]
    text = [c for c in result["storage"] if c["padding_fraction"] > 0]
    assert text and all(c["encodings"]["fp16"]["pruning_saves"] > 1.5 for c in text)
    for case in result["analytics"]:
        rate, sketch = case["influence_rate"], case["sketch"]
        assert rate["plan_flops"] > 0 and rate["matmul_gflops_per_s"] > 0 and rate["ratio_to_matmul"] > 0
        assert sketch["build_s"] > 0 and sketch["query_s"] > 0 and sketch["cache_bytes"] > 0
        assert -1 <= sketch["spearman_vs_exact"] <= 1
    (text_case,) = [c for c in result["analytics"] if c["influence_memory_mib"]]
    for memory in text_case["influence_memory_mib"].values():
        assert memory["extra_peak_mib"] > 0 and memory["time_s"] > 0
    points = result["scaling"]["points"]
    assert {p["method"] for p in points} == {"store", "rebuild"}
    assert all(p["median_s"] > 0 and p["rss_peak_mib"] > 0 for p in points)


@pytest.mark.slow  # its fixture runs the benchmark in a subprocess
def test_agreement_checks_passed(smoke_run: tuple[dict, Path]) -> None:
    result, _ = smoke_run
    assert result["checks"] and all(check["passed"] for check in result["checks"]), result["checks"]
    for case in result["analytics"]:
        agreement = case["agreement"]
        assert agreement["influence_store_fp32"] < 1e-3 and agreement["norms_store_fp32"] < 1e-3
        assert agreement["influence_rebuild_fp32"] < 1e-3


@pytest.mark.slow  # its fixture runs the benchmark in a subprocess
def test_markdown_and_plot_written(smoke_run: tuple[dict, Path]) -> None:
    from PIL import Image

    _, doc = smoke_run
    text = doc.read_text()
    for heading in (
        "Capture",
        "Storage",
        "Analytics",
        "Exact store influence",
        "Sketched influence",
        "Issue 4 targets",
        "Scaling",
        "Checks",
    ):
        assert f"#### {heading}" in text
    assert "<!-- results:start -->" in text and "<!-- results:end -->" in text
    with Image.open(doc.parent / "benchmarks-scaling-smoke.png") as image:
        assert image.format == "PNG" and image.size[0] > 100


def test_rewriting_keeps_hand_written_text(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_report", REPO / "metastore_bench" / "report.py")
    assert spec is not None and spec.loader is not None
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)  # by path, as a module of its own
    write_doc = report.write_doc
    doc = tmp_path / "b.md"
    write_doc(doc, "first\n", "# Title\n\nHand-written.\n")
    write_doc(doc, "second\n", "unused")
    text = doc.read_text()
    assert text.startswith("# Title\n\nHand-written.") and "second" in text and "first" not in text
