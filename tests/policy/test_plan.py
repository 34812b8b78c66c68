"""The capture plan under a byte budget, and the policy that keeps a run within it.

Records come from a real capture of a small model; the bytes the plan expects are checked
against what the writer then puts on disk.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from metastore_plugins import CaptureSession, StoreWriter
from metastore_plugins.core.model.sample_ids import loader_batch_size
from metastore_plugins.core.ops.eigenbasis import basis_batch_bytes
from metastore_plugins.core.policy.budget import Budget, RunShape, default_budget, parse_budget
from metastore_plugins.core.policy.plan import make_plan
from metastore_plugins.core.policy.runtime import CapturePolicy

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
    rich = make_plan(records, SHAPE, budget=Budget("auto", 10**9), encoding="fp16")
    assert set(rich.train.values()) == {"exact"} and rich.snapshots == 2
    middle = make_plan(records, SHAPE, budget=Budget("auto", 2_000_000), encoding="fp16")
    assert middle.train["inp"] == "projected" and middle.k in (4, 8, 16)
    assert middle.train["head"] == "exact"  # one row of 64 + 3 values: smaller than any projection
    poor = make_plan(records, SHAPE, budget=Budget("auto", 200_000), encoding="fp16")
    assert set(poor.train.values()) <= {"norms", "nothing"} and poor.snapshots <= 2
    for plan in (rich, middle, poor):
        assert plan.planned["total"] <= 0.95 * plan.budget  # type: ignore[operator]
    exact = make_plan(records, SHAPE, budget=Budget("exact"), encoding="fp16")
    assert set(exact.train.values()) == set(exact.passes.values()) == {"exact"} and exact.snapshots == 0


def test_default_budget_is_snapshots_plus_20_kib_per_sample() -> None:
    files = 4 * 1024 + 2 * 2 * 1024  # the manifest, and per pass a tag line, a shard header and its index line
    assert 0.95 * default_budget(SHAPE) == pytest.approx(2 * 20_000 + 20 * 1024 * (100 * BATCH + 2 * 16) + files, abs=1)
    plan = make_plan(_records(), SHAPE, budget=Budget("auto"), encoding="fp16")
    assert plan.budget == default_budget(SHAPE) and "default" in plan.budget_source
    text = "\n".join(plan.lines())
    assert "policy 'auto'" in text and "training steps:" in text and "weight snapshots" in text
    # the default budget holds one snapshot per pass by construction: every pass takes one, so that the exact
    # refinement has the weights of each pass; large snapshots (MiniLM: 87 MiB each) make no difference
    for snapshot_bytes in (20_000, 90_000_000):
        shape = RunShape(100, BATCH, passes=3, pass_samples=16, snapshot_bytes=snapshot_bytes)
        assert make_plan(_records(), shape, budget=Budget("auto"), encoding="fp16").snapshots == shape.passes


def test_a_run_past_its_plan_degrades_and_stays_within_budget(tmp_path: Path) -> None:
    budget = 60_000
    policy = CapturePolicy(Budget("exact", budget), encoding="fp16")  # exact until the budget runs out
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
        CapturePolicy(Budget("cheap"))  # type: ignore[arg-type]


# -- small budgets (issue 28, items 5-7) ---------------------------------------------------------------------------


def _metadata_only_bytes(tmp_path: Path, batches: list[int]) -> int:
    """What a store of metadata alone takes on disk: batches of these sizes written with no records."""
    with StoreWriter(tmp_path, encoding="fp16", flush_seconds=None) as writer:
        start = 0
        for step, size in enumerate(batches):
            ids = torch.arange(start, start + size)
            y = torch.randint(0, CLASSES, (size,))
            writer.write(
                [], sample_ids=ids, step=step, labels=y, losses=torch.rand(size), predictions=y,
                margins=torch.randn(size), lr=0.1,
            )  # fmt: skip
            start += size
    return sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())


def _least(shape: RunShape) -> int:
    """The least budget the refusal of a 1-byte budget names."""
    with pytest.raises(ValueError, match="before any gradient") as caught:
        CapturePolicy(Budget("auto", 1)).expect(shape)
    return int(re.search(r"before any gradient: ([\d,]+) bytes", str(caught.value))[1].replace(",", ""))  # type: ignore[index]


def test_a_budget_below_the_metadata_alone_is_refused_with_the_figure(tmp_path: Path) -> None:
    shape = RunShape(train_batches=100, train_batch_size=BATCH, passes=2, pass_samples=16, snapshot_bytes=20_000)
    with pytest.raises(ValueError, match=r"X\(budget=10,000 bytes\) is below what this run needs"):
        CapturePolicy(Budget("auto", 10_000), owner="X").expect(shape)
    least = _least(shape)
    on_disk = _metadata_only_bytes(tmp_path, [BATCH] * (100 + 2 * 2))  # the training steps and two passes of 16
    assert on_disk <= 0.95 * least <= 1.5 * on_disk, (on_disk, least)  # an upper bound, not a wild one
    CapturePolicy(Budget("auto", least), owner="X").expect(shape)  # the figure it names is accepted


def test_a_pass_before_the_plan_knows_its_snapshot() -> None:
    """capture_train_steps=False: the plan is made during the first pass, after that pass asked for its snapshot."""
    shape = RunShape(train_batches=0, train_batch_size=BATCH, passes=2, pass_samples=16, snapshot_bytes=20_000)
    policy = CapturePolicy(Budget("auto", 400_000))
    policy.expect(shape)
    first = policy.should_snapshot()  # before any batch: no plan yet
    policy.apply(_records(), capture_point="epoch-0/train", step=0)
    assert policy.plan is not None and policy.plan.snapshots == 2  # the plan snapshots both passes ...
    assert first  # ... and the first pass took its snapshot


def test_the_last_pass_is_kept_when_the_run_outgrows_its_plan(tmp_path: Path) -> None:
    """The plan expects 4 training steps; 40 run. The earlier parts degrade, the last pass keeps its plan."""
    budget = 200_000
    policy = CapturePolicy(Budget("auto", budget), encoding="fp16")
    policy.expect(RunShape(train_batches=4, train_batch_size=BATCH, passes=2, pass_samples=2 * BATCH))
    kinds: dict[str, set[str]] = {}
    with StoreWriter(tmp_path, encoding="fp16") as writer, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = 0
        for epoch in range(2):
            for _ in range(20):
                kept = policy.apply(_records(step), capture_point="train", step=step)
                if kept is not None:
                    writer.write(kept, sample_ids=torch.arange(BATCH) + step * BATCH, step=step)
                step += 1
            policy.should_snapshot()
            for split in ("train", "val"):
                point = f"epoch-{epoch}/{split}"
                kept = policy.apply(_records(100 + epoch), capture_point=point, step=step)
                kinds[point] = set() if kept is None else {record.kind for record in kept}
                if kept is not None:
                    writer.write(kept, sample_ids=torch.arange(BATCH), step=step, capture_point=point)
    on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    assert on_disk <= budget, on_disk
    assert policy.plan is not None and policy.plan.degraded  # the training steps outgrew the plan
    planned = {{"exact": "outer"}.get(rep, rep) for rep in policy.plan.passes.values()}  # Linear layers: outer
    assert kinds["epoch-1/train"] == kinds["epoch-1/val"] == planned, kinds  # the last pass: both sides, as planned


def test_the_plan_says_small_budgets_in_words() -> None:
    shape = RunShape(train_batches=100, train_batch_size=BATCH, passes=2, pass_samples=16, snapshot_bytes=20_000)
    least = _least(shape)
    policy = CapturePolicy(Budget("auto", least))
    policy.expect(shape)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(200):  # twice the planned steps: the metadata runs out
            policy.apply(_records(step), capture_point="train", step=step)
    assert policy.plan is not None
    text = "\n".join(policy.plan.lines())
    assert f"budget {least / 1024:,.1f} KiB (given)" in text, text
    assert "training steps: metadata only" in text and "weight snapshots: none (the budget leaves no room" in text
    assert not re.search(r"-\d", text), text  # no negative bytes or counts
    assert [(c["from"], c["to"]) for c in policy.plan.degraded] == [("nothing", "not stored")], policy.plan.degraded
    assert "stopped at step" in text and "no longer stored, not even their metadata" in text
    said = [str(w.message) for w in caught if "outgrew" in str(w.message)]
    assert len(said) == 1 and "instead of" not in said[0] and "no longer stored" in said[0], said


def test_a_loader_with_a_batch_sampler_tells_its_batch_size() -> None:
    data = torch.utils.data.TensorDataset(torch.zeros(50, 2))
    sampler = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(data), batch_size=8, drop_last=False)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
    assert loader.batch_size is None and loader_batch_size(loader) == 8
    lists = [list(range(i, min(i + 10, 50))) for i in range(0, 50, 10)]  # a plain list of index lists
    assert loader_batch_size(torch.utils.data.DataLoader(data, batch_sampler=lists)) == 10
    unknown = make_plan(_records(), RunShape(100, 0, 2, 16), budget=Budget("auto", 10**7), encoding="fp16")
    told = make_plan(_records(), RunShape(100, BATCH, 2, 16), budget=Budget("auto", 10**7), encoding="fp16")
    assert unknown.planned["training steps"] == told.planned["training steps"] > 0


def test_a_pass_that_no_longer_fits_is_dropped_whole_and_said() -> None:
    """Training steps outgrow the plan up to the bytes kept for the last pass: the first pass, whose samples'
    metadata no longer fits, is dropped whole (no snapshot, no records: said, in the plan's lines); the last
    pass's snapshot, kept for it, is taken. (Before issue 43 the first pass took its snapshot's skip alone and
    lost its records part way.)"""
    shape = RunShape(train_batches=4, train_batch_size=BATCH, passes=2, pass_samples=BATCH, snapshot_bytes=20_000)
    policy = CapturePolicy(Budget("auto", 200_000))
    policy.expect(shape)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(60):
            policy.apply(_records(step), capture_point="train", step=step)
        assert policy.plan is not None and policy.plan.snapshots == 2
        first = policy.should_snapshot(60)
        dropped = policy.pass_dropped
        kept = policy.apply(_records(), capture_point="epoch-0/train", step=60)
        last = policy.should_snapshot(120)
        stored = policy.apply(_records(), capture_point="epoch-1/train", step=120)
    assert (first, dropped, kept, last) == (False, True, None, True)
    assert stored is not None  # the last pass keeps its samples
    assert [c["to"] for c in policy.plan.degraded if c["step"] == 60] == ["dropped"]
    text = "\n".join(policy.plan.lines())
    assert "dropped at step 60: the checkpoint pass at that step, whole" in text, text
    assert any("checkpoint pass at step 60 is not stored, not even its sample ids" in str(w.message) for w in caught)


@pytest.mark.parametrize("on_basis", [False, True])
def test_passes_on_the_eigenbasis_may_keep_a_larger_block_than_the_steps(tmp_path: Path, on_basis: bool) -> None:
    """Seeded step projections pair with passes only at one size; passes on the curvature eigenbasis never pair
    with them, so a budget that holds 16x16 passes beside 8x8 steps keeps them (and stays within the budget). Steps
    after the first pass go on its basis too: the plan counts their eigenvalues (half of the 100 steps here)."""
    budget = 560_000 + (50 * 2 * int(basis_batch_bytes(8)) if on_basis else 0)
    shape = RunShape(100, BATCH, passes=2, pass_samples=2 * BATCH, snapshot_bytes=20_000, passes_on_basis=on_basis)
    policy = CapturePolicy(Budget("auto", budget), encoding="fp16")
    policy.expect(shape)
    shapes: dict[str, tuple[int, ...]] = {}
    with StoreWriter(tmp_path, encoding="fp16") as writer:
        for step in range(100):
            kept = policy.apply(_records(step), capture_point="train", step=step)
            assert kept is not None
            writer.write(kept, sample_ids=torch.arange(BATCH) + step * BATCH, step=step)
            shapes["train"] = next(tuple(r.tensors["projected"].shape[1:]) for r in kept if r.layer == "inp")
        for epoch in range(2):
            assert policy.should_snapshot(100 + epoch) and policy.plan is not None
            policy.spend(shape.snapshot_bytes)
            for split in ("train", "val"):
                point, step = f"epoch-{epoch}/{split}", 100 + epoch
                kept = policy.apply(_records(200 + epoch), capture_point=point, step=step)
                assert kept is not None
                writer.write(kept, sample_ids=torch.arange(BATCH), step=step, capture_point=point)
                shapes["passes"] = next(tuple(r.tensors["projected"].shape[1:]) for r in kept if r.layer == "inp")
    on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    assert on_disk + 2 * shape.snapshot_bytes <= budget, on_disk
    assert policy.plan is not None and not policy.plan.degraded
    pass_k = 16 if on_basis else 8
    assert shapes == {"train": (8, 8), "passes": (pass_k, pass_k)}, shapes
    assert policy.pass_k() == policy.plan.passes_k == pass_k and policy.plan.k == 8
    text = "\n".join(policy.plan.lines())
    passes = next(line for line in text.splitlines() if "checkpoint passes:" in line)
    assert "training steps: projected 8x8" in text and f"projected {pass_k}x{pass_k}" in passes, text


def test_the_plan_counts_what_records_on_the_eigenbasis_carry() -> None:
    """A pass record on the eigenbasis holds its block's float32 eigenvalues besides the samples' numbers; the
    plan counts them, so the passes spend no more than it planned (a 4-layer BERT whose plan did not count them
    outgrew it in its last steps and lost its last pass)."""
    from metastore_plugins.core.ops.cost import BATCH_METADATA_BYTES, SAMPLE_METADATA_BYTES
    from metastore_plugins.core.ops.curvature import CurvatureSums
    from metastore_plugins.core.ops.eigenbasis import fit_bases, fittable

    shape = RunShape(100, BATCH, passes=2, pass_samples=6 * BATCH, snapshot_bytes=0, passes_on_basis=True)
    policy = CapturePolicy(Budget("auto", 600_000), encoding="fp16")
    policy.expect(shape)
    policy.apply(_records(0), capture_point="train", step=0)
    assert policy.plan is not None and "projected" in policy.plan.passes.values()
    sums = CurvatureSums(torch.float32)
    sums.add(fittable(_records(1)))
    policy.set_bases(fit_bases(sums, policy.pass_k(), 1), 1)
    spent = policy.spent
    for epoch in range(shape.passes):
        policy.should_snapshot(1 + epoch)
        for batch in range(6):
            kept = policy.apply(_records(2 + batch), capture_point=f"epoch-{epoch}/train", step=1 + epoch)
            assert kept is not None and any(r.basis is not None for r in kept)  # on the basis
    metadata = 12 * BATCH_METADATA_BYTES + 12 * BATCH * SAMPLE_METADATA_BYTES  # planned apart: the plan's "metadata"
    assert policy.spent - spent - metadata <= policy.plan.planned["checkpoint passes"], policy.spent - spent


def ranks_of(model: nn.Module, world: int = 2, **shape: int) -> list[RunShape]:
    """The shapes every rank of a ``world``-rank run of ``model`` tells its policy (as the callbacks make them)."""
    common = {"train_batches": 100, "train_batch_size": BATCH, "passes": 2, "pass_samples": 16, **shape}
    return [RunShape.of(model, rank=rank, **common) for rank in range(world)]


@pytest.mark.parametrize("budget", [2_000_000, 4_000_000, 8_000_000, None])
def test_every_rank_plans_the_same_records_though_rank_zero_alone_takes_snapshots(budget: int | None) -> None:
    """A query pairs one rank's test pass with another rank's training records, so the ranks' projections must have
    one size; rank 0's snapshots must not leave it a smaller one. The shapes are those of a model whose snapshot
    (1.6 MB: 400,400 parameters) is large beside the budget, the records those of a small one."""
    records = _records()
    shapes = ranks_of(nn.Linear(1000, 400))
    assert shapes[0].snapshot_bytes == shapes[1].snapshot_bytes > 0  # the snapshot's size is every rank's to know
    plans = [make_plan(records, shape, budget=Budget("auto", budget), encoding="fp16") for shape in shapes]
    assert plans[0].k == plans[1].k and plans[0].pass_k == plans[1].pass_k
    assert plans[0].train == plans[1].train and plans[0].passes == plans[1].passes
    assert (plans[0].snapshots != 0) == (budget != 2_000_000)  # 1.6 MB fits beside the rest from 4 MB up
    assert plans[1].snapshots == 0 and plans[1].planned["snapshots"] == 0  # rank 0 alone takes and counts them
    for shape, plan in zip(shapes, plans):
        policy = CapturePolicy(Budget("auto", budget))
        policy.expect(shape)
        policy.plan = plan
        taken = sum(policy.should_snapshot(step=pass_step) for pass_step in (1, 2))  # the two planned passes
        assert taken == (plan.snapshots if shape is shapes[0] else 0)
