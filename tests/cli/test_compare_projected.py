"""``metastore query compare`` on a store that keeps a layer projected: its ``update_cosine`` is blank, one note says
why and what to do, never ``nan`` (issue 43, item 5); a layer stored exactly still gets its cosine.

The store is written by the test: layer ``inp`` as the capture policy keeps it under a small budget (projected),
``head`` as exact factors; which is which comes from the records written, not from the code under test.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from metastore_plugins import CaptureSession, StoreWriter
from metastore_plugins.core.policy.budget import Budget, RunShape
from metastore_plugins.core.policy.runtime import CapturePolicy
from metastore_plugins.core.records import EXACT_KINDS, BatchMeta

BATCH, TOKENS, D_IN, HIDDEN, CLASSES, STEPS = 4, 6, 40, 48, 3, 4


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.inp(x)).mean(1))


def _write_store(directory: Path) -> dict[str, set[str]]:
    """Four training steps; the kinds of records written per layer."""
    model = Tokens()
    policy = CapturePolicy(Budget("auto", 20_000), encoding="fp32")
    policy.expect(RunShape(train_batches=STEPS, train_batch_size=BATCH))
    kinds: dict[str, set[str]] = {"inp": set(), "head": set()}
    with StoreWriter(directory, encoding="fp32") as writer:
        for step in range(STEPS):
            x, y = torch.randn(BATCH, TOKENS, D_IN), torch.randint(0, CLASSES, (BATCH,))
            with CaptureSession(model) as session:
                losses = F.cross_entropy(model(x), y, reduction="none")  # (B,)
                losses.mean().backward()
            exact = [r for r in session.factors() if r.layer == "head"]
            kept = [r for r in policy.apply(session.factors(), capture_point="train", step=step) if r.layer == "inp"]
            model.zero_grad()
            for record in kept + exact:
                kinds[record.layer].add(record.kind)
            ids = torch.arange(BATCH) + step * BATCH
            meta = BatchMeta(ids, step, labels=y, losses=losses.detach(), lr=0.1)
            writer.write(kept + exact, meta)
    return kinds


def test_compare_leaves_the_cosine_of_a_projected_layer_blank_with_one_note(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the policy's plan lines
        kinds = _write_store(tmp_path / "store")
    assert kinds["inp"] and not kinds["inp"] <= set(EXACT_KINDS) and kinds["head"] <= set(EXACT_KINDS)
    store = str(tmp_path / "store")

    def compare(*extra: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "metastore_plugins.cli", "query", store, "compare", "--other", store, *extra]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120)

    data = json.loads(compare("--json").stdout)
    rows = {row["layer"]: row for row in data["layers"]}
    assert rows["inp"]["update_cosine"] is None
    assert abs(rows["head"]["update_cosine"] - 1.0) <= 1e-9  # a run against itself
    assert len(data["notes"]) == 1 and "inp" in data["notes"][0] and "head" not in data["notes"][0]
    done = compare()
    assert done.returncode == 0, done.stderr
    assert "nan" not in done.stdout.lower()
    inp_line = next(line for line in done.stdout.splitlines() if line.startswith("| inp |"))
    assert inp_line.rstrip().endswith("|  |")  # the blank cell
    notes = [line for line in done.stdout.splitlines() if line.startswith("update_cosine is blank")]
    assert len(notes) == 1 and "policy='exact'" in notes[0] and "inp" in notes[0]
