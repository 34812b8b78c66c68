"""Hostile snapshot files (issue 29): bit flips, header lies, links, FIFOs, wrong dtypes, NaN, deep nesting.

Expected values are the model's own tensors (bitwise) and the files' own bytes (``hashlib.sha256``);
each refusal must name the file and come within :data:`hostilecases.PROMPT` seconds. Files outside the
store (decoys) are checked by their sha256 before and after.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hostilecases import PROMPT, sha256, within
from safetensors.torch import save
from storecases import synthetic_batch
from torch import Tensor, nn

from metastore_plugins import open_store
from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.model.recompute import recompute
from metastore_plugins.core.store import StoreWriter
from metastore_plugins.core.store.snapshots.weights import (
    SnapshotWriter,
    list_snapshots,
    load_snapshot,
    load_snapshot_state,
    write_snapshot,
)

FORMAT = "metastore-snapshot/1"
pytestmark = pytest.mark.filterwarnings("ignore:.*no checksum recorded")  # files written by hand have none


class Net(nn.Module):
    """An embedding (row-sparse updates), a BatchNorm (buffers) and a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.BatchNorm1d(4)
        self.fc = nn.Linear(4, 3)


def _bits(t: Tensor) -> Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _header(data: bytes) -> tuple[int, dict[str, Any]]:
    """(offset of the data section, the header) of a safetensors file's bytes, parsed by hand."""
    (n,) = struct.unpack("<Q", data[:8])
    return 8 + n, json.loads(data[8 : 8 + n])


def _craft(folder: Path, name: str, tensors: dict[str, Tensor], **meta: str) -> Path:
    """A snapshot file written by hand: ``tensors`` under the format's metadata (``meta`` overrides)."""
    shapes = {k.split("/", 1)[1]: list(v.shape) for k, v in tensors.items() if k.startswith("full/")}
    metadata = {"format": FORMAT, "name": name, "step": "0", "rank": "0", "base": "", "attributes": "{}"}
    metadata |= {"shapes": json.dumps(shapes), "buffer_shapes": "{}", **meta}
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}-rank0.safetensors"
    path.write_bytes(save(tensors, metadata=metadata))
    return path


def _outside(tmp_path: Path) -> tuple[Path, Path, str]:
    """A store directory and, beside it, a decoy file outside it with its sha256."""
    store, outside = tmp_path / "store", tmp_path / "outside"
    store.mkdir()
    outside.mkdir()
    decoy = outside / "decoy.txt"
    decoy.write_bytes(b"precious outside data\n")
    return store, decoy, sha256(decoy)


def _tree(path: Path) -> dict[str, str]:
    """sha256 of every file below ``path`` (links not followed)."""
    return {str(p.relative_to(path)): sha256(p) for p in sorted(path.rglob("*")) if p.is_file() and not p.is_symlink()}


# -- checksums -------------------------------------------------------------------------------------


def test_each_snapshot_is_recorded_with_the_sha256_of_its_bytes(tmp_path: Path) -> None:
    model = Net()
    writer = SnapshotWriter(tmp_path)
    writer.write(model, name="a", step=3)
    with torch.no_grad():
        model.fc.weight.add_(1.0)
    writer.write(model, name="b", step=7)
    journal = tmp_path / "snapshots-rank0.jsonl"
    lines = journal.read_bytes().splitlines()
    entries = [json.loads(line.rsplit(b" ", 1)[0]) for line in lines]
    for entry, name, step in zip(entries, ["a", "b"], [3, 7], strict=True):
        data = (tmp_path / "snapshots" / f"{name}-rank0.safetensors").read_bytes()
        assert entry["name"] == name and entry["step"] == step and entry["bytes"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()


def test_a_flipped_exponent_bit_is_refused_naming_the_file(tmp_path: Path) -> None:
    model = Net()
    write_snapshot(tmp_path, model, name="s", step=0)
    path = tmp_path / "snapshots" / "s-rank0.safetensors"
    data = bytearray(path.read_bytes())
    start, header = _header(bytes(data))
    begin = start + header["full/fc.weight"]["data_offsets"][0]
    data[begin + 2] ^= 0x80  # the lowest exponent bit of fc.weight[0, 0]: its value halved or doubled, still finite
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"s-rank0\.safetensors: a damaged snapshot: its sha256 .*take it again"):
        load_snapshot(tmp_path, "s")


def test_recompute_refuses_a_snapshot_with_a_flipped_bit(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    write_snapshot(tmp_path, model, name="s", step=0)
    path = tmp_path / "snapshots" / "s-rank0.safetensors"
    data = bytearray(path.read_bytes())
    start, header = _header(bytes(data))
    data[start + header["full/weight"]["data_offsets"][0] + 2] ^= 0x80  # weight[0, 0] halved or doubled
    path.write_bytes(bytes(data))
    samples = [(torch.ones(3), torch.tensor(0))]
    with pytest.raises(StoreError, match=r"s-rank0\.safetensors: a damaged snapshot: its sha256"):
        recompute(model, samples, [0], store_dir=tmp_path, snapshot="s", loss_fn=_loss)


def _loss(outputs: Tensor, labels: Tensor) -> Tensor:
    return torch.nn.functional.cross_entropy(outputs, labels, reduction="none")


def test_a_snapshot_written_before_checksums_still_loads_and_says_so_once(tmp_path: Path) -> None:
    model = Net()
    write_snapshot(tmp_path, model, name="old", step=0)
    (tmp_path / "snapshots-rank0.jsonl").unlink(missing_ok=True)  # as a store written before checksums
    with pytest.warns(UserWarning, match=r"old-rank0\.safetensors.*no checksum"):
        params, _ = load_snapshot_state(tmp_path, "old")
    assert torch.equal(_bits(params["fc.weight"]), _bits(model.fc.weight))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        load_snapshot(tmp_path, "old")


# -- what a snapshot may hold ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tensors", "what"),
    [
        ({"full/fc.weight": torch.ones(3, 4, dtype=torch.float16)}, r"full/fc\.weight.*F16"),
        ({"full/fc.weight": torch.ones(3, 4, dtype=torch.int32)}, r"full/fc\.weight.*I32"),
        ({"full/fc.weight": torch.tensor([[1.0, float("nan"), 0, 0]] * 3)}, r"full/fc\.weight.*NaN"),
        ({"full/fc.weight": torch.tensor([[1.0, float("inf"), 0, 0]] * 3)}, r"full/fc\.weight.*NaN"),
        ({"full/fc.weight": torch.ones(3, 4), "extra/x": torch.ones(2)}, r"extra/x"),
    ],
    ids=["fp16", "int32", "nan", "inf", "unknown-key"],
)
def test_weights_outside_the_whitelist_are_refused(tmp_path: Path, tensors: dict[str, Tensor], what: str) -> None:
    _craft(tmp_path / "snapshots", "w", tensors)
    with pytest.raises(StoreError, match=r"w-rank0\.safetensors: .*" + what):
        load_snapshot(tmp_path, "w")


def test_buffers_in_float_dtypes_and_int64_counters_load(tmp_path: Path) -> None:
    buffers = {"buffers/full/var": torch.ones(4, dtype=torch.float64), "buffers/full/count": torch.tensor(7)}
    _craft(
        tmp_path / "snapshots",
        "b",
        {"full/fc.weight": torch.ones(3, 4), **buffers},
        buffer_shapes='{"var": [4], "count": []}',
    )
    params, got = load_snapshot_state(tmp_path, "b")
    assert got is not None and got["var"].dtype == torch.float64 and int(got["count"]) == 7


def test_rows_that_wrap_or_broadcast_are_refused(tmp_path: Path) -> None:
    folder = tmp_path / "snapshots"
    _craft(folder, "base", {"full/e": torch.zeros(5, 2)})
    shapes = json.dumps({"e": [5, 2]})
    _craft(folder, "neg", {"rows/e": torch.tensor([-1]), "part/e": torch.ones(1, 2)}, base="base", shapes=shapes)
    _craft(folder, "wide", {"rows/e": torch.tensor([0, 1]), "part/e": torch.ones(1, 2)}, base="base", shapes=shapes)
    _craft(folder, "far", {"rows/e": torch.tensor([2**31 - 1]), "part/e": torch.ones(1, 2)}, base="base", shapes=shapes)
    for name in ("neg", "wide", "far"):
        with pytest.raises(StoreError, match=rf"{name}-rank0\.safetensors: .*rows/e"):
            load_snapshot(tmp_path, name)
    assert torch.equal(load_snapshot(tmp_path, "base")["e"], torch.zeros(5, 2))


@pytest.mark.parametrize(
    "meta",
    [
        {"shapes": json.dumps({"fc.weight": [2**31 - 1, 8]})},
        {"shapes": "[" * 100_000 + "]" * 100_000},
        {"attributes": "[" * 100_000 + "]" * 100_000},
        {"attributes": "[1, 2]"},
        {"step": "-3"},
        {"step": "9" * 5000},
        {"base": "../../etc/passwd"},
    ],
    ids=[
        "huge-shape",
        "deep-shapes",
        "deep-attributes",
        "attributes-not-a-dict",
        "negative-step",
        "long-step",
        "bad-base",
    ],
)
def test_header_lies_are_refused_naming_the_file(tmp_path: Path, meta: dict[str, str]) -> None:
    _craft(tmp_path / "snapshots", "h", {"full/fc.weight": torch.ones(3, 4)}, **meta)
    with pytest.raises(StoreError, match=r"h-rank0\.safetensors"):
        within(PROMPT, lambda: load_snapshot(tmp_path, "h"))
    with pytest.raises(StoreError, match=r"h-rank0\.safetensors"):
        within(PROMPT, lambda: list_snapshots(tmp_path))


def test_a_header_length_beyond_the_file_is_refused(tmp_path: Path) -> None:
    path = _craft(tmp_path / "snapshots", "n", {"full/fc.weight": torch.ones(3, 4)})
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2**62) + data[8:])
    with pytest.raises(StoreError, match=r"n-rank0\.safetensors"):
        within(PROMPT, lambda: load_snapshot(tmp_path, "n"))


def test_a_snapshot_under_another_name_or_rank_is_refused(tmp_path: Path) -> None:
    model = Net()
    write_snapshot(tmp_path, model, name="a", step=0)
    folder = tmp_path / "snapshots"
    (folder / "b-rank0.safetensors").write_bytes((folder / "a-rank0.safetensors").read_bytes())
    (folder / "a-rank2.safetensors").write_bytes((folder / "a-rank0.safetensors").read_bytes())
    with pytest.raises(StoreError, match=r"b-rank0\.safetensors: .*snapshot 'a' of rank 0, not 'b' of rank 0"):
        load_snapshot(tmp_path, "b")
    with pytest.raises(StoreError, match=r"a-rank2\.safetensors: .*snapshot 'a' of rank 0, not 'a' of rank 2"):
        load_snapshot(tmp_path, "a", rank=2)
    with pytest.raises(StoreError, match=r"(b-rank0|a-rank2)\.safetensors: holds snapshot 'a' of rank 0"):
        list_snapshots(tmp_path)


def test_a_writer_refuses_weights_that_are_not_finite(tmp_path: Path) -> None:
    model = Net()
    with torch.no_grad():
        model.fc.bias[1] = float("nan")
    with pytest.raises(ValueError, match=r"fc\.bias.*NaN"):
        write_snapshot(tmp_path, model, name="nan", step=0)
    assert not (tmp_path / "snapshots" / "nan-rank0.safetensors").exists()


# -- links and special files -----------------------------------------------------------------------


def test_a_snapshots_directory_linked_outside_is_neither_read_nor_written(tmp_path: Path) -> None:
    store, decoy, digest = _outside(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    write_snapshot(elsewhere, Net(), name="x", step=0)  # a real snapshot outside the store
    before = _tree(elsewhere)
    (store / "snapshots").symlink_to(elsewhere / "snapshots", target_is_directory=True)
    with pytest.raises(StoreError, match=r"snapshots.*link"):
        list_snapshots(store)
    with pytest.raises(StoreError, match=r"snapshots.*link"):
        load_snapshot(store, "x")
    with pytest.raises(StoreError, match=r"snapshots.*link"):
        write_snapshot(store, Net(), name="y", step=1)
    assert _tree(elsewhere) == before and sha256(decoy) == digest


@pytest.mark.parametrize("target", ["decoy", "passwd", "dangling"])
def test_a_snapshot_file_that_is_a_link_is_refused_unread(tmp_path: Path, target: str) -> None:
    store, decoy, digest = _outside(tmp_path)
    write_snapshot(tmp_path / "elsewhere", Net(), name="s", step=0)
    outside_snapshot = tmp_path / "elsewhere" / "snapshots" / "s-rank0.safetensors"
    sources = {"decoy": outside_snapshot, "passwd": Path("/etc/passwd"), "dangling": decoy.parent / "new.bin"}
    (store / "snapshots").mkdir()
    link = store / "snapshots" / "s-rank0.safetensors"
    link.symlink_to(sources[target])
    outside_digest = sha256(outside_snapshot)
    with pytest.raises(StoreError, match=r"s-rank0\.safetensors.*link"):
        load_snapshot(store, "s")
    with pytest.raises(StoreError, match=r"s-rank0\.safetensors.*link"):
        list_snapshots(store)
    write_snapshot(store, Net(), name="s", step=1)  # replaces the link by a file, writes nothing through it
    assert not link.is_symlink() and load_snapshot(store, "s")
    assert sha256(decoy) == digest and sha256(outside_snapshot) == outside_digest
    assert not (decoy.parent / "new.bin").exists()


def test_a_planted_temporary_link_is_not_written_through(tmp_path: Path) -> None:
    store, decoy, digest = _outside(tmp_path)
    (store / "snapshots").mkdir()
    for name in ("s-rank0.safetensors.tmp", "snapshots-rank0.jsonl.tmp"):
        (store / "snapshots" / name).symlink_to(decoy)
        (store / name).symlink_to(decoy)
    model = Net()
    write_snapshot(store, model, name="s", step=0)
    assert sha256(decoy) == digest
    assert torch.equal(_bits(load_snapshot(store, "s")["fc.weight"]), _bits(model.fc.weight))


def test_a_journal_that_is_a_link_is_not_appended_through(tmp_path: Path) -> None:
    store, decoy, digest = _outside(tmp_path)
    (store / "snapshots-rank0.jsonl").symlink_to(decoy)
    with pytest.raises(StoreError, match=r"snapshots-rank0\.jsonl.*link"):
        write_snapshot(store, Net(), name="s", step=0)
    assert sha256(decoy) == digest


def test_a_fifo_is_refused_without_hanging(tmp_path: Path) -> None:
    records, _ = synthetic_batch(seed=0)
    with StoreWriter(tmp_path) as writer:
        writer.write(records, sample_ids=torch.arange(4), step=0)
    (tmp_path / "snapshots").mkdir()
    os.mkfifo(tmp_path / "snapshots" / "f-rank0.safetensors")
    for call in (lambda: list_snapshots(tmp_path), lambda: load_snapshot(tmp_path, "f")):
        with pytest.raises(StoreError, match=r"f-rank0\.safetensors.*not a regular file"):
            within(PROMPT, call)
    with pytest.raises(StoreError, match=r"f-rank0\.safetensors.*not a regular file"):
        within(PROMPT, lambda: open_store(tmp_path).find())
    os.mkfifo(tmp_path / "snapshots-rank0.jsonl")
    with pytest.raises(StoreError, match=r"snapshots-rank0\.jsonl.*not a regular file"):
        within(PROMPT, lambda: write_snapshot(tmp_path, Net(), name="g", step=0))
