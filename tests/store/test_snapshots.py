"""Weight snapshots: bitwise round trips through row-sparse chains, atomic writes, rewrites, errors, store health.

Expected values are the model's own tensors, compared bit for bit (``_bits``: ``-0.0`` differs from
``0.0``), since a snapshot copies values without arithmetic.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from storecases import synthetic_batch
from torch import Tensor, nn

from metastore_plugins import open_store
from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.store import StoreWriter
from metastore_plugins.core.store.maintenance.compaction import repair
from metastore_plugins.core.store.snapshots.weights import (
    SnapshotWriter,
    list_snapshots,
    load_snapshot,
    load_snapshot_state,
    snapshot_bytes,
    write_snapshot,
)


class Net(nn.Module):
    """An embedding (row-sparse updates), a BatchNorm (buffers), a Linear and a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 6)
        self.norm = nn.BatchNorm1d(6)
        self.fc = nn.Linear(6, 3)
        self.frozen = nn.Parameter(torch.ones(2), requires_grad=False)

    def forward(self, ids: Tensor) -> Tensor:
        return self.fc(self.norm(self.embed(ids).mean(1)))  # (B, 3)


def _bits(t: Tensor) -> Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _state(model: nn.Module) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    params = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    return params, {k: v.clone() for k, v in model.named_buffers() if v.is_floating_point()}


def _assert_bitwise(store: Path, name: str, expected: tuple[dict[str, Tensor], dict[str, Tensor]]) -> None:
    params, buffers = load_snapshot_state(store, name)
    for got, want in ((params, expected[0]), (buffers, expected[1])):
        assert got is not None and set(got) == set(want)
        for key, value in want.items():
            assert got[key].dtype == torch.float32 and torch.equal(_bits(got[key]), _bits(value)), (name, key)


def _keys(path: Path) -> set[str]:
    with safe_open(str(path), framework="pt") as handle:
        return set(handle.keys())


def _move(model: Net, rows: list[int]) -> None:
    """Change a few embedding rows (one from 0.0 to -0.0 only), all of ``fc.weight``, and the running stats."""
    with torch.no_grad():
        model.embed.weight[rows[1:]] += 1.0
        model.embed.weight[rows[0]] = -0.0
        model.fc.weight.mul_(2.0)
    model.train()
    model(torch.randint(0, 40, (8, 5), generator=torch.Generator().manual_seed(1)))  # moves the running stats
    model.eval()


def test_a_chain_round_trips_bitwise_and_stores_only_what_changed(tmp_path: Path) -> None:
    model = Net()
    with torch.no_grad():
        model.embed.weight[3] = 0.0
    writer = SnapshotWriter(tmp_path)
    first = writer.write(model, name="epoch-0", step=4, attributes={"loss": 1.5})
    state0 = _state(model)
    _move(model, [3, 7, 11])
    second = writer.write(model, name="epoch-1", step=8)
    state1 = _state(model)

    assert _keys(second.path) == {
        "rows/embed.weight",
        "part/embed.weight",
        "full/fc.weight",  # every row changed: stored whole
        "buffers/full/norm.running_mean",
        "buffers/full/norm.running_var",
    }  # fc.bias, norm.weight/bias unchanged; `frozen` never stored; num_batches_tracked is not floating
    with safe_open(str(second.path), framework="pt") as handle:
        assert handle.get_tensor("rows/embed.weight").tolist() == [3, 7, 11]  # -0.0 vs 0.0 is a change
        assert handle.get_tensor("part/embed.weight").shape == (3, 6)
    assert second.base == "epoch-0" and first.base is None and second.nbytes < first.nbytes
    assert not list((tmp_path / "snapshots").glob("*.tmp"))
    _assert_bitwise(tmp_path, "epoch-0", state0)
    _assert_bitwise(tmp_path, "epoch-1", state1)
    assert set(load_snapshot(tmp_path, "epoch-1")) == set(state1[0])
    assert [(s.name, s.step, s.rank, s.base, s.attributes) for s in list_snapshots(tmp_path)] == [
        ("epoch-0", 4, 0, None, {"loss": 1.5}),
        ("epoch-1", 8, 0, "epoch-0", {}),
    ]
    unchanged = writer.write(model, name="epoch-2", step=9)  # nothing moved: no tensor stored
    assert _keys(unchanged.path) == set()
    _assert_bitwise(tmp_path, "epoch-2", state1)


def test_write_snapshot_continues_the_chain_of_its_rank_on_disk(tmp_path: Path) -> None:
    model = Net()
    write_snapshot(tmp_path, model, name="a", step=0)
    write_snapshot(tmp_path, nn.Linear(2, 2), name="other", step=0, rank=1)  # another rank: another chain
    state_a = _state(model)
    _move(model, [1, 2, 3])
    info = write_snapshot(tmp_path, model, name="b", step=5, attributes={"reason": "spike"})
    assert info.base == "a" and "rows/embed.weight" in _keys(info.path) and "full/embed.weight" not in _keys(info.path)
    _assert_bitwise(tmp_path, "a", state_a)
    _assert_bitwise(tmp_path, "b", _state(model))
    assert [(s.name, s.rank) for s in list_snapshots(tmp_path)] == [("a", 0), ("other", 1), ("b", 0)]
    assert snapshot_bytes(model) == 4 * (40 * 6 + 6 + 6 + 18 + 3) + 4 * (6 + 6)  # fp32 trainable + float buffers


@pytest.mark.parametrize("fresh_writer", [False, True], ids=["same-writer", "resumed-run"])
def test_writing_a_name_again_leaves_every_other_snapshot_exact(tmp_path: Path, fresh_writer: bool) -> None:
    model, states = Net(), {}
    writer = SnapshotWriter(tmp_path)
    for k, name in enumerate(["a", "b", "c"]):
        _move(model, [k, k + 5, k + 9])
        writer.write(model, name=name, step=k)
        states[name] = _state(model)
    for again in ["a", "c", "c"]:  # a base of others; the latest (the writer's own base); twice
        _move(model, [20, 21, 22])
        (SnapshotWriter(tmp_path) if fresh_writer else writer).write(model, name=again, step=10)
        states[again] = _state(model)
        for name, state in states.items():
            _assert_bitwise(tmp_path, name, state)
    assert sorted(s.name for s in list_snapshots(tmp_path)) == ["a", "b", "c"]


def test_a_failed_write_leaves_the_old_snapshot_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = Net()
    write_snapshot(tmp_path, model, name="s", step=0)
    before = _state(model)
    _move(model, [1, 2, 3])

    def full_disk(fd: int) -> None:  # the temporary file is written, its fsync fails
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        write_snapshot(tmp_path, model, name="s", step=1)
    assert sorted(p.name for p in (tmp_path / "snapshots").iterdir()) == ["s-rank0.safetensors"]
    _assert_bitwise(tmp_path, "s", before)


def test_errors_name_the_file_and_the_fix(tmp_path: Path) -> None:
    model = Net()
    writer = SnapshotWriter(tmp_path)
    writer.write(model, name="a", step=0)
    _move(model, [1, 2, 3])
    writer.write(model, name="b", step=1)
    folder = tmp_path / "snapshots"
    with pytest.raises(
        StoreError, match=r"nope-rank0\.safetensors: the snapshot is missing \(snapshots of rank 0: a, b\)"
    ):
        load_snapshot(tmp_path, "nope")
    with pytest.raises(StoreError, match="b-rank3.safetensors: the snapshot is missing.*none"):
        load_snapshot(tmp_path, "b", rank=3)
    with pytest.raises(ValueError, match="a snapshot name must be"):
        write_snapshot(tmp_path, model, name="../escape", step=2)

    (folder / "a-rank0.safetensors").rename(folder / "kept.bin")
    with pytest.raises(
        StoreError, match=r"a-rank0\.safetensors: the base snapshot 'a' of 'b' is missing.*take it again"
    ):
        load_snapshot(tmp_path, "b")
    (folder / "kept.bin").rename(folder / "a-rank0.safetensors")

    data = (folder / "b-rank0.safetensors").read_bytes()
    (folder / "b-rank0.safetensors").write_bytes(data[: len(data) - 8])  # torn: the tensors are cut short
    with pytest.raises(StoreError, match=r"b-rank0\.safetensors: a damaged snapshot.*delete it and take it again"):
        load_snapshot(tmp_path, "b")
    (folder / "b-rank0.safetensors").write_bytes(data)
    save_file({"w": torch.zeros(2)}, str(folder / "c-rank0.safetensors"))  # a safetensors file, not a snapshot
    with pytest.raises(StoreError, match=r"c-rank0\.safetensors: not a metastore snapshot .*move it out of snapshots/"):
        list_snapshots(tmp_path)
    assert torch.equal(load_snapshot(tmp_path, "a")["fc.bias"], model.fc.bias.detach())  # others still read


def test_snapshots_leave_the_store_healthy(tmp_path: Path) -> None:
    records, _ = synthetic_batch(seed=0)
    with StoreWriter(tmp_path) as store_writer:
        store_writer.write(records, sample_ids=torch.arange(4), step=0)
    model = Net()
    write_snapshot(tmp_path, model, name="epoch-0", step=0)
    write_snapshot(tmp_path, model, name="rank0-000001", step=1)  # a shard-like snapshot name, in snapshots/
    store = open_store(tmp_path)
    assert store.verify() == [] and store.steps() == [0]
    assert repair(tmp_path) == []
    _assert_bitwise(tmp_path, "rank0-000001", _state(model))


def test_each_snapshot_operation_parses_only_the_journal_lines_appended_since(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A journal of 300 earlier lines: after the first read in the process, a ``write_snapshot`` (which reads the
    journal several times) parses only its own new line (before: every line, each time), and a line changed in
    place by another process is parsed again and named."""
    import metastore_plugins.core.store.snapshots.snapshot_check as check
    from metastore_plugins.core.store.shards.journal import encode_line
    from metastore_plugins.core.store.snapshots.weights import check_snapshots

    write_snapshot(tmp_path, nn.Linear(3, 2), name="first", step=0)
    journal = tmp_path / "snapshots-rank0.jsonl"
    old = [
        {"name": f"old-{i}", "file": f"old-{i}-rank0.safetensors", "step": i, "bytes": 10, "sha256": "ab" * 32}
        for i in range(300)
    ]
    journal.write_bytes(b"".join(map(encode_line, old)) + journal.read_bytes())
    parsed: list[dict] = []
    original = check._record
    monkeypatch.setattr(check, "_record", lambda entry, rank: parsed.append(entry) or original(entry, rank))
    assert [info.name for info in list_snapshots(tmp_path)] == ["first"]
    assert [entry["name"] for entry in parsed] == ["first"]  # only the line of the file there (before: all 301)
    check_snapshots(tmp_path)  # a whole read: every line parsed (the old files are missing), kept
    assert len(parsed) == 302
    parsed.clear()
    write_snapshot(tmp_path, nn.Linear(3, 2), name="second", step=1)
    assert len(parsed) == 1 and parsed[0]["name"] == "second"
    data = journal.read_bytes().replace(b'"old-7"', b'"old-x"', 1)  # its CRC no longer matches
    journal.write_bytes(data)
    assert any("line 8 is damaged" in line for line in check_snapshots(tmp_path)[1])
