"""Reading one shard safely (``core/store/shards/shardread.py``): the exact key set, a header parsed by hand
within a bound, bytes checked and held in memory, and files that are not regular never opened.

Real shards come from ``shardfile.write_shard``; every tensor read is compared with what
``safetensors.safe_open`` reads from the same file. Hostile files are built byte by byte.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from shardcases import (
    DESCRIBED,
    ENCODINGS,
    PROMPT,
    _assert_same,
    _good,
    _reference,
    _refused,
    _within,
    _write,
    no_leaked_descriptors,  # noqa: F401 - a fixture
)

from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.store.shards.shardread import (
    ShardData,
    ShardExpectation,
    expected_keys,
    file_problem,
    open_regular,
    read_shard,
    shard_problem,
)


@pytest.fixture(params=ENCODINGS)
def shard(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, ShardExpectation, str]:
    path = tmp_path / "rank0-000000.safetensors"
    return path, _write(path, request.param), request.param


def test_every_tensor_reads_as_safetensors_reads_it(shard: tuple[Path, ShardExpectation, str]) -> None:
    path, expect, encoding = shard
    data = read_shard(path, path.parent, expect)
    reference = _reference(path)
    assert set(reference) == expect.required and expect.optional == frozenset()  # the index's keys, exactly
    _assert_same(data, reference)
    with safe_open(str(path), framework="pt") as handle:
        assert data.metadata == handle.metadata() == {"format": "metastore", "encoding": encoding}
    info = os.stat(path)
    assert data.identity == (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
    assert data.nbytes == expect.bytes == info.st_size
    assert set(data.keys_of_batch(1)) == {k for k in reference if k.startswith("b1/")}
    assert data.keys_of_batch(2) == []
    record = data.read(0, "b0/r3/")
    assert set(record) == {k[len("b0/r3/") :] for k in reference if k.startswith("b0/r3/")}
    assert torch.equal(record["grad.scale"], reference["b0/r3/grad.scale"])
    assert shard_problem(path, path.parent, expect) is None


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_expected_keys_match_what_the_writer_stores(tmp_path: Path, encoding: str) -> None:
    path = tmp_path / "s.safetensors"
    _write(path, encoding)
    actual = set(_reference(path))
    required, optional = expected_keys(DESCRIBED, encoding)
    assert (required, optional) == (actual, frozenset())
    scales = {k for k in actual if k.endswith(".scale") and k[: -len(".scale")] in actual}
    assert bool(scales) == (encoding in ("fp16", "int8"))
    if scales:  # every floating tensor of a record, zero-row ones included, and grad.scale's own scale
        assert {"b0/r1/prefix.scale", "b0/r1/suffix.scale", "b0/r3/grad.scale.scale"} <= scales
        assert not any(
            "/meta/" in k or k.rsplit("/", 1)[1].split(".")[0] in ("ids", "sample", "position") for k in scales
        )
    # an old index without metadata columns: label, loss, prediction may be there
    old_required, old_optional = expected_keys([(None, records) for _, records in DESCRIBED], encoding)
    assert old_optional == {f"b{j}/meta/{c}" for j in (0, 1) for c in ("label", "loss", "prediction")}
    assert old_required <= actual <= old_required | old_optional
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    read_shard(path, tmp_path, ShardExpectation(path.stat().st_size, sha, old_required, old_optional))


def test_tensors_are_views_of_the_bytes_read_that_survive_the_file(tmp_path: Path) -> None:
    path = tmp_path / "s.safetensors"
    expect = _write(path, "fp16")
    reference = _reference(path)
    data = read_shard(path, tmp_path, expect)
    os.truncate(path, 0)  # truncated in place: a mapping would die of SIGBUS here
    _assert_same(data, reference)
    other = tmp_path / "other.safetensors"
    _write(other, "fp16", seed=1)
    os.replace(other, path)  # replaced by a valid shard of the same keys
    _assert_same(data, reference)
    with pytest.raises(StoreError, match="checksum mismatch"):  # read again: checked again
        read_shard(path, tmp_path, expect)
    prefix, again = data.get("b0/r0/prefix"), data.get("b0/r0/prefix")
    assert prefix.data_ptr() == again.data_ptr() == data.raw().data_ptr() + _offset(data, "b0/r0/prefix")  # no copy
    assert data.intact()
    prefix.fill_(7.0)  # a caller breaking the read-only contract changes the shared bytes...
    assert not data.intact()  # ...and the shard says so (a cache then reads it again)


def _offset(data: ShardData, key: str) -> int:
    """Where ``key``'s bytes start in the file, from the header (parsed here with json)."""
    length = int.from_bytes(bytes(data.buffer()[:8]), "little")
    return 8 + length + json.loads(bytes(data.buffer()[8 : 8 + length]))[key]["data_offsets"][0]


def test_a_symlink_inside_the_store_is_refused_as_a_link(tmp_path: Path) -> None:
    good, expect = _good(tmp_path)
    link = tmp_path / "link.safetensors"
    link.symlink_to(good.name)
    problem = _refused(link, tmp_path, expect, r"^is a symbolic link; links are not followed$")
    assert "outside" not in problem
    device = tmp_path / "null.safetensors"
    device.symlink_to("/dev/null")
    _refused(device, tmp_path, expect, r"^is a symbolic link; links are not followed$")


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (lambda p: p.mkdir(), r"^is a directory, not a regular file$"),
        (lambda p: os.mkfifo(p), r"^is a FIFO, not a regular file; not read$"),
        (lambda p: None, r"^missing on disk$"),
    ],
    ids=["directory", "fifo", "missing"],
)
def test_what_is_not_a_regular_file_is_refused_without_blocking(
    tmp_path: Path, make: Callable[[Path], None], pattern: str
) -> None:
    _, expect = _good(tmp_path)
    path = tmp_path / "odd.safetensors"
    make(path)
    _refused(path, tmp_path, expect, pattern)
    assert _within(PROMPT, lambda: file_problem(path, tmp_path)) is not None
    with pytest.raises(StoreError, match=pattern.replace("^", "").replace("$", "")):
        _within(PROMPT, lambda: open_regular(path, tmp_path))


def test_a_socket_and_a_device_are_named_as_such(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # bind a short relative name (AF_UNIX paths are limited to ~108 bytes)
    with socket.socket(socket.AF_UNIX) as server:
        server.bind("sock.safetensors")
        assert file_problem(tmp_path / "sock.safetensors", tmp_path) == "is a socket, not a regular file; not read"
    null = Path("/dev/null")
    if not stat.S_ISCHR(os.lstat(null).st_mode):
        pytest.skip("/dev/null is not a character device here")
    assert file_problem(null, null.parent) == "is a device, not a regular file; not read"
    with pytest.raises(StoreError, match=r"^/dev/null: is a device, not a regular file; not read$"):
        open_regular(null, null.parent)


def test_file_problem_names_each_kind_and_passes_a_regular_file(tmp_path: Path) -> None:
    good, _ = _good(tmp_path)
    assert file_problem(good, tmp_path) is None
    (tmp_path / "link").symlink_to(good.name)
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    got = {
        name: _within(PROMPT, partial(file_problem, tmp_path / name, tmp_path))
        for name in ("link", "dir", "fifo", "gone")
    }
    assert got == {
        "link": "is a symbolic link; links are not followed",
        "dir": "is a directory, not a regular file",
        "fifo": "is a FIFO, not a regular file; not read",
        "gone": "missing on disk",
    }
    (tmp_path / "sub").mkdir()
    elsewhere = tmp_path / "sub" / "good.safetensors"
    elsewhere.write_bytes(good.read_bytes())
    assert file_problem(elsewhere, tmp_path) == f"is not a file of the store directory {tmp_path}; not read"
    fd, info = open_regular(good, tmp_path)
    try:
        assert (info.st_ino, info.st_size) == (good.stat().st_ino, good.stat().st_size)
        assert os.read(fd, 8) == good.read_bytes()[:8]
    finally:
        os.close(fd)


def test_a_file_of_another_directory_is_refused(tmp_path: Path) -> None:
    good, expect = _good(tmp_path)
    (tmp_path / "sub").mkdir()
    elsewhere = tmp_path / "sub" / good.name
    elsewhere.write_bytes(good.read_bytes())
    _refused(elsewhere, tmp_path, expect, r"^is not a file of the store directory .*; not read$")


def _swap_on_open(monkeypatch: pytest.MonkeyPatch, target: Path, swap: Callable[[], None]) -> None:
    real_open = os.open

    def open_after_swap(path: Any, *args: Any, **kwargs: Any) -> int:
        if Path(path).name == target.name:  # opened relative to the directory's fd
            swap()
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_after_swap)


def test_a_file_swapped_between_its_check_and_its_open_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good, expect = _good(tmp_path)
    blob = good.read_bytes()

    def replace_by_a_copy() -> None:  # the same bytes under another inode
        (tmp_path / "copy").write_bytes(blob)
        os.replace(tmp_path / "copy", good)

    _swap_on_open(monkeypatch, good, replace_by_a_copy)
    _refused(good, tmp_path, expect, r"^was replaced while it was opened; not read$")

    target = tmp_path / "target.safetensors"
    target.write_bytes(blob)
    (tmp_path / "link").symlink_to(good.name)
    _swap_on_open(monkeypatch, target, lambda: os.replace(tmp_path / "link", target))  # a link put in its place
    _refused(target, tmp_path, expect, r"^is a symbolic link; links are not followed$")

    gone = tmp_path / "gone.safetensors"
    gone.write_bytes(blob)
    _swap_on_open(monkeypatch, gone, gone.unlink)
    _refused(gone, tmp_path, expect, r"^missing on disk$")


@pytest.mark.parametrize(
    ("change", "pattern"),
    [(lambda p: os.truncate(p, p.stat().st_size // 2), "shrank"), (lambda p: p.open("ab").write(b"x" * 64), "grew")],
    ids=["shrinks", "grows"],
)
@pytest.mark.filterwarnings("ignore:unclosed file:ResourceWarning")  # "grows" leaves its file to the collector
def test_a_file_that_changes_size_while_it_is_read_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: Callable[[Path], Any], pattern: str
) -> None:
    good, expect = _good(tmp_path)
    blob, real_fstat = good.read_bytes(), os.fstat

    def fstat_then_change(fd: int) -> os.stat_result:
        info = real_fstat(fd)
        change(good)  # after the size check, before the read
        return info

    def restore() -> None:  # in place, so that each read (read_shard, shard_problem) sees the change
        with good.open("r+b") as handle:
            handle.write(blob)
            handle.truncate()

    _swap_on_open(monkeypatch, good, restore)

    monkeypatch.setattr(os, "fstat", fstat_then_change)
    _refused(good, tmp_path, ShardExpectation(expect.bytes, None, expect.required), rf"^{pattern} while it was read")


def test_size_checksum_and_key_mismatches_are_refused(tmp_path: Path) -> None:
    good, expect = _good(tmp_path)
    size = expect.bytes
    bigger = ShardExpectation(size + 1, expect.sha256, expect.required)
    _refused(
        good, tmp_path, bigger, rf"^size mismatch, {size} bytes on disk but {size + 1} in the index \(truncated or"
    )
    wrong_sha = ShardExpectation(size, "0" * 64, expect.required)
    _refused(good, tmp_path, wrong_sha, rf"^checksum mismatch, sha256 {expect.sha256} on disk but 0{{64}} in the index")
    # an index that leaves out record 3 of batch 0 (a partial gradient otherwise)
    fewer = ShardExpectation(size, expect.sha256, frozenset(k for k in expect.required if not k.startswith("b0/r3/")))
    _refused(
        good, tmp_path, fewer, r"^holds 2 tensor key\(s\) the index does not list: b0/r3/grad.scale, b0/r3/grad.weight$"
    )
    more = ShardExpectation(size, expect.sha256, expect.required | {f"b0/r9/k{i}" for i in range(7)})
    _refused(good, tmp_path, more, r"^lacks 7 tensor key\(s\) the index lists: b0/r9/k0, .*, b0/r9/k4 and 2 more$")


def _rewritten(
    path: Path, expect: ShardExpectation, edit: Callable[[dict[str, torch.Tensor]], object]
) -> ShardExpectation:
    """The shard rewritten by safetensors with its tensors edited; the index's keys unchanged."""
    tensors = _reference(path)
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "metastore", "encoding": "fp16"})
    return ShardExpectation(path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest(), expect.required)


def test_an_extra_or_missing_tensor_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.safetensors"
    expect = _write(path, "fp16")
    extra = _rewritten(path, expect, lambda t: t.update({"b0/r0/extra": torch.zeros(2)}))
    _refused(path, tmp_path, extra, r"^holds 1 tensor key\(s\) the index does not list: b0/r0/extra$")
    _write(path, "fp16")
    lacking = _rewritten(path, expect, lambda t: t.pop("b0/r0/prefix"))
    _refused(path, tmp_path, lacking, r"^lacks 1 tensor key\(s\) the index lists: b0/r0/prefix$")


def test_an_fp16_shard_without_its_scales_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.safetensors"
    expect = _write(path, "fp16")

    def drop_scales(tensors: dict[str, torch.Tensor]) -> None:
        for key in [k for k in tensors if k.endswith(".scale") and k[: -len(".scale")] in tensors]:
            del tensors[key]

    unscaled = _rewritten(path, expect, drop_scales)
    problem = _refused(path, tmp_path, unscaled, r"^lacks 8 tensor key\(s\) the index lists: b0/r0/prefix.scale, ")
    assert problem.endswith(" and 3 more")


pytestmark = pytest.mark.usefixtures("no_leaked_descriptors")
