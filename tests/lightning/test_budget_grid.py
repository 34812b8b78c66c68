"""Small budgets on a real Lightning MLP: the store keeps to its budget, the reports use what was stored,
and every line of the plan is true (issue 28, items 4-6).

Each budget of the grid runs ``Trainer.fit`` (3 epochs, a checkpoint pass after each) and is checked
against references the store's own accounting does not give: the directory's size is the sum of
``st_size`` of every file under it (apparent bytes: allocated blocks round each file up to the
filesystem's block and differ between filesystems), the record kinds come from the shards, the
snapshots from the files in ``snapshots/``, and the reports from their files read back.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

pytest.importorskip("lightning")
from lightning_cases import fit  # noqa: E402
from netcases import NetModule  # noqa: E402

from metastore_plugins import IndexedDataset, MetaStoreCallback, open_store  # noqa: E402
from metastore_plugins.cli import main as cli_main  # noqa: E402
from metastore_plugins.core.policy.plan_record import CapturePlan  # noqa: E402

D_IN, HIDDEN, N_TRAIN, N_VAL, BATCH, EPOCHS = 64, 256, 160, 48, 16, 3
BUDGETS = {"50KB": 50_000, "300KB": 300_000, "1MB": 1_000_000, "6MB": 6_000_000}

pytestmark = pytest.mark.filterwarnings("ignore:the report figure.* leaves no room for them")  # small budgets: said


class MLP(NetModule):
    def __init__(self) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 2))
        super().__init__(net, lr=0.05)


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g)
    y = (x[:, 0] + 0.5 * torch.randn(n, generator=g) > 0).long()  # noisy labels: some samples are hard
    return TensorDataset(x, y)


def _run(root: Path, budget: str, batch_sampler: bool = False, **settings: Any) -> Path:
    store = root / "store"
    settings.setdefault("attribution_time", None)  # passes of the sizes set: what the budget does to them
    callback = MetaStoreCallback(store, budget=budget, **settings)
    dataset, generator = IndexedDataset(_data(N_TRAIN, 1)), torch.Generator().manual_seed(3)
    if batch_sampler:  # DataLoader(batch_sampler=...): loader.batch_size is None
        sampler = BatchSampler(RandomSampler(dataset, generator=generator), BATCH, drop_last=False)
        train = DataLoader(dataset, batch_sampler=sampler)
    else:
        train = DataLoader(dataset, batch_size=BATCH, shuffle=True, generator=generator)
    val = DataLoader(IndexedDataset(_data(N_VAL, 2)), batch_size=BATCH)
    fit(root, MLP(), train, val, [callback], max_epochs=EPOCHS)
    return store


def _apparent_bytes(directory: Path) -> int:
    """``du --apparent-size -b``: the sum of ``st_size`` of every file under ``directory``."""
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def _kinds(store: Any, capture_point: str) -> set[str]:
    """Record kinds read from the shards (the batches' records as stored)."""
    return {record.kind for batch in store.select(capture_point).batches() for record in batch.records}


def _check_part(line: str, kinds: set[str], k: int) -> None:
    """A plan line on training steps or passes against the record kinds the shards hold."""
    if "metadata only" in line:
        assert kinds == set(), (line, kinds)
    elif "norms" in line:
        assert kinds == {"norms"}, (line, kinds)
    elif f"projected {k}x{k}" in line:
        assert "projected" in kinds and kinds <= {"projected", "outer", "dense"}, (line, kinds)
    elif "exact" in line:
        assert kinds and kinds <= {"outer", "dense"}, (line, kinds)
    else:
        raise AssertionError(f"unexpected plan line {line!r}")


def _check_plan(store_dir: Path, budget: int) -> dict[str, Any]:
    """Every line of the plan, against the store's files; returns the plan's figures."""
    store = open_store(store_dir)
    plan = CapturePlan.from_json(store.config["capture_plan"])
    lines = plan.lines()
    text = "\n".join(lines)
    assert not re.search(r"-\d", text), text  # no negative bytes or counts
    assert (
        f"budget {budget / 1024:,.1f} KiB (given)" in lines[0]
        or f"budget {budget / 2**20:,.1f} MiB (given)" in lines[0]
    )
    assert "instead of" not in text and "from nothing to nothing" not in text, text
    assert not plan.degraded, text  # the grid's runs keep to their plans
    steps = next(line for line in lines if line.startswith("  training steps:"))
    _check_part(steps, _kinds(store, "train"), plan.k)
    passes = next(line for line in lines if line.startswith("  checkpoint passes:"))
    for epoch in range(EPOCHS):
        for split in ("train", "val"):
            _check_part(passes, _kinds(store, f"epoch-{epoch}/{split}"), plan.k)
    snapshot_line = next(line for line in lines if line.startswith("  weight snapshots:"))
    folder = store_dir / "snapshots"
    files = sorted(p.name for p in folder.glob("*.safetensors")) if folder.exists() else []
    if "none" in snapshot_line:
        assert files == [], (snapshot_line, files)
    else:
        taken = 1 if "at the last of" in snapshot_line else int(re.search(r"the last (\d+) of", snapshot_line)[1])  # type: ignore[index]
        assert files == [f"epoch-{e}-rank0.safetensors" for e in range(EPOCHS - taken, EPOCHS)], (snapshot_line, files)
    planned = re.findall(
        r"(\w[\w ]*?) ([\d,.]+) (bytes|KiB|MiB)", next(line for line in lines if "planned bytes" in line)
    )
    assert planned and planned[-1][0].endswith("total")
    return {"lines": lines, "training steps": steps, "checkpoint passes": passes, "snapshots": snapshot_line}


@pytest.fixture(scope="module")
def grid(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The store of each budget the run accepts (``"50KB"`` is refused: its test runs it)."""
    return {name: _run(tmp_path_factory.mktemp(name), name) for name in BUDGETS if name != "50KB"}


def test_a_budget_below_the_metadata_is_refused_at_the_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"budget=50,000 bytes\) is below what this run needs before any gr") as caught:
        _run(tmp_path, "50KB")
    least = int(re.search(r"needs before any gradient: ([\d,]+) bytes", str(caught.value))[1].replace(",", ""))  # type: ignore[index]
    assert 50_000 < least < 1_000_000 and f"budget={least:,} or more" in str(caught.value)
    store_dir = tmp_path / "store"  # nothing captured: no shard, and what is there (empty index files) is tiny
    assert not list(store_dir.glob("**/*.safetensors")) and _apparent_bytes(store_dir) <= 50_000


def test_the_budget_grid_keeps_to_its_budget_and_reports_on_what_was_stored(grid: dict[str, Path]) -> None:
    figures = {}
    for name, store_dir in grid.items():
        budget = BUDGETS[name]
        on_disk = _apparent_bytes(store_dir)
        assert on_disk <= budget, (name, on_disk)
        plan = _check_plan(store_dir, budget)
        reports = store_dir / "reports"
        outliers = json.loads((reports / "outliers.json").read_text())
        assert len(outliers) == 20 and all(row["aum"] is not None for row in outliers), name  # AUM: metadata alone
        caption = (reports / "outliers.md").read_text()
        influence = reports / "influence.json"
        if "metadata only" in plan["checkpoint passes"]:
            assert all(row["self_influence"] is None for row in outliers), name
        else:
            assert all(row["self_influence"] is not None for row in outliers if row["pass_loss"] is not None), name
        if "metadata only" in plan["checkpoint passes"] or "norms" in plan["checkpoint passes"]:
            assert "Budget: the budget of" in caption and "No influence report" in caption, caption
            assert not influence.exists()
        else:
            assert all(row["self_influence"] is not None for row in outliers if row["pass_loss"] is not None), name
            rows = json.loads(influence.read_text())
            assert rows and all(len(row["proponents"]) == 5 for row in rows), name
        figures[name] = (on_disk, plan["training steps"].strip(), plan["checkpoint passes"].strip(), plan["snapshots"])
    assert "norms" in figures["300KB"][1] and "projected" in figures["1MB"][1] and "exact" in figures["6MB"][1]
    for name, row in figures.items():
        print(name, *row, sep=" | ")  # the figures docs/policies.md reports (pytest -s)


def test_the_cli_reports_what_the_budget_dropped(grid: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    store_dir = grid["300KB"]
    capsys.readouterr()
    assert cli_main(["outliers", str(store_dir), "-k", "3"]) == 0
    out = capsys.readouterr().out
    assert "ranked by lowest AUM" in out and "Budget: the budget of 300,000 bytes kept the checkpoint passes" in out
    assert cli_main(["influence", str(store_dir)]) != 0
    err = capsys.readouterr().err
    assert "kept the checkpoint passes as exact norms only" in err and "evaluation runs" not in err, err


def test_a_batch_sampler_loader_plans_its_training_steps(grid: dict[str, Path], tmp_path: Path) -> None:
    """``DataLoader(batch_sampler=...)``: the plan counts the training steps as a ``batch_size=`` loader does."""
    store_dir = _run(tmp_path, "1MB", batch_sampler=True)
    planned = open_store(store_dir).config["capture_plan"]["planned"]
    reference = open_store(grid["1MB"]).config["capture_plan"]["planned"]  # the same run with batch_size=16
    assert planned["training steps"] == reference["training steps"] > 0
    assert _apparent_bytes(store_dir) <= BUDGETS["1MB"]


def test_without_training_steps_the_first_pass_takes_its_snapshot(tmp_path: Path) -> None:
    """capture_train_steps=False: the plan is made during the first pass; its snapshot is still taken, so the
    report refines the projected influence exactly at every pass."""
    store_dir = _run(tmp_path, "700KB", capture_train_steps=False)
    plan = open_store(store_dir).config["capture_plan"]
    assert set(plan["passes"].values()) == {"projected"} and plan["snapshots"] == EPOCHS
    names = sorted(p.name for p in (store_dir / "snapshots").glob("*.safetensors"))
    assert names == [f"epoch-{e}-rank0.safetensors" for e in range(EPOCHS)]
    rows = json.loads((store_dir / "reports" / "influence.json").read_text())
    assert rows and all(row["exact"] for row in rows)
    assert _apparent_bytes(store_dir) <= 700_000
