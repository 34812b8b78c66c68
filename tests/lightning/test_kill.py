"""A Lightning run killed with SIGKILL mid-epoch loses at most the last ``flush_seconds`` of captured steps.

kill_worker.py trains with MetaStoreCallback(flush_seconds=2) and logs each step after the callback
queued it; the test kills it 20-24 s after training started (seeded) and opens what it left
(tests/killcases.py). It runs in the ordinary suite: about 30 s.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lightning")

pytestmark = [pytest.mark.slow, pytest.mark.kill]  # a training run in a subprocess, killed with SIGKILL (about 30 s)

from killcases import check_store, run_and_kill  # noqa: E402


def test_sigkill_mid_epoch_loses_at_most_flush_seconds(tmp_path: Path) -> None:
    killed, logged = run_and_kill(Path(__file__).parent / "kill_worker.py", tmp_path, seed=0)
    figures = check_store(tmp_path / "store", killed, logged)
    print(f"lightning kill: {figures}")  # shown with -s: what was lost, and how long before the kill
