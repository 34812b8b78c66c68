"""A training subprocess that crashes at a known step, and what its store must say (tests/lightning, tests/hf).

A worker script ``WORKER OUT MODE`` trains a tiny MLP on :data:`SAMPLES` samples whose items carry their row
number (``row``, a column the callbacks do not read) and appends each training forward's rows to
``OUT/seen.log``, one line per step. At step :data:`CRASH` (the 11th forward) it raises ``ValueError``
(``MODE=exception``), or writes ``waiting`` there and sleeps until :func:`run_crash` sends it SIGINT
(``MODE=sigint``). The exception reaches the top of the script, so the interpreter exits on it. The reference
is what the model was fed (``seen.log``: the rows the sampler drew), read back here in the test's process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

from metastore_plugins import open_store

SAMPLES, BATCH, CRASH = 64, 4, 10  # 16 steps an epoch: the crash comes mid-epoch, before any epoch end or pass


def item(row: int) -> dict[str, Tensor]:
    """Sample ``row``: 12 features and a label drawn from a generator seeded by the row, and the row itself."""
    g = torch.Generator().manual_seed(row)
    return {"x": torch.randn(12, generator=g), "labels": torch.randint(0, 4, (), generator=g), "row": torch.tensor(row)}


def seen(out: Path, rows: Tensor) -> int:
    """Append a training forward's ``rows`` to ``OUT/seen.log``; the number of forwards logged before it."""
    log = out / "seen.log"
    before = len(log.read_text().splitlines()) if log.exists() else 0
    with log.open("a") as file:
        file.write(" ".join(str(int(r)) for r in rows.tolist()) + "\n")
    return before


def crash(out: Path, mode: str, step: int) -> None:
    """At step :data:`CRASH`, raise (``exception``) or wait for SIGINT (``sigint``)."""
    if step != CRASH:
        return
    if mode == "exception":
        raise ValueError(f"boom at step {step}")
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:  # started in the background of a shell: SIGINT inherited
        signal.signal(signal.SIGINT, signal.default_int_handler)  # ignored; a terminal's Ctrl-C is what is tested
    (out / "waiting").write_text(str(os.getpid()))
    while True:
        time.sleep(0.05)


def run_crash(worker: Path, out: Path, mode: str) -> subprocess.CompletedProcess[str]:
    """Run ``worker OUT MODE`` to its end (sending SIGINT once it waits, in ``sigint`` mode); its result."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(
        [sys.executable, str(worker), str(out), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    if mode == "sigint":
        deadline = time.monotonic() + 300  # imports and start: seconds, generous for a loaded machine
        while not (out / "waiting").exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "training did not reach the step to interrupt"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def check_crashed_store(store_dir: Path, out: Path) -> None:
    """The store holds every training step before the crash, each with the rows the model was fed at it."""
    fed = [[int(r) for r in line.split()] for line in (out / "seen.log").read_text().splitlines()]
    assert len(fed) == CRASH + 1  # the crashing step's forward ran too, and was never trained on
    store = open_store(store_dir)
    assert store.steps("train") == list(range(CRASH))
    for step in range(CRASH):
        assert store.sample_ids("train", steps=step).tolist() == fed[step], step
    assert store.verify() == []


#: What ``metastore inspect`` says of the run each mode ended.
RUN_LINES = {
    "exception": f"run        ended by an exception (ValueError: boom at step {CRASH}); last step stored: {CRASH - 1}",
    "sigint": f"run        interrupted (KeyboardInterrupt); last step stored: {CRASH - 1}",
}


def check_inspect(store_dir: Path, mode: str, text: str) -> None:
    """``text``, what ``metastore inspect`` printed, names how the run ended, the steps stored and the plan."""
    lines = text.splitlines()
    assert f"samples    {CRASH * BATCH} stored over {CRASH} steps" in lines
    assert RUN_LINES[mode] in lines
    assert any(line.startswith("capture plan: policy ") for line in lines), text  # recorded when training started
    assert lines[-1] == "problems: none"
