"""Hostile shards (issue 18): absurd headers, keys the index does not list or lacks, shards replaced,
linked or truncated after a first read, and listed shards that are not regular files.

Each gives a ``StoreError`` on one line naming the file (and the key), or one ``verify()`` line, promptly;
a shard is never read through a link, and a changed shard never yields another sample's gradient.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from hostilecases import (
    PROMPT,
    Expected,
    build_store,
    check,
    column,
    edit_line,
    of_shard,
    resync,
    shard,
    unpacked,
    within,
)
from safetensors.torch import load_file, save_file

from metastore_plugins import open_store
from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.store.reading import batches

HERE = Path(__file__).resolve().parent


@pytest.fixture
def store4(tmp_path: Path) -> tuple[Path, Expected]:
    """Four fp32 shards of one batch each (sample ids 0..15), in ``tmp_path / "store"``."""
    path = tmp_path / "store"
    return path, build_store(path)


# -- hostile shard contents, consistent with their journal lines --------------------------------------


def _replace_shard(path: Path, i: int, data: bytes) -> Path:
    """Write ``data`` as shard ``i`` and make its journal line agree with it (a consistent, hostile store)."""
    victim = shard(path, i)
    victim.write_bytes(data)
    resync(path, i)
    return victim


def _edited_shard(path: Path, i: int, **changes: torch.Tensor | None) -> bytes:
    tensors = load_file(str(shard(path, i)))
    for key, value in changes.items():
        key = key.replace("__", "/")
        if value is None:
            del tensors[key]
        else:
            tensors[key] = value
    out = path.parent / "edited.safetensors"
    save_file(tensors, str(out), metadata={"format": "metastore", "encoding": "fp32"})
    data = out.read_bytes()
    out.unlink()
    return data


def _header(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _hostile_header(original: bytes, key: str, **fields: Any) -> bytes:
    """The shard ``original`` with ``fields`` of tensor ``key`` in its header changed (same data section)."""
    length = struct.unpack("<Q", original[:8])[0]
    header = json.loads(original[8 : 8 + length])
    header[key].update(fields)
    text = json.dumps(header).encode()
    return _header(text + b" " * (-len(text) % 8)) + original[8 + length :]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (lambda _: struct.pack("<Q", 2**62) + b"{}", "a header of 4611686018427387904 bytes, larger than"),
        (
            lambda d: _hostile_header(d, "b0/r0/prefix", shape=[1000000000], data_offsets=[0, 4000000000]),
            r"tensor b0/r0/prefix has data_offsets \[0, 4000000000\] that do not fit",  # beyond the file
        ),
        (
            lambda d: _hostile_header(d, "b0/r0/suffix", data_offsets=[0, 160]),
            "tensors b0/.* and b0/r0/suffix overlap",
        ),
        (lambda d: _hostile_header(d, "b0/r0/suffix", dtype="F8_E4M3"), "tensor b0/r0/suffix has dtype 'F8_E4M3'"),
        (lambda d: _hostile_header(d, "b0/r0/suffix", shape=[-8, 1, 5]), "tensor b0/r0/suffix has no valid shape"),
        (
            lambda _: _header(b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}') + bytes(8),
            "header is not valid UTF-8 JSON",
        ),
        (lambda _: _header(b"[1, 2]"), "header is not a JSON object"),
        (lambda _: b"abc", "shorter than its 8-byte header length"),
        (lambda _: b"", "shorter than its 8-byte header length"),
    ],
)
def test_absurd_safetensors_headers_raise_a_clear_error(store4: tuple, data: Any, message: str) -> None:
    path, expected = store4
    victim = _replace_shard(path, 1, data(shard(path, 1).read_bytes()))
    store = open_store(path)
    with pytest.raises(StoreError, match=rf"{re.escape(victim.name)}: not a readable safetensors file \(.*{message}"):
        store.restore(5)
    problems = store.verify()
    assert len(problems) == 1 and problems[0].startswith(f"{victim.name}: not a readable safetensors file")
    check(store, of_shard(expected, 0))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"b0__meta__sample_id": torch.arange(4).float() + 4},
            r"tensor b0/meta/sample_id does not hold the 4 sample ids the index lists",
        ),
        ({"b0__meta__sample_id": torch.arange(8)}, r"b0/meta/sample_id does not hold the 4 sample ids"),
        ({"b0__meta__sample_id": torch.arange(4)}, r"b0/meta/sample_id does not hold the 4 sample ids"),
        ({"b0__meta__sample_id": None}, r"lacks 1 tensor key\(s\) the index lists: b0/meta/sample_id"),
        ({"b0__meta__label": None}, r"lacks 1 tensor key\(s\) the index lists: b0/meta/label"),
        ({"b0__meta__loss": torch.zeros(4)}, r"holds 1 tensor key\(s\) the index does not list: b0/meta/loss"),
        ({"b0__r0__prefix": torch.zeros(8, 6)}, r"b0/r0/prefix must be \(R, G, d_in\)"),
        ({"b0__r0__prefix": torch.zeros(8, 1, 7)}, r"b0/r0/prefix and suffix do not make a weight of shape"),
        ({"b0__r0__suffix": torch.zeros(7, 1, 5)}, r"b0/r0/prefix has 8 rows, suffix has 7"),
        ({"b0__r0__sample": torch.zeros(8)}, r"b0/r0/sample must be a 1-d integer tensor; got torch.float32"),
        ({"b0__r0__sample": torch.full((8,), 9, dtype=torch.int32)}, r"b0/r0/sample holds samples outside 0..3"),
        (
            {"b0__r0__sample": torch.tensor([3, 3, 2, 2, 1, 1, 0, 0], dtype=torch.int32)},
            r"b0/r0/sample is not grouped",
        ),
        ({"b0__r0__position": None}, r"lacks 1 tensor key\(s\) the index lists: b0/r0/position"),
        ({"b0__r1__grad.weight": torch.zeros(4, 6)}, r"b0/r1/grad.weight must be float \(4, 5\)"),
        ({"b0__r1__grad.weight": torch.zeros(4, 5, dtype=torch.int32)}, r"b0/r1/grad.weight must be float"),
        ({"b0__r1__grad.weight": None}, r"lacks 1 tensor key\(s\) the index lists: b0/r1/grad.weight"),
        ({"b0__r0__prefix.scale": torch.ones(3)}, r"holds 1 tensor key\(s\) .* not list: b0/r0/prefix.scale"),
        ({"b0__r0__extra": torch.zeros(2)}, r"holds 1 tensor key\(s\) the index does not list: b0/r0/extra"),
        ({"b0__r2__grad.weight": torch.zeros(4, 5)}, r"holds 1 tensor key\(s\) .* not list: b0/r2/grad.weight"),
    ],
)
def test_wrong_keys_dtypes_and_shapes_raise_a_store_error_naming_the_key(
    store4: tuple, changes: dict, message: str
) -> None:
    path, expected = store4
    victim = _replace_shard(path, 1, _edited_shard(path, 1, **changes))
    store = open_store(path)
    problems = store.verify()  # keys, sample ids, and (issue 44) the dtypes and shapes queries refuse
    assert len(problems) == 1 and all(victim.name in problem for problem in problems)
    with pytest.raises(StoreError, match=rf"{re.escape(victim.name)}: .*{message}") as raised:
        store.restore(5)
    assert "\n" not in str(raised.value)
    with pytest.raises(StoreError, match=re.escape(victim.name)):
        store.norms()
    check(store, of_shard(expected, 2))


def test_a_header_of_1_2_million_empty_tensors_is_refused_before_it_is_parsed(store4: tuple) -> None:
    path, expected = store4
    entries = ",".join(f'"e{i}":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}' for i in range(1_200_000))
    text = ("{" + entries + "}").encode()
    victim = _replace_shard(path, 1, _header(text + b" " * (-len(text) % 8)))
    for checksums in (True, False):
        store = open_store(path, checksums=checksums)
        start = time.monotonic()
        with pytest.raises(
            StoreError, match=rf"{victim.name}: .*a header of {len(text) + (-len(text) % 8)} bytes, larger"
        ):
            within(PROMPT, partial(store.restore, 5))
        assert time.monotonic() - start < PROMPT
        assert "bytes its index allows" in within(PROMPT, store.verify)[0]
    check(store, of_shard(expected, 0))


def test_an_fp16_shard_without_its_scales_is_refused_naming_the_keys(tmp_path: Path) -> None:
    path = tmp_path / "store"
    expected = build_store(path, shards=2, encoding="fp16")
    tensors = load_file(str(shard(path, 1)))
    scales = sorted(key for key in tensors if key.endswith(".scale"))
    assert scales == ["b0/r0/prefix.scale", "b0/r0/suffix.scale", "b0/r1/grad.weight.scale"]
    save_file({k: v for k, v in tensors.items() if k not in scales}, str(shard(path, 1)), {"format": "metastore"})
    resync(path, 1)
    store = open_store(path)
    message = "lacks 3 tensor key(s) the index lists: b0/r0/prefix.scale, b0/r0/suffix.scale, b0/r1/grad.weight.scale"
    with pytest.raises(StoreError, match=re.escape(f"{shard(path, 1).name}: {message}")):
        store.norms()  # never norms of unscaled values
    assert store.verify() == [f"{shard(path, 1).name}: {message}"]
    for sample, grads in of_shard(expected, 0).items():  # fp16 with a row scale: 2^-11 of each row's peak
        restored = store.restore(sample)
        for name, value in grads.items():
            torch.testing.assert_close(restored[name], value, rtol=0, atol=float(value.abs().max()) * 2**-10)


def test_a_journal_line_that_leaves_out_a_record_the_shard_holds_is_refused(store4: tuple) -> None:
    path, expected = store4

    def drop_last_record(entry: dict[str, Any]) -> None:
        for key, (code, _) in entry["records"].items():
            entry["records"][key] = column(unpacked(entry["records"][key])[:-1], code)

    edit_line(path, 1, drop_last_record)  # record 1 (the dense one) of batch 0 is not listed
    store = open_store(path)
    with pytest.raises(
        StoreError, match=rf"{shard(path, 1).name}: holds 1 tensor key\(s\) the index does not list: b0/r1/grad.weight"
    ):
        store.restore(5)  # never a partial gradient
    assert len(store.verify()) == 1
    check(store, of_shard(expected, 2))


# -- shards that change after a first read ---------------------------------------------------------


@pytest.mark.parametrize("checksums", [True, False])
@pytest.mark.parametrize("reopen", ["cache dropped", "new store"])
def test_a_shard_replaced_by_another_after_a_first_read_is_refused(
    store4: tuple, monkeypatch: pytest.MonkeyPatch, checksums: bool, reopen: str
) -> None:
    path, expected = store4
    store = open_store(path, checksums=checksums)
    check(store, of_shard(expected, 1))  # read and checked, now in memory
    assert shard(path, 1).stat().st_size == shard(path, 2).stat().st_size
    shard(path, 1).write_bytes(shard(path, 2).read_bytes())  # another valid shard of the same size
    check(store, of_shard(expected, 1))  # the checked copy in memory, not the file
    monkeypatch.setattr(batches, "MAX_OPEN_BYTES", 1)
    if reopen == "new store":
        store = open_store(path, checksums=checksums)
    else:
        store.restore(9)  # reading another shard drops it
    wrong = "checksum mismatch" if checksums else "b0/meta/sample_id does not hold the 4 sample ids the index lists"
    for sample in of_shard(expected, 1):
        with pytest.raises(StoreError, match=f"{shard(path, 1).name}: .*{wrong}"):
            store.restore(sample)  # never shard 2's gradient
    check(store, of_shard(expected, 2))


@pytest.mark.parametrize("target", ["inside", "outside"])
def test_a_shard_turned_into_a_link_after_a_first_read_is_refused(
    store4: tuple, monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    path, expected = store4
    store = open_store(path)
    check(store, of_shard(expected, 1))
    copy = (path if target == "inside" else path.parent) / "copy.safetensors"
    copy.write_bytes(shard(path, 1).read_bytes())  # the same bytes: only the link is wrong
    shard(path, 1).unlink()
    shard(path, 1).symlink_to(copy)
    monkeypatch.setattr(batches, "MAX_OPEN_BYTES", 1)
    store.restore(9)
    with pytest.raises(StoreError, match=f"{shard(path, 1).name}: is a symbolic link; links are not followed"):
        store.restore(5)
    assert open_store(path).verify() == [f"{shard(path, 1).name}: is a symbolic link; links are not followed"]


_TRUNCATE = """
import os, sys, threading
from pathlib import Path
import torch
from metastore_plugins import open_store
from metastore_plugins.core.store import StoreError
from metastore_plugins.core.store.reading import batches
path = Path(sys.argv[1])
victim = path / "rank0-000001.safetensors"
data = victim.read_bytes()
store = open_store(path)
before = store.restore(5)
os.truncate(victim, len(data) // 2)  # in place, while the store holds it
assert all(torch.equal(before[k], v) for k, v in store.restore(5).items())  # the checked copy in memory
batches.MAX_OPEN_BYTES = 1
store.restore(9)  # another shard: the truncated one is dropped
try:
    store.restore(5)
    raise SystemExit("a truncated shard was read")
except StoreError as exc:
    assert "size mismatch" in str(exc), exc
stop = threading.Event()
def flip():  # truncated and written back, over and over, while it is read
    while not stop.is_set():
        os.truncate(victim, len(data) // 3)
        with open(victim, "r+b") as handle:
            handle.write(data)
thread = threading.Thread(target=flip)
thread.start()
good = refused = 0
for _ in range(200):
    try:
        got = store.restore(5)
        assert all(torch.equal(before[k], v) for k, v in got.items()), "a wrong gradient"
        good += 1
    except StoreError:
        refused += 1
    store.restore(9)
stop.set()
thread.join()
print(good, refused)
"""


def test_a_shard_truncated_in_place_while_the_store_is_open_never_crashes(store4: tuple) -> None:
    path, _ = store4
    done = subprocess.run([sys.executable, "-c", _TRUNCATE, str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])  # -7: SIGBUS, a mapped file truncated
    good, refused = map(int, done.stdout.split())
    assert good + refused == 200


# -- listed shards that are not regular files --------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "what"),
    [
        (lambda p: os.mkfifo(p), "is a FIFO, not a regular file; not read"),
        (lambda p: p.mkdir(), "is a directory, not a regular file"),
        (lambda p: p.symlink_to(p.with_name("rank0-000002.safetensors")), "is a symbolic link; links are not followed"),
        (lambda p: p.symlink_to("/dev/null"), "is a symbolic link; links are not followed"),
        (lambda p: p.symlink_to("/dev/zero"), "is a symbolic link; links are not followed"),
        (lambda p: p.symlink_to(p.with_name("nowhere")), "is a symbolic link; links are not followed"),
    ],
)
def test_verify_lists_a_shard_that_is_not_a_regular_file_on_one_line(store4: tuple, make: Any, what: str) -> None:
    if "FIFO" in what and not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    path, expected = store4
    victim = shard(path, 1)
    victim.unlink()
    make(victim)
    store = open_store(path)
    assert within(PROMPT, store.verify) == [f"{victim.name}: {what}"]  # not "missing", not "outside", no hang
    with pytest.raises(StoreError, match=f"{victim.name}: {what}"):
        within(PROMPT, lambda: store.restore(5))
    check(store, of_shard(expected, 2))
