"""An exception (or SIGINT) inside ``trainer.fit()`` that ends the program leaves every step trained before it
in the store, and ``metastore inspect`` names how the run ended.

crash_worker.py trains 10 steps in a subprocess with the default ``flush_seconds`` (10 s, longer than the
run), then its training step raises at step 10, or waits there for the SIGINT the test sends. The reference is what the
model was fed (its log of rows) and this process reading the store (tests/crashcases.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lightning")

pytestmark = pytest.mark.slow  # a training run in a subprocess (about 10 s)

from crashcases import check_crashed_store, check_inspect, run_crash  # noqa: E402

from metastore_plugins.cli import main  # noqa: E402


@pytest.mark.parametrize("mode", ["exception", "sigint"])
def test_a_crash_inside_train_keeps_every_step_before_it(
    tmp_path: Path, mode: str, capsys: pytest.CaptureFixture[str]
) -> None:
    done = run_crash(Path(__file__).parent / "crash_worker.py", tmp_path, mode)
    assert done.returncode != 0
    assert ("ValueError: boom at step 10" if mode == "exception" else "KeyboardInterrupt") in done.stderr
    check_crashed_store(tmp_path / "store", tmp_path)
    assert main(["inspect", str(tmp_path / "store")]) == 0
    check_inspect(tmp_path / "store", mode, capsys.readouterr().out)
