"""Store scans show a tqdm bar on an interactive stderr only: silent in tests, when redirected, and without tqdm."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch

from metastore_plugins import CaptureSession, StoreWriter
from metastore_plugins.cli import main
from metastore_plugins.core import progress as progress_module
from metastore_plugins.core.progress import MIN_BATCHES, progress


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_silent_when_stderr_is_not_a_terminal(capfd: pytest.CaptureFixture[str]) -> None:
    assert not sys.stderr.isatty()  # pytest captures stderr, as a pipe does
    items = list(range(MIN_BATCHES + 5))
    assert list(progress(iter(items), len(items), "reading store")) == items
    assert capfd.readouterr().err == ""
    stream = io.StringIO()  # an explicit stream that is not a terminal
    assert list(progress(iter(items), len(items), "reading store", file=stream)) == items
    assert stream.getvalue() == ""


def test_a_bar_is_drawn_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tqdm")
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)  # looked up at each call, not at import
    items = list(range(MIN_BATCHES))
    assert list(progress(iter(items), len(items), "reading store")) == items
    drawn = terminal.getvalue()
    assert "reading store" in drawn and f"/{MIN_BATCHES}" in drawn and "batch" in drawn
    last = [part for part in drawn.split("\r") if part][-1]
    assert last.strip() == ""  # leave=False: the bar is cleared at the end


def test_short_scans_stay_silent_and_an_abandoned_scan_clears_its_bar() -> None:
    pytest.importorskip("tqdm")
    terminal = FakeTerminal()
    assert list(progress(iter(range(3)), MIN_BATCHES - 1, "reading store", file=terminal)) == [0, 1, 2]
    assert terminal.getvalue() == ""
    scan = progress(iter(range(MIN_BATCHES)), MIN_BATCHES, "reading store", file=terminal)
    assert next(scan) == 0 and "reading store" in terminal.getvalue()
    scan.close()  # a consumer that stops early (an error, a break)
    assert [part for part in terminal.getvalue().split("\r") if part][-1].strip() == ""


def test_without_tqdm_scans_run_without_a_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    terminal = FakeTerminal()
    items = list(range(MIN_BATCHES))
    assert list(progress(iter(items), len(items), "reading store", file=terminal)) == items
    assert terminal.getvalue() == ""


def test_metastore_commands_draw_the_bar_only_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pytest.importorskip("tqdm")
    model = torch.nn.Linear(3, 2)
    with StoreWriter(tmp_path / "store", encoding="fp32") as writer:
        for step in range(3):
            with CaptureSession(model, loss_reduction="mean") as session:
                torch.nn.functional.cross_entropy(model(torch.randn(4, 3)), torch.tensor([0, 1, 0, 1])).backward()
            writer.write(session.factors(), sample_ids=torch.arange(4) + 4 * step, step=step)
    monkeypatch.setattr(progress_module, "MIN_BATCHES", 1)  # a bar for this three-batch store
    assert main(["similar", str(tmp_path / "store"), "--sample", "1", "--capture-point", "train"]) == 0
    piped = capsys.readouterr()
    assert piped.out and piped.err == ""
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["similar", str(tmp_path / "store"), "--sample", "1", "--capture-point", "train"]) == 0
    assert "reading store" in terminal.getvalue() and "reading store" not in capsys.readouterr().out
