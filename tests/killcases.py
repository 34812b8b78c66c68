"""Kill a training subprocess with SIGKILL and check what it left in its store (tests/lightning, tests/hf).

A worker script ``WORKER OUT FLUSH_SECONDS`` trains with a callback's ``flush_seconds=FLUSH_SECONDS``
and appends ``start {time}`` to ``OUT/steps.log`` when training starts, then ``{step} {time}`` after
each step, once the callback has queued it. :func:`run_and_kill` kills it 20-24 s (seeded) after the
start, mid-epoch; :func:`check_store` checks the promise of docs/store.md ("Durability").
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from metastore_plugins import open_store

FLUSH_SECONDS = 2.0


def _logged(log: Path) -> tuple[float | None, list[tuple[int, float]]]:
    """The start time of training and the ``(step, time)`` lines written so far (a torn last line is skipped)."""
    start, steps = None, []
    for line in log.read_text().split("\n")[:-1] if log.exists() else []:  # only lines that end in a newline
        fields = line.split()
        if fields[0] == "start":
            start = float(fields[1])
        else:
            steps.append((int(fields[0]), float(fields[1])))
    return start, steps


def run_and_kill(worker: Path, out: Path, seed: int) -> tuple[float, list[tuple[int, float]]]:
    """Start ``worker OUT FLUSH_SECONDS``, SIGKILL it 20-24 s (seeded) after it logged ``start``; return the kill
    time and its logged steps."""
    log = out / "steps.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(worker), str(out), str(FLUSH_SECONDS)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        deadline = time.monotonic() + 300  # imports and data: seconds, generous for a loaded machine
        while (started := _logged(log)[0]) is None:
            assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.05)
        kill_at = started + random.Random(seed).uniform(20.0, 24.0)
        time.sleep(max(0.0, kill_at - time.time()))
        assert proc.poll() is None, "training ended before the kill; make the epoch longer"
        killed = time.time()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()
    return killed, _logged(log)[1]


def check_store(store_dir: Path, killed: float, logged: list[tuple[int, float]]) -> dict[str, float]:
    """Every step logged more than FLUSH_SECONDS before the kill is stored, and the listed shards are sound.

    Returns the figures: steps logged and stored, steps lost, and how long before the kill the last
    stored step was logged.
    """
    store = open_store(store_dir)
    stored = set(store.steps("train"))
    steps = {step for step, _ in logged}
    assert stored <= steps | {max(steps) + 1}  # the last step may be stored before its line is logged
    old = {step for step, at in logged if at < killed - FLUSH_SECONDS}
    assert old, "no step was logged long enough before the kill"
    assert old <= stored, f"{len(old - stored)} steps logged > {FLUSH_SECONDS} s before the kill are missing"
    listed = {ref.file.name for ref in store.batch_refs()}
    # the shard in flight may be left as a temporary or an unlisted file: reported, and ignored by readers
    leftovers = [p for p in store.verify() if p.split(":")[0] not in listed and ("not listed" in p or "temporary" in p)]
    assert [p for p in store.verify() if p not in leftovers] == []
    assert len(leftovers) <= 2
    last = max(stored)
    at = dict(logged)
    return {
        "logged_steps": len(logged),
        "stored_steps": len(stored),
        "lost_steps": len(steps - stored),
        "last_stored_before_kill_s": killed - at[last],
        "shards": len(listed),
    }
