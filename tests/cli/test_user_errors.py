"""Bad input and unreadable files give one clear error (issue: a callback that observes and never disturbs).

Permission problems are made with monkeypatch, not chmod: the suite runs as root in CI, and
root reads files whatever their mode.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from metastore_plugins import MetaStoreCallback, MetaStoreTrainerCallback, StoreWriter, open_store
from metastore_plugins.cli import main
from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.training.passes import capture_step, checkpoint_pass


def per_sample_ce(outputs: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(outputs, labels, reduction="none")


def write_run(store_dir: Path, seed: int) -> Path:
    """Two epochs of a small MLP: training steps and checkpoint passes epoch-{e}/train and /val."""
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(24, 5, generator=generator), torch.randint(0, 3, (24,), generator=generator)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with StoreWriter(store_dir) as writer:
        step = 0
        for epoch in range(2):
            for lo in range(0, 16, 8):
                ids = torch.arange(lo, lo + 8)
                capture_step(
                    model, lambda ids=ids: model(x[ids]), y[ids], ids, per_sample_ce, writer, step=step, lr=0.1
                )
                optimizer.step()
                optimizer.zero_grad()
                step += 1
            for split, ids in (("train", torch.arange(16)), ("val", torch.arange(16, 24))):
                batches = [(ids, lambda ids=ids: model(x[ids]), y[ids])]
                checkpoint_pass(
                    model, batches, per_sample_ce, writer, capture_point=f"epoch-{epoch}/{split}", step=step, lr=0.1
                )
    return store_dir


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Lightning-style log directory: the store in ``version_0/metastore`` as the callback writes it."""
    root = tmp_path_factory.mktemp("logs")
    write_run(root / "version_0" / "metastore", seed=0)
    return root / "version_0"


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:
        status = main(list(args))
    except SystemExit as exc:  # argparse's own errors
        status = int(exc.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


# -- where the store is ------------------------------------------------------------------------


def test_a_log_or_output_directory_opens_its_store(log_dir: Path) -> None:
    assert open_store(log_dir).path == log_dir / "metastore"


def test_a_directory_above_the_store_names_the_stores_below_it(log_dir: Path) -> None:
    with pytest.raises(StoreError, match=r"stores below it: .*version_0/metastore"):
        open_store(log_dir.parent)


def test_report_writes_where_the_callbacks_write(log_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli(capsys, "report", str(log_dir))
    assert status == 0, err
    reports = log_dir / "metastore" / "reports"
    assert (reports / "outliers.json").is_file() and (reports / "loss_vs_self_influence.png").is_file()
    assert str(reports / "outliers.json") in out


# -- unreadable directories and shards ---------------------------------------------------------------


def test_an_unreadable_directory_is_a_store_error(
    log_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    store_dir = log_dir / "metastore"
    real_iterdir = Path.iterdir

    def iterdir(self: Path) -> Any:
        if self == store_dir:
            raise PermissionError(13, "Permission denied", str(self))
        return real_iterdir(self)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    with pytest.raises(StoreError, match="cannot read the directory .*Permission denied"):
        open_store(store_dir)
    status, out, err = run_cli(capsys, "inspect", str(store_dir))
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and "Permission denied" in err and "Traceback" not in err


def test_an_unreadable_shard_is_listed_by_verify_and_refused_by_queries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    store_dir = write_run(tmp_path / "store", seed=1)
    victim = sorted(store_dir.glob("*.safetensors"))[0]
    real_open = os.open

    def guarded_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        # as for a file of another user (the tests may run as root); the store opens its files by name
        # relative to the directory it holds open (dir_fd=)
        named = Path(file) if kwargs.get("dir_fd") is None else store_dir / file
        if named == victim:
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(os, "open", guarded_open)
    problems = open_store(store_dir).verify()
    assert len(problems) == 1 and problems[0].startswith(f"{victim.name}: cannot be read")
    with pytest.raises(StoreError, match="cannot be read"):
        open_store(store_dir).self_influence("epoch-1/train")
    status, _, err = run_cli(capsys, "outliers", str(store_dir))
    assert status == 2 and "cannot be read" in err and "Traceback" not in err


# -- arguments out of range --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["outliers", "-k", "-3"],
        ["outliers", "-k", "0"],
        ["influence", "-k", "x"],
        ["query", "changed", "--steps", "abc"],
        ["query", "changed", "--steps", "5:2"],
        ["query", "spikes", "--threshold", "1", "--before", "-1"],
    ],
)
def test_cli_arguments_out_of_range_are_refused(
    log_dir: Path, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    status, out, err = run_cli(capsys, args[0], str(log_dir), *args[1:])
    assert status == 2 and out == ""
    assert "error: argument" in err and "Traceback" not in err


@pytest.mark.parametrize("callback", [MetaStoreCallback, MetaStoreTrainerCallback])
@pytest.mark.parametrize(
    "setting, value",
    [
        ("report_k", -1),
        ("report_k", 0),
        ("checkpoint_train_samples", 0),
        ("checkpoint_val_samples", -2),
        ("seed", 1.5),
        ("basis_samples", -1),
    ],
)
def test_callback_settings_out_of_range_are_refused(callback: type, setting: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"{callback.__name__}\({setting}=\.\.\.\) must be an integer"):
        callback(**{setting: value})


@pytest.mark.parametrize(
    "callback, setting",
    [(MetaStoreCallback, "checkpoint_every_n_epochs"), (MetaStoreTrainerCallback, "checkpoint_every_n_evals")],
)
def test_a_negative_checkpoint_period_is_refused(callback: type, setting: str) -> None:
    with pytest.raises(ValueError, match=rf"{callback.__name__}\({setting}=\.\.\.\) must be an integer >= 0"):
        callback(**{setting: -1})
    assert callback(**{setting: 0}).schedule.every_n_epochs == 0  # 0 still turns the passes off


# -- compare prints a table, not JSON ----------------------------------------------------------------


def test_compare_prints_tables_and_json_only_when_asked(
    log_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = write_run(tmp_path / "other", seed=2)
    status, out, err = run_cli(capsys, "query", str(log_dir), "compare", "--other", str(other), "-k", "2")
    assert status == 0, err
    assert not out.lstrip().startswith(("{", "[")) and "| layer | mean_norm |" in out
    assert "| step | norm | other_norm |" in out
    step_table = out.split("| step | norm | other_norm |")[1]
    step_rows = [line for line in step_table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(step_rows) == 2  # -k 2 steps, not every step
    status, out, _ = run_cli(capsys, "query", str(log_dir), "compare", "--other", str(other), "--json")
    data = json.loads(out)
    assert status == 0 and len(data["steps"]) == len(open_store(log_dir).steps("train"))


def test_copying_a_store_elsewhere_keeps_it_openable(log_dir: Path, tmp_path: Path) -> None:
    copy = shutil.copytree(log_dir / "metastore", tmp_path / "run" / "store")
    assert open_store(tmp_path / "run").path == copy


def test_influence_without_validation_passes_says_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store_dir = write_run(tmp_path / "store", seed=3)
    status, _, err = run_cli(capsys, "influence", str(store_dir), "--test-split", "test")
    assert status == 2 and "holds no 'test' checkpoint passes" in err and "eval_strategy='epoch'" in err
