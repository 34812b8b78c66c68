"""Faults and bad input: damaged shards, a full disk, hostile manifests and shards, no pickle.

(A writer killed with SIGKILL is tested in test_writer.py.)
"""

from __future__ import annotations

import errno
import json
import os
import re
import struct
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from storecases import FP32_ROUNDOFF, synthetic_batch

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core.store import StoreError
from metastore_plugins.core.store import manifest as mf
from metastore_plugins.core.store import writer as writer_module

ROOT = Path(__file__).resolve().parents[2]


def _write(writer: StoreWriter, seeds: range, size: int = 4) -> dict[int, dict[str, torch.Tensor]]:
    expected = {}
    for seed in seeds:
        records, grads = synthetic_batch(seed, size)
        ids = torch.arange(size) + seed * size
        writer.write(records, sample_ids=ids, step=seed, labels=ids % 3)
        expected.update({int(i): {k: v[pos] for k, v in grads.items()} for pos, i in enumerate(ids.tolist())})
    return expected


def _check(store: Any, expected: dict[int, dict[str, torch.Tensor]]) -> None:
    for sample, grads in expected.items():
        restored = store.restore(sample)
        for name, value in grads.items():
            torch.testing.assert_close(restored[name], value, **FP32_ROUNDOFF)


def _manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / "manifest-rank0.json").read_text())


def _save_manifest(path: Path, manifest: dict[str, Any]) -> None:
    (path / "manifest-rank0.json").write_text(json.dumps(manifest))


@pytest.fixture
def store4(tmp_path: Path) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    """Four fp32 shards of one batch each (sample ids 0..15)."""
    with StoreWriter(tmp_path, encoding="fp32", shard_bytes=1) as writer:
        expected = _write(writer, range(4))
    assert len(list(tmp_path.glob("*.safetensors"))) == 4
    return tmp_path, expected


def _shard(path: Path, i: int) -> Path:
    return path / f"rank0-{i:06d}.safetensors"


def _ids_of(expected: dict[int, Any], shard: int) -> dict[int, Any]:
    return {k: v for k, v in expected.items() if k // 4 == shard}


# -- damaged shards ----------------------------------------------------------------------------


def test_reading_a_shard_with_flipped_bytes_names_the_file_and_the_checksum(store4: tuple) -> None:
    path, expected = store4
    victim = _shard(path, 1)
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0x40  # inside tensor data: safetensors itself would not notice
    victim.write_bytes(bytes(data))
    store = open_store(path)
    with pytest.raises(
        StoreError, match=rf"{re.escape(victim.name)}: checksum mismatch, sha256 [0-9a-f]{{64}} on disk"
    ):
        store.restore(5)
    with pytest.raises(StoreError, match="checksum mismatch"):  # every read, not just the first
        store.sample_ids()
    for shard in (0, 2, 3):  # the other shards stay readable
        _check(store, _ids_of(expected, shard))
        assert store.sample_ids(steps=shard).tolist() == sorted(_ids_of(expected, shard))
    problems = store.verify()
    assert len(problems) == 1 and victim.name in problems[0] and "sha256" in problems[0]


def test_reading_a_truncated_shard_names_the_file(store4: tuple) -> None:
    path, expected = store4
    victim = _shard(path, 2)
    victim.write_bytes(victim.read_bytes()[:-10])
    for checksums in (True, False):  # the size is checked even without checksums
        store = open_store(path, checksums=checksums)
        with pytest.raises(
            StoreError, match=rf"{re.escape(victim.name)}: size mismatch, \d+ bytes on disk but \d+ in the manifest"
        ):
            store.restore(9)
        _check(store, _ids_of(expected, 3))


def test_verify_reports_all_damage_at_once(store4: tuple) -> None:
    path, expected = store4
    flipped, truncated, missing = _shard(path, 0), _shard(path, 1), _shard(path, 3)
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 1
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:100])
    missing.unlink()
    problems = open_store(path).verify()
    assert len(problems) == 3, problems
    for name in (flipped.name, truncated.name, missing.name):
        assert sum(name in problem for problem in problems) == 1, (name, problems)
    _check(open_store(path), _ids_of(expected, 2))


def test_a_shard_is_hashed_once_per_store(store4: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    path, expected = store4
    hashed: list[str] = []
    sha = mf.file_sha256
    monkeypatch.setattr(mf, "file_sha256", lambda p: hashed.append(Path(p).name) or sha(p))
    store = open_store(path)
    _check(store, expected)
    store.norms()
    assert sorted(hashed) == [_shard(path, i).name for i in range(4)]
    open_store(path, checksums=False).norms()
    assert len(hashed) == 4


# -- a full disk -------------------------------------------------------------------------------


def _full_disk_after(monkeypatch: pytest.MonkeyPatch, good: int) -> list[str]:
    """The shard saver writes ``good`` shards, then writes half a file and fails with ENOSPC."""
    calls: list[str] = []
    save = writer_module.write_shard

    def save_until_full(filename: Path, *args: Any) -> tuple[int, str]:
        calls.append(str(filename))
        if len(calls) <= good:
            return save(filename, *args)
        Path(filename).write_bytes(b"\0" * 100)  # a partial file
        raise OSError(errno.ENOSPC, "No space left on device", str(filename))

    monkeypatch.setattr(writer_module, "write_shard", save_until_full)
    return calls


def test_a_full_disk_stops_capture_with_one_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _full_disk_after(monkeypatch, good=2)
    writer = StoreWriter(tmp_path, encoding="fp32", shard_bytes=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        expected = _write(writer, range(2))
        writer.flush()
        _write(writer, range(2, 6))  # the third shard fails; later writes are dropped without error
        writer.flush()
        _write(writer, range(6, 9))
        writer.close()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert str(tmp_path) in messages[0] and "STOPPED CAPTURING" in messages[0]
    assert "2 shard(s) and 8 sample(s)" in messages[0] and "No space left" in messages[0]
    assert writer.stopped is not None and writer.stopped.errno == errno.ENOSPC
    assert len(calls) == 3  # nothing was attempted after the failure
    assert writer.stats.shards == 2
    assert not list(tmp_path.glob("*.tmp"))  # the partial file is removed
    store = open_store(tmp_path)
    assert store.verify() == []
    assert store.sample_ids().tolist() == sorted(expected)
    _check(store, expected)


def test_a_full_disk_can_raise_instead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _full_disk_after(monkeypatch, good=1)
    with pytest.raises(ValueError, match="on_error must be 'warn' or 'raise'"):
        StoreWriter(tmp_path / "x", on_error="ignore")  # type: ignore[arg-type]
    writer = StoreWriter(tmp_path, encoding="fp32", shard_bytes=1, on_error="raise")
    expected = _write(writer, range(1))
    writer.flush()
    _write(writer, range(1, 2))
    with pytest.raises(RuntimeError, match=rf"writer for {re.escape(str(tmp_path))} failed.*No space left"):
        writer.flush()
    with pytest.raises(RuntimeError, match="No space left"):
        _write(writer, range(2, 3))
    with pytest.raises(RuntimeError, match="No space left"):
        writer.close()
    assert not list(tmp_path.glob("*.tmp"))
    store = open_store(tmp_path)
    assert store.verify() == [] and store.sample_ids().tolist() == sorted(expected)


def test_a_full_disk_while_writing_the_manifest_keeps_the_last_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = StoreWriter(tmp_path, encoding="fp32", shard_bytes=1)
    expected = _write(writer, range(2))
    writer.flush()
    before = (tmp_path / "manifest-rank0.json").read_bytes()
    replace = os.replace

    def replace_no_json(src: Any, dst: Any) -> None:
        if str(dst).endswith(".json"):
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_no_json)
    with pytest.warns(RuntimeWarning, match="STOPPED CAPTURING.*2 shard\\(s\\) and 8 sample\\(s\\)"):
        _write(writer, range(2, 3))
        writer.close()
    monkeypatch.undo()
    assert (tmp_path / "manifest-rank0.json").read_bytes() == before
    assert not list(tmp_path.glob("*.tmp"))
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [_shard(tmp_path, i).name for i in range(2)]
    store = open_store(tmp_path)
    assert store.verify() == []
    _check(store, expected)


def test_a_new_writer_removes_a_stale_manifest_tmp(tmp_path: Path) -> None:
    with StoreWriter(tmp_path, encoding="fp32") as writer:
        expected = _write(writer, range(1))
    (tmp_path / "manifest-rank0.json.tmp").write_text('{"half": ')
    (tmp_path / "rank0-000001.safetensors.tmp").write_bytes(b"\0" * 10)
    (tmp_path / "manifest-rank1.json.tmp").write_text("another rank's")
    with StoreWriter(tmp_path, encoding="fp32") as writer:
        more = _write(writer, range(1, 2))
    assert sorted(p.name for p in tmp_path.glob("*.tmp")) == ["manifest-rank1.json.tmp"]
    _check(open_store(tmp_path), expected | more)


# -- hostile manifests ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "../outside.safetensors",
        "/tmp/outside.safetensors",
        "sub/rank0-000000.safetensors",
        "..",
        ".hidden.safetensors",
        "x.json",
        7,
        None,
    ],
)
def test_shard_paths_outside_the_run_directory_are_refused(
    store4: tuple, name: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = store4
    manifest = _manifest(path)
    manifest["shards"][0]["file"] = name
    _save_manifest(path, manifest)
    opened: list[str] = []
    monkeypatch.setattr(mf, "file_sha256", lambda p: opened.append(str(p)) or "")
    with pytest.raises(StoreError, match=r"manifest-rank0.json: shards\[0\].file .*(plain|string)"):
        open_store(path)
    assert opened == []


def test_a_shard_that_links_outside_the_run_directory_is_not_read(
    store4: tuple, tmp_path_factory: pytest.TempPathFactory
) -> None:
    path, expected = store4
    outside = tmp_path_factory.mktemp("outside") / "secret.safetensors"
    victim = _shard(path, 0)
    victim.rename(outside)
    victim.symlink_to(outside)
    store = open_store(path)
    with pytest.raises(StoreError, match="leads outside the run directory"):
        store.restore(1)
    problems = store.verify()
    assert len(problems) == 1 and "a link" in problems[0]
    _check(store, _ids_of(expected, 1))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.update(schema_version=2), r"schema version 2; .* reads version 1 and older: upgrade"),
        (lambda m: m.update(schema_version="1"), "invalid schema version '1'"),
        (lambda m: m.update(rank=-1), '"rank" must be a non-negative integer'),
        (lambda m: m.update(layers=[]), '"layers" must be an object'),
        (lambda m: m.update(shards={}), '"shards" must be a list'),
        (
            lambda m: m["layers"]["fc"]["param_shapes"].update(weight=[5, "6"]),
            r"param_shapes\['weight'\] must be a list of sizes",
        ),
        (lambda m: m["layers"]["fc"].update(layout="sideways"), '"layout" must be one of'),
        (lambda m: m["shards"][1].update(bytes="12"), r"shards\[1\].bytes must be a byte count"),
        (lambda m: m["shards"][1].update(sha256="../../etc"), r"shards\[1\].sha256 must be 64 hex digits"),
        (lambda m: m["shards"][1].update(encoding="pickle"), r"shards\[1\].encoding must be one of"),
        (
            lambda m: m["shards"][2]["batches"][0].update(step="0"),
            r"shards\[2\].batches\[0\].step must be an integer; got '0'",
        ),
        (lambda m: m["shards"][2]["batches"][0].update(size=-3), r"batches\[0\].size must be non-negative"),
        (lambda m: m["shards"][2]["batches"][0].update(lr="fast"), r"batches\[0\].lr must be a number or null"),
        (
            lambda m: m["shards"][2]["batches"][0]["records"][0].update(layer="nope"),
            r"records\[0\].layer 'nope' is not in",
        ),
        (
            lambda m: m["shards"][2]["batches"][0]["records"][1].update(kind="sparse"),
            r"records\[1\].kind must be one of",
        ),
        (lambda m: m["shards"].append(dict(m["shards"][0])), "listed twice"),
    ],
)
def test_malformed_manifests_raise_a_clear_store_error(store4: tuple, edit: Any, message: str) -> None:
    path, _ = store4
    manifest = _manifest(path)
    edit(manifest)
    _save_manifest(path, manifest)
    with pytest.raises(StoreError, match=message) as raised:
        open_store(path)
    assert "manifest-rank0.json" in str(raised.value)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "null", '"metastore"', "\udcff", "[" * 100000])
def test_manifests_that_are_not_json_objects(tmp_path: Path, text: str) -> None:
    (tmp_path / "manifest-rank0.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(StoreError, match="manifest-rank0.json"):
        open_store(tmp_path)


# -- hostile shards ----------------------------------------------------------------------------


def _replace_shard(path: Path, i: int, data: bytes) -> Path:
    """Write ``data`` as shard ``i`` and make the manifest agree with it (a consistent, hostile store)."""
    shard = _shard(path, i)
    shard.write_bytes(data)
    manifest = _manifest(path)
    manifest["shards"][i].update(bytes=len(data), sha256=mf.file_sha256(shard))
    _save_manifest(path, manifest)
    return shard


def _edited_shard(path: Path, i: int, **changes: torch.Tensor | None) -> bytes:
    tensors = load_file(str(_shard(path, i)))
    for key, value in changes.items():
        key = key.replace("__", "/")
        if value is None:
            del tensors[key]
        else:
            tensors[key] = value
    out = path / "edited.tmp"
    save_file(tensors, str(out), metadata={"format": "metastore", "encoding": "fp32"})
    data = out.read_bytes()
    out.unlink()
    return data


def _header(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


@pytest.mark.parametrize(
    "data",
    [
        struct.pack("<Q", 2**62) + b"{}",  # a header "larger than the file system"
        _header(b'{"a": {"dtype": "F32", "shape": [1000000000], "data_offsets": [0, 4000000000]}}')
        + bytes(16),  # beyond the file
        _header(b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}') + bytes(8),  # bad JSON header
        b"abc",
        b"",
    ],
)
def test_absurd_safetensors_headers_raise_a_clear_error(store4: tuple, data: bytes) -> None:
    path, expected = store4
    victim = _replace_shard(path, 1, data)
    store = open_store(path)
    with pytest.raises(StoreError, match=rf"{re.escape(victim.name)}: not a readable safetensors file"):
        store.restore(5)
    problems = store.verify()
    assert len(problems) == 1 and victim.name in problems[0] and "unreadable" in problems[0]
    _check(store, _ids_of(expected, 0))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"b0__meta__sample_id": torch.arange(4).float()},
            r"b0/meta/sample_id must be \(4,\) integer sample ids; got torch.float32",
        ),
        ({"b0__meta__sample_id": torch.arange(8)}, r"b0/meta/sample_id must be \(4,\) integer sample ids"),
        ({"b0__meta__sample_id": None}, r"b0/meta/sample_id must be .* got nothing"),
        ({"b0__meta__label": torch.arange(3)}, r"b0/meta/label must have 4 rows"),
        ({"b0__r0__prefix": torch.zeros(8, 6)}, r"b0/r0/prefix must be \(R, G, d_in\)"),
        ({"b0__r0__prefix": torch.zeros(8, 1, 7)}, r"b0/r0/prefix and suffix do not make a weight of shape \(5, 6\)"),
        ({"b0__r0__suffix": torch.zeros(7, 1, 5)}, r"b0/r0/prefix has 8 rows, suffix has 7"),
        ({"b0__r0__sample": torch.zeros(8)}, r"b0/r0/sample must be a 1-d integer tensor; got torch.float32"),
        ({"b0__r0__sample": torch.full((8,), 9, dtype=torch.int32)}, r"b0/r0/sample holds samples outside 0..3"),
        ({"b0__r0__sample": torch.tensor([3, 3, 2, 2, 1, 1, 0, 0], dtype=torch.int32)}, r"b0/r0/sample is not grouped"),
        ({"b0__r0__position": None}, r"b0/r0/position is missing"),
        ({"b0__r1__grad.weight": torch.zeros(4, 6)}, r"b0/r1/grad.weight must be float \(4, 5\)"),
        ({"b0__r1__grad.weight": torch.zeros(4, 5, dtype=torch.int32)}, r"b0/r1/grad.weight must be float"),
        ({"b0__r1__grad.weight": None}, r"b0/r1/grad.weight is missing"),
        ({"b0__r0__prefix.scale": torch.ones(3)}, r"b0/r0/(prefix.scale must be a float \(R,\) row scale|)"),
    ],
)
def test_wrong_dtypes_and_shapes_raise_a_store_error_naming_the_key(store4: tuple, changes: dict, message: str) -> None:
    path, expected = store4
    victim = _replace_shard(path, 1, _edited_shard(path, 1, **changes))
    store = open_store(path)
    if changes != {"b0__meta__sample_id": None}:  # verify() checks only that sample ids are there
        assert store.verify() == []  # consistent with its manifest: only reading finds what is wrong
    with pytest.raises(StoreError, match=rf"{re.escape(victim.name)}: .*{message}"):
        store.restore(5)
        store.norms()
    _check(store, _ids_of(expected, 2))


def test_no_pickle_anywhere() -> None:
    """The store reads and writes only safetensors and JSON."""
    pattern = re.compile(r"\bpickle\b|torch\.load|torch\.save|np\.load|numpy\.load|allow_pickle|joblib|dill")
    offenders = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in sorted((ROOT / "metastore_plugins").rglob("*.py"))
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []
