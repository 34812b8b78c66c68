"""docs/screenshots.py: skips cleanly without Chromium, and with it shoots a real tensorboard's tabs."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docs" / "screenshots.py"


def run_script(*args: str, chromium: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **({"CHROMIUM": chromium} if chromium is not None else {})}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT
    )


def test_without_chromium_it_says_how_to_install_it_and_does_nothing(tmp_path: Path) -> None:
    done = run_script(str(tmp_path / "no-logdir"), "--out", str(tmp_path / "out"), chromium="no-such-chromium")
    assert done.returncode == 0, done.stderr
    assert "skipped" in done.stdout and "apt-get install -y chromium" in done.stdout
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (apt-get install -y chromium)")
def test_with_chromium_the_text_tab_is_shot_from_a_running_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    image = pytest.importorskip("PIL.Image")
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path / "tb")) as writer:
        writer.add_text("metastore/influence", "| test id | text |\n|---|---|\n| 3 | a sample's text |", 0)
    done = run_script(str(tmp_path / "tb"), "--out", str(tmp_path / "out"), "--name", "t", "--tabs", "text")
    assert done.returncode == 0, done.stderr
    shot = tmp_path / "out" / "t-text.png"
    assert str(shot) in done.stdout and 0 < shot.stat().st_size < 400_000
    with image.open(io.BytesIO(shot.read_bytes())) as picture:
        assert picture.size == (1800, 1600) and picture.mode == "P"  # the palette PNG the docs keep
        colours = picture.convert("RGB").getcolors(maxcolors=1 << 16)
    assert colours is not None and len(colours) > 10  # a page was drawn, not a blank canvas
