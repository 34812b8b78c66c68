"""The capture plan under a byte budget, and the policy that keeps a run within it.

Records come from a real capture of a small model; the bytes the plan expects are checked
against what the writer then puts on disk.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from metastore_plugins import CaptureSession, StoreWriter
from metastore_plugins.core.policy.plan import RunShape, default_budget, make_plan
from metastore_plugins.core.policy.runtime import CapturePolicy, parse_budget

D_IN, HIDDEN, CLASSES, BATCH, TOKENS = 48, 64, 3, 8, 12


class Tokens(nn.Module):
    """A Linear over token sequences (T rows per sample: exact factors cost more than a projection), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.inp(x)).mean(1))


def _records(seed: int = 0) -> list:
    torch.manual_seed(seed)
    model = Tokens()
    x, y = torch.randn(BATCH, TOKENS, D_IN), torch.randint(0, CLASSES, (BATCH,))
    with CaptureSession(model) as session:
        F.cross_entropy(model(x), y).backward()
    return session.factors()


SHAPE = RunShape(train_batches=100, train_batch_size=BATCH, passes=2, pass_samples=16, snapshot_bytes=20_000)


def test_rungs_follow_the_budget() -> None:
    records = _records()
    rich = make_plan(records, SHAPE, policy="auto", budget=10**9, encoding="fp16")
    assert set(rich.train.values()) == {"exact"} and rich.snapshots == 2
    middle = make_plan(records, SHAPE, policy="auto", budget=2_000_000, encoding="fp16")
    assert middle.train["inp"] == "projected" and middle.k in (4, 8, 16)
    assert middle.train["head"] == "exact"  # one row of 64 + 3 values: smaller than any projection
    poor = make_plan(records, SHAPE, policy="auto", budget=200_000, encoding="fp16")
    assert set(poor.train.values()) <= {"norms", "nothing"} and poor.snapshots <= 2
    for plan in (rich, middle, poor):
        assert plan.planned["total"] <= 0.95 * plan.budget  # type: ignore[operator]
    exact = make_plan(records, SHAPE, policy="exact", budget=None, encoding="fp16")
    assert set(exact.train.values()) == set(exact.passes.values()) == {"exact"} and exact.snapshots == 0


def test_default_budget_is_snapshots_plus_20_kib_per_sample() -> None:
    files = 4 * 1024 + 2 * 2 * 1024  # the manifest, and per pass a tag line, a shard header and its index line
    assert 0.95 * default_budget(SHAPE) == pytest.approx(2 * 20_000 + 20 * 1024 * (100 * BATCH + 2 * 16) + files, abs=1)
    plan = make_plan(_records(), SHAPE, policy="auto", budget=None, encoding="fp16")
    assert plan.budget == default_budget(SHAPE) and "default" in plan.budget_source
    text = "\n".join(plan.lines())
    assert "policy 'auto'" in text and "training steps:" in text and "weight snapshots" in text


def test_a_run_past_its_plan_degrades_and_stays_within_budget(tmp_path: Path) -> None:
    budget = 60_000
    policy = CapturePolicy("exact", budget, encoding="fp16")  # exact until the budget runs out
    policy.expect(RunShape(train_batches=4, train_batch_size=BATCH))
    with StoreWriter(tmp_path, encoding="fp16") as writer, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(40):
            kept = policy.apply(_records(step), capture_point="train", step=step)
            if kept is not None:
                writer.write(kept, sample_ids=torch.arange(BATCH) + step * BATCH, step=step)
    on_disk = sum(f.stat().st_size for f in tmp_path.iterdir() if f.is_file())
    assert on_disk <= budget, on_disk
    assert policy.plan is not None and policy.plan.degraded  # recorded
    outgrew = [w for w in caught if "outgrew its capture plan" in str(w.message)]
    assert 1 <= len(outgrew) <= len(policy.plan.degraded)  # said once per change
    assert [d["to"] for d in policy.plan.degraded][-3:] == ["norms", "nothing", "not stored"]


@pytest.mark.parametrize(
    ("text", "expected"), [("250MB", 250 * 10**6), ("4 GiB", 4 * 2**30), (1024, 1024), ("1.5kb", 1500)]
)
def test_budget_strings(text: object, expected: int) -> None:
    assert parse_budget(text, "X") == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["lots", "-1MB", 0, True, "12 parsecs"])
def test_bad_budgets_name_the_setting(bad: object) -> None:
    with pytest.raises(ValueError, match=r"X\(budget=\.\.\.\) must be a positive number of bytes"):
        parse_budget(bad, "X")  # type: ignore[arg-type]


def test_unknown_policy_is_named() -> None:
    with pytest.raises(ValueError, match=r"policy=\.\.\.\) must be one of auto, exact"):
        CapturePolicy("cheap")  # type: ignore[arg-type]
