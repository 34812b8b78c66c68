"""End to end: a real ``tensorboard`` server on 127.0.0.1 serves the reports of a tiny training run."""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from matplotlib.image import imread

ROOT = Path(__file__).resolve().parents[2]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SCATTER_TAG = "metastore/loss_vs_self_influence"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(port: int, path: str, **query: str) -> Any:
    url = f"http://127.0.0.1:{port}{path}" + ("?" + urllib.parse.urlencode(query) if query else "")
    with urllib.request.urlopen(url, timeout=10) as response:
        body = response.read()
    return json.loads(body) if body[:1] in (b"{", b"[") else body


def _wait_until_serving(port: int, server: subprocess.Popen[bytes], seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"tensorboard exited: {server.stderr.read().decode() if server.stderr else ''}")
        try:
            _get(port, "/data/plugins_listing")
            return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("tensorboard did not answer in time")


@pytest.mark.filterwarnings("ignore:unclosed file:ResourceWarning")  # the server's stderr pipe is left to the collector
def test_reports_render_in_a_real_tensorboard(tmp_path: Path) -> None:
    run = tmp_path / "run"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "train_text_classifier.py"),
            "--out",
            str(run),
            "--epochs",
            "2",
            "--train-size",
            "128",
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    logdir = tmp_path / "tb"
    done = subprocess.run(
        [sys.executable, "-m", "metastore_plugins.cli", "report", str(run), "--logdir", str(logdir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "reading store" not in done.stderr  # stderr is a pipe: no progress bar
    scatter_file = run / "metastore" / "reports" / "loss_vs_self_influence.png"
    assert str(scatter_file) in done.stdout and scatter_file.read_bytes()[:8] == PNG_SIGNATURE
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        _wait_until_serving(port, server)
        # wait for the first load of the event files
        deadline = time.monotonic() + 60
        while not _get(port, "/data/plugin/text/tags") and time.monotonic() < deadline:
            time.sleep(0.5)
        text_tags = _get(port, "/data/plugin/text/tags")  # {run: [tags]}
        ((run_name, tags),) = text_tags.items()
        outlier_tag = next(tag for tag in tags if "outlier" in tag)
        table = _get(port, "/data/plugin/text/text", run=run_name, tag=outlier_tag)
        rendered = table[-1]["text"]
        assert "<table>" in rendered and "sample_id" in rendered and "self_influence" in rendered
        assert _get(port, "/data/plugin/histograms/tags")[run_name]
        images = _get(port, "/data/plugin/images/tags")[run_name]  # {tag: {"samples": ..., ...}}
        assert SCATTER_TAG in images, images
        # the matplotlib figure, as the images dashboard fetches it: the step's blob, then its bytes
        (entry,) = _get(port, "/data/plugin/images/images", run=run_name, tag=SCATTER_TAG)
        png = _get(port, "/data/plugin/images/individualImage?" + entry["query"])
        assert isinstance(png, bytes) and png[:8] == PNG_SIGNATURE, png[:40]
        image = imread(io.BytesIO(png), format="png")  # (height, width, channels), decoded
        assert image.shape[0] >= 300 and image.shape[1] >= 400 and image.shape[2] in (3, 4)
        assert image[..., :3].std() > 0.05  # drawn on, not a blank canvas
        scalars = _get(port, "/data/plugin/scalars/tags")[run_name]
        assert 0 < len([tag for tag in scalars if tag.startswith("metastore/")]) <= 5, scalars  # no chart per layer
        assert "metastore/gradient_norms" in images and "metastore/data_map" in images  # one picture of the layers
        assert _get(port, "/data/plugin/projector/runs"), "no projector embeddings"
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
