"""The repository's example scripts run as a user runs them: a fresh process, output silenced, and the
``result.json`` each writes into its ``--out`` directory read back (training seconds, phases, memory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .publish import REPO


def run_example(script: str | Path, out: str | Path, extra: list[str]) -> dict[str, Any]:
    """Run ``script`` (relative to the repository) with ``--out out`` and ``extra``; its ``result.json``."""
    subprocess.run(
        [sys.executable, str(REPO / script), "--out", str(out), *extra],
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    return json.loads((Path(out) / "result.json").read_text())
