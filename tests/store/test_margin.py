"""The per-sample ``margin`` column: ``margins_of``, the writer, the journal, compaction, crash recovery, verify.

The margin of a sample with logits ``z`` and label ``y`` is ``z_y - max_{k != y} z_k`` (docs/store.md#margins).
Here it is checked against ``torch.topk`` of known logits, never against ``margins_of`` itself.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hostilecases import column, edit_line, unpacked
from safetensors import safe_open
from storecases import journal_entries, synthetic_batch
from torch import Tensor, nn

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core.model.losses import margins_of
from metastore_plugins.core.store.maintenance.compaction import compact
from metastore_plugins.core.training.passes import capture_step

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
GOLDEN = HERE / "golden"


def _topk_margins(logits: Tensor, labels: Tensor) -> Tensor:
    """``z_y - max_{k != y} z_k`` from the two largest logits: the runner-up where the label is the top one."""
    top = torch.topk(logits.double(), 2, dim=1)
    own = logits.double().gather(1, labels[:, None]).squeeze(1)
    best_other = torch.where(top.indices[:, 0] == labels, top.values[:, 1], top.values[:, 0])
    return (own - best_other).float()


def _margins(seed: int, size: int = 4, classes: int = 3) -> tuple[Tensor, Tensor, Tensor]:
    """Random logits and labels of a batch, and their margins by ``torch.topk``."""
    g = torch.Generator().manual_seed(1000 + seed)
    logits = torch.randn(size, classes, generator=g) * 3  # (B, C)
    labels = torch.randint(0, classes, (size,), generator=g)  # (B,)
    return logits, labels, _topk_margins(logits, labels)


def _write(writer: StoreWriter, seeds: range, margins: bool = True) -> dict[int, float]:
    """One synthetic batch per seed (ids ``4 * seed ...``); sample id -> the margin written (NaN: none)."""
    expected = {}
    for seed in seeds:
        records, _ = synthetic_batch(seed)
        ids = torch.arange(4) + 4 * seed
        logits, labels, margin = _margins(seed)
        writer.write(
            records,
            sample_ids=ids,
            step=seed,
            labels=labels,
            losses=F.cross_entropy(logits, labels, reduction="none"),
            predictions=logits.argmax(1),
            margins=margins_of(logits, labels) if margins else None,
        )
        expected.update({int(i): float(m) if margins else float("nan") for i, m in zip(ids, margin)})
    return expected


def _check(path: Path, expected: dict[int, float]) -> None:
    meta = open_store(path).metadata()
    assert meta["margin"].dtype == np.float32
    got = dict(zip(meta["sample_id"].tolist(), meta["margin"].tolist()))
    assert set(expected) <= set(got)
    np.testing.assert_allclose([got[i] for i in expected], list(expected.values()), rtol=1e-6, atol=1e-6)


# -- margins_of ----------------------------------------------------------------------------------


def test_margins_of_known_logits() -> None:
    logits = torch.tensor([[2.0, 1.0, -1.0], [0.5, 3.0, 1.0], [1.0, 1.0, 0.0], [-2.0, -1.0, -3.0]])
    labels = torch.tensor([0, 2, 1, 2])
    # by hand: 2-1; 1-3; a tie with the runner-up; -3-(-1)
    expected = torch.tensor([1.0, -2.0, 0.0, -2.0])
    margins = margins_of(logits, labels)
    assert margins is not None and margins.dtype == torch.float32 and margins.shape == (4,)
    torch.testing.assert_close(margins, expected, rtol=0, atol=0)
    torch.testing.assert_close(margins, _topk_margins(logits, labels), rtol=0, atol=0)
    assert (margins > 0).tolist() == (logits.argmax(1) == labels).tolist()  # positive where the label is predicted


@pytest.mark.parametrize("classes", [2, 5, 100])
def test_margins_of_random_logits_against_topk(classes: int) -> None:
    logits, labels, expected = _margins(classes, size=64, classes=classes)
    torch.testing.assert_close(margins_of(logits, labels), expected, rtol=1e-6, atol=1e-6)
    # the label's dtype, an output with .logits, half precision: the same margins, in float32
    torch.testing.assert_close(margins_of(logits, labels.int()), expected, rtol=1e-6, atol=1e-6)
    output = type("Output", (), {"logits": logits})()
    torch.testing.assert_close(margins_of(output, labels), expected, rtol=1e-6, atol=1e-6)
    half = margins_of(logits.bfloat16(), labels)
    assert half is not None and half.dtype == torch.float32
    torch.testing.assert_close(half, _topk_margins(logits.bfloat16().float(), labels), rtol=0, atol=0)


def test_margins_of_is_detached_and_empty_batches_work() -> None:
    logits = torch.randn(3, 4, requires_grad=True)
    margins = margins_of(logits, torch.tensor([0, 1, 3]))
    assert margins is not None and not margins.requires_grad
    empty = margins_of(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))
    assert empty is not None and empty.shape == (0,)


@pytest.mark.parametrize(
    ("logits", "labels"),
    [
        (torch.randn(4, 1), torch.zeros(4, dtype=torch.long)),  # C = 1: a single logit has no margin
        (torch.randn(4), torch.zeros(4, dtype=torch.long)),  # a (B,) output
        (torch.randn(4, 3, 5), torch.zeros(4, 3, dtype=torch.long)),  # per-token logits
        (torch.randn(4, 3), torch.randn(4)),  # regression targets
        (torch.randn(4, 3), torch.tensor([0.0, 1.0, 2.0, 1.0])),  # class ids as floats: not labels
        (torch.randn(4, 3), torch.tensor([True, False, True, False])),
        (torch.randn(4, 3), torch.zeros(4, 3, dtype=torch.long)),  # multi-label rows
        (torch.randn(4, 3), torch.tensor([0, 1, 2])),  # one label short
        (torch.randn(4, 3), [0, 1, 2, 2]),  # not a tensor
        ({"logits": torch.randn(4, 3)}, torch.tensor([0, 1, 2, 2])),  # a dict: the caller picks the logits
        (None, torch.tensor([0, 1, 2, 2])),
    ],
)
def test_margins_of_is_none_where_no_class_margin_exists(logits: object, labels: object) -> None:
    assert margins_of(logits, labels) is None


@pytest.mark.parametrize("other", [3, -1, -100])  # out of range (C), negative, an ignore index
def test_a_label_that_is_no_class_gets_nan_and_the_others_keep_theirs(other: int) -> None:
    logits = torch.randn(4, 3)
    labels = torch.tensor([0, other, 2, 1])
    margins = margins_of(logits, labels)
    assert margins is not None and torch.isnan(margins[1])
    keep = torch.tensor([0, 2, 3])
    torch.testing.assert_close(margins[keep], _topk_margins(logits[keep], labels[keep]), rtol=1e-6, atol=1e-6)


# -- writer -> journal -> reader -----------------------------------------------------------------


def test_margins_round_trip_through_the_shard_and_the_journal(tmp_path: Path) -> None:
    with StoreWriter(tmp_path, encoding="int8") as writer:  # metadata is never encoded
        expected = _write(writer, range(3))
    _check(tmp_path, expected)
    store = open_store(tmp_path)
    assert store.verify() == []
    (entry,) = journal_entries(tmp_path)
    assert entry["samples"]["margin"][0] == "f4" and entry["batches"]["meta"][1] == [15, 15, 15]
    logits, labels, margin = _margins(1)
    with safe_open(str(tmp_path / entry["file"]), framework="pt") as handle:
        stored = handle.get_tensor("b1/meta/margin")
    assert stored.dtype == torch.float32 and stored.shape == (4,)
    torch.testing.assert_close(stored, margin, rtol=1e-6, atol=1e-6)
    # the table and its Parquet export carry the column
    pytest.importorskip("pyarrow")
    import pyarrow
    import pyarrow.parquet

    table = store.table()
    assert table.schema.field("margin").type == pyarrow.float32()
    np.testing.assert_array_equal(table.column("margin").to_numpy(), store.metadata()["margin"])
    path = store.to_parquet(tmp_path / "meta.parquet", steps=1)
    np.testing.assert_array_equal(pyarrow.parquet.read_table(path).column("margin").to_numpy(), stored.numpy())


def test_a_write_without_margins_reads_nan(tmp_path: Path) -> None:
    with StoreWriter(tmp_path, encoding="fp32") as writer:
        expected = _write(writer, range(2), margins=False)
    meta = open_store(tmp_path).metadata()
    assert meta["margin"].dtype == np.float32 and np.isnan(meta["margin"]).all() and len(meta["margin"]) == 8
    assert not np.isnan(meta["loss"]).any()
    entry = journal_entries(tmp_path)[0]
    assert "margin" not in entry["samples"] and entry["batches"]["meta"][1] == [7, 7]  # as before margins existed
    # then batches with margins in the same store, and in the same shard as batches without
    with StoreWriter(tmp_path, encoding="fp32") as writer:
        expected.update(_write(writer, range(2, 4)))
        expected.update(_write(writer, range(4, 5), margins=False))
    _check(tmp_path, expected)
    assert journal_entries(tmp_path)[1]["batches"]["meta"][1] == [15, 15, 7]
    assert open_store(tmp_path).verify() == []


@pytest.mark.parametrize("store", ["store", "store_v2", "store_v3"])
def test_stores_written_before_margins_read_nan(store: str) -> None:
    meta = open_store(GOLDEN / store).metadata()
    assert len(meta["margin"]) == len(meta["sample_id"]) > 0
    assert meta["margin"].dtype == np.float32 and np.isnan(meta["margin"]).all()


def test_margins_of_another_shape_are_refused(tmp_path: Path) -> None:
    records, _ = synthetic_batch(0)
    with StoreWriter(tmp_path, encoding="fp32") as writer:
        for bad in (torch.zeros(4, 2), torch.zeros(3), torch.tensor(1.0)):
            with pytest.raises(ValueError, match="margins"):
                writer.write(records, sample_ids=torch.arange(4), step=0, margins=bad)
        writer.write(records, sample_ids=torch.arange(4), step=0, margins=torch.arange(4))  # ints: stored float32
    assert open_store(tmp_path).metadata()["margin"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_verify_reports_margins_that_differ_from_the_journal(tmp_path: Path) -> None:
    with StoreWriter(tmp_path, encoding="fp32") as writer:
        _write(writer, range(2))

    def wrong(entry: dict[str, Any]) -> None:
        values = unpacked(entry["samples"]["margin"]).copy()
        values[5] += 1.0
        entry["samples"]["margin"] = column(values, "f4")

    edit_line(tmp_path, 0, wrong)
    (problem,) = open_store(tmp_path).verify()
    assert problem == "rank0-000000.safetensors: batches b1 do not hold (B,) float32 margins the index lists"


# -- compaction and crash recovery ------------------------------------------------------------------


def test_compaction_keeps_margins(tmp_path: Path) -> None:
    with StoreWriter(tmp_path, encoding="fp32", shard_bytes=1) as writer:  # one shard per batch
        expected = _write(writer, range(0, 3))
        expected.update(_write(writer, range(3, 5), margins=False))  # shards without the column join them
        expected.update(_write(writer, range(5, 7)))
    before = open_store(tmp_path).metadata()
    report = compact(tmp_path, target_bytes=1 << 30)
    assert report.shards_before == 7 and report.shards_after == 1
    store = open_store(tmp_path)
    assert store.verify() == []
    after = store.metadata()
    for name, values in before.items():
        np.testing.assert_array_equal(after[name], values, err_msg=name)
    _check(tmp_path, expected)
    (entry,) = journal_entries(tmp_path)
    assert entry["batches"]["meta"][1] == [15, 15, 15, 7, 7, 15, 15]
    with safe_open(str(tmp_path / entry["file"]), framework="pt") as handle:
        keys = set(handle.keys())
    assert {f"b{j}/meta/margin" for j in range(7)} & keys == {f"b{j}/meta/margin" for j in (0, 1, 2, 5, 6)}


CRASH = textwrap.dedent(
    """
    import os, sys, torch
    sys.path.insert(0, {here!r})
    from storecases import synthetic_batch
    from metastore_plugins import StoreWriter

    writer = StoreWriter({path!r}, encoding="fp32", shard_bytes=1500)
    for seed in range(40):
        records, _ = synthetic_batch(seed)
        margins = torch.arange(4, dtype=torch.float32) - 1.5 + seed
        writer.write(records, sample_ids=torch.arange(4) + 4 * seed, step=seed, margins=margins)
        if seed == 2:
            writer.flush()
            print("flushed", flush=True)
    os._exit(9)
    """
)


def test_margins_survive_a_killed_writer_and_its_recovery(tmp_path: Path) -> None:
    path = tmp_path / "store"
    done = subprocess.run(
        [sys.executable, "-c", CRASH.format(here=str(HERE), path=str(path))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 9 and "flushed" in done.stdout, done.stderr
    # a torn journal tail as if the process died while appending a line
    with (path / "index-rank0.jsonl").open("ab") as handle:
        handle.write(b'{"file": "rank0-999999.safeten')
    expected = {4 * seed + k: k - 1.5 + seed for seed in range(40) for k in range(4)}
    store = open_store(path)
    listed = store.sample_ids().tolist()
    assert set(range(12)) <= set(listed)  # the flushed batches at least
    _check(path, {i: expected[i] for i in listed})
    problems = store.verify()
    assert any(": torn:" in p for p in problems)
    assert all("not listed" in p or "temporary" in p or ": torn:" in p for p in problems), problems
    # recovery: a new writer cuts the torn tail and appends after it; old and new margins read
    logits, labels, margin = _margins(0)
    with StoreWriter(path, encoding="fp32") as writer:
        records, _ = synthetic_batch(0)
        writer.write(records, sample_ids=torch.arange(4) + 5000, step=99, margins=margins_of(logits, labels))
    expected.update({5000 + k: float(m) for k, m in enumerate(margin)})
    store = open_store(path)
    assert not (path / "index-rank0.jsonl").read_bytes().endswith(b"safeten")
    assert all("not listed" in p for p in store.verify())
    _check(path, {i: expected[i] for i in store.sample_ids().tolist()})


# -- capture_step --------------------------------------------------------------------------------


def test_capture_step_records_each_samples_margin(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
    expected = _topk_margins(model(x).detach(), y)  # before the step: capture_step does not update weights
    with StoreWriter(tmp_path, encoding="fp32") as writer:
        capture_step(
            model,
            lambda: model(x),
            y,
            torch.arange(8) + 10,
            lambda out, lab: F.cross_entropy(out, lab, reduction="none"),
            writer,
            step=0,
        )
        # a regression head records no margin (NaN), and capture goes on
        reg = nn.Linear(6, 1)
        capture_step(
            reg,
            lambda: reg(x),
            torch.randn(8),
            torch.arange(8) + 20,
            lambda out, target: (out.squeeze(1) - target) ** 2,
            writer,
            step=1,
        )
    meta = open_store(tmp_path).metadata()
    np.testing.assert_allclose(meta["margin"][:8], expected.numpy(), rtol=1e-5, atol=1e-6)
    assert np.isnan(meta["margin"][8:]).all()


def test_run_capture_records_margins_of_a_dict_output(tmp_path: Path) -> None:
    """The callbacks' path (``RunCapture.finish_step``): logits under ``output["logits"]``, as HF models return."""
    from metastore_plugins.core.training.run import RunCapture

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
    expected = _topk_margins(net(x).detach(), y)
    run = RunCapture(tmp_path, encoding="fp32")
    try:
        run.begin_step(net)
        logits = net(x)
        F.cross_entropy(logits, y).backward()
        run.end_backward()
        run.finish_step((x, y), torch.arange(5), step=0, output={"logits": logits})
    finally:
        run.close()
    meta = open_store(tmp_path).metadata()
    np.testing.assert_allclose(meta["margin"], expected.numpy(), rtol=1e-5, atol=1e-6)


def test_a_nan_margin_is_stored_and_verified(tmp_path: Path) -> None:
    """An ignore index (-100) gives that sample a NaN margin; the batch's other margins are kept and verify passes."""
    records, _ = synthetic_batch(0)
    logits, labels, margin = _margins(0)
    labels[2] = -100
    with StoreWriter(tmp_path / "store") as writer:
        writer.write(records, sample_ids=torch.arange(4), step=0, labels=labels, margins=margins_of(logits, labels))
    store = open_store(tmp_path / "store")
    got = store.metadata()["margin"]
    assert np.isnan(got[2]) and store.verify() == []
    np.testing.assert_allclose(got[[0, 1, 3]], margin[[0, 1, 3]].numpy(), rtol=1e-6, atol=1e-6)
