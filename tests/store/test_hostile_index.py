"""Hostile manifest and journal files (issue 18): files that are not regular, huge files and lines, journal
fields out of range or that JSON cannot hold, and problem lines that stay short however large the damage.

Each hostile input gives a one-line ``StoreError`` naming the file, or a journal line ignored and listed
by ``verify()`` (the other lines stay readable), promptly and within bounded memory; no file outside the
store is read. Manifest fields and names: test_hostile_manifests.py.
"""

from __future__ import annotations

import json
import os
import re
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hostilecases import (
    PROMPT,
    Expected,
    build_store,
    check,
    column,
    edit_line,
    edit_text,
    journal,
    journal_objects,
    of_shard,
    resync,
    shard,
    unpacked,
    within,
    write_batches,
)
from safetensors.torch import save_file

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.store.shards import journal as journal_module

MiB = 2**20


def _open_measured(path: Path) -> dict[str, Any]:
    """What opening a store gives (its problems and sample ids, or the error), and the peak of memory
    allocated meanwhile (``tracemalloc``: Python objects, numpy arrays and I/O buffers)."""
    tracemalloc.start()
    try:
        try:
            store = within(PROMPT, lambda: open_store(path))
            out: dict[str, Any] = {"problems": store.verify(), "sample_ids": store.sample_ids().tolist()}
            out["store"] = store
        except StoreError as exc:
            out = {"error": str(exc)}
        out["peak"] = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return out


@pytest.fixture
def store4(tmp_path: Path) -> tuple[Path, Expected]:
    """Four fp32 shards of one batch each (sample ids 0..15), in ``tmp_path / "store"``."""
    path = tmp_path / "store"
    return path, build_store(path)


def _assert_refused(path: Path, name: str, what: str) -> None:
    with pytest.raises(StoreError, match=what) as raised:
        within(PROMPT, lambda: open_store(path))
    assert f"{path / name}:" in str(raised.value) and "\n" not in str(raised.value)


# -- manifests and journals that are not regular files of the store -----------------------------------


@pytest.mark.parametrize("name", ["manifest-rank0.json", "index-rank0.jsonl"])
@pytest.mark.parametrize(
    ("make", "what"),
    [
        (lambda p, n: p.symlink_to("/etc/passwd"), "is a symbolic link; links are not followed"),
        (lambda p, n: p.symlink_to("/dev/zero"), "is a symbolic link; links are not followed"),
        (lambda p, n: p.symlink_to(p.parent.parent / "elsewhere" / n), "is a symbolic link; links are not followed"),
        (lambda p, n: p.symlink_to(p.with_name("copy")), "is a symbolic link; links are not followed"),  # inside
        (lambda p, n: os.mkfifo(p), "is a FIFO, not a regular file; not read"),
        (lambda p, n: p.mkdir(), "is a directory"),
    ],
)
def test_a_manifest_or_journal_that_is_not_a_regular_file_is_refused_unread(
    store4: tuple, name: str, make: Any, what: str
) -> None:
    if what.startswith("is a FIFO") and not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    path, _ = store4
    build_store(path.parent / "elsewhere", shards=1)  # a valid store outside: its files must not be merged
    (path / name).rename(path / "copy")
    make(path / name, name)
    _assert_refused(path, name, what)


def test_a_manifest_over_the_size_cap_is_refused_before_it_is_read(store4: tuple) -> None:
    path, _ = store4
    os.truncate(path / "manifest-rank0.json", 300 * MiB)  # sparse: costs no disk
    out = _open_measured(path)
    assert out["error"].endswith(
        "manifest-rank0.json: manifest of 314572800 bytes is larger than the 268435456 bytes a reader accepts"
    )
    assert out["peak"] < 64 * MiB  # nothing of it was read


def test_a_200_mb_manifest_is_parsed_within_bounded_memory(tmp_path: Path) -> None:
    head = b'{"format":"metastore","schema_version":2,"rank":0,"layers":{},"config":{"x":"'
    with open(tmp_path / "manifest-rank0.json", "wb") as handle:
        handle.write(head)
        for _ in range(25):
            handle.write(b"a" * (8 * MiB))
        handle.write(b'"}}')
    out = _open_measured(tmp_path)
    assert out["problems"] == [] and out["sample_ids"] == []
    assert out["peak"] < 4 * 200 * MiB + 64 * MiB  # the bytes, their text and the parsed string


def test_a_manifest_of_many_tiny_layers_is_parsed_within_bounded_memory(tmp_path: Path) -> None:
    layer = json.dumps({"params": {"w": "w"}, "param_shapes": {"w": [1]}, "layout": "out_in"}, separators=(",", ":"))
    layers = ",".join(f'"l{i:07d}":{layer}' for i in range(20_000))  # about 1.3 MiB
    text = '{"format":"metastore","schema_version":2,"rank":0,"config":{},"layers":{' + layers + "}}"
    (tmp_path / "manifest-rank0.json").write_text(text)
    out = _open_measured(tmp_path)
    assert out["problems"] == []
    assert out["peak"] < 20 * len(text) + 64 * MiB  # Python objects cost about 10 times their JSON text


def test_a_journal_line_over_256_mib_is_ignored_and_the_next_lines_stay(store4: tuple) -> None:
    path, expected = store4
    lines = journal(path).read_bytes().splitlines(keepends=True)
    with open(journal(path), "wb") as handle:
        handle.write(lines[0] + b'{"file":"rank0-000001.safetensors","x":"')
        handle.truncate(handle.tell() + 300 * MiB)  # a sparse line of 300 MiB
        handle.seek(0, os.SEEK_END)
        handle.write(b'"}\n' + b"".join(lines[2:]))
    out = _open_measured(path)
    assert out["problems"][0] == "index-rank0.jsonl line 2: longer than the 268435456 bytes a reader accepts; ignored"
    assert out["problems"][1].startswith("rank0-000001.safetensors: a file not listed in the index")
    assert len(out["problems"]) == 2 and out["sample_ids"] == [0, 1, 2, 3, *range(8, 16)]
    assert out["peak"] < 3 * 256 * MiB  # a line's worth (read in chunks, then joined), not the file
    check(out["store"], of_shard(expected, 3))


def test_overlong_lines_are_skipped_to_their_end_and_a_writer_appends_after_the_last_whole_line(
    store4: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, expected = store4
    monkeypatch.setattr(journal_module, "MAX_LINE_BYTES", MiB)  # the same code path as 256 MiB, cheaper
    lines = journal(path).read_bytes().splitlines(keepends=True)
    garbage = b"x" * (3 * MiB + 12345)
    journal(path).write_bytes(lines[0] + garbage + b"\n" + b"".join(lines[2:]) + garbage)  # the last one torn
    store = open_store(path)
    problems = store.verify()
    assert [p.split(":")[0] for p in problems] == ["index-rank0.jsonl line 2", "index-rank0.jsonl line 5"] + [
        "rank0-000001.safetensors"
    ]
    for i in (0, 2, 3):
        check(store, of_shard(expected, i))
    with StoreWriter(path, encoding="fp32", shard_bytes=1) as writer:  # cuts the torn tail, appends after line 4
        more = write_batches(writer, range(4, 5))
    assert journal(path).read_bytes().startswith(lines[0] + garbage + b"\n" + b"".join(lines[2:]))
    assert journal(path).read_bytes().endswith(b"\n") and len(open_store(path).verify()) == 2
    check(open_store(path), more | of_shard(expected, 3))


# -- journal fields: each bad line is ignored and listed, the others stay readable ------------------


def _set(group: str, key: str, values: Any, code: str) -> Any:
    return lambda e: e[group].__setitem__(key, column(values, code) if code else values)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda e: e.update(bytes="12"), "bytes must be a byte count"),
        (lambda e: e.update(bytes=2**60), "bytes must be a byte count"),
        (lambda e: e.update(sha256="../../etc"), "sha256 must be 64 hex digits"),
        (lambda e: e.update(encoding="pickle"), "encoding must be one of"),
        (lambda e: e.update(layers=["fc", "nope"]), r"layers \['nope'\] are not in the rank's manifest"),
        (lambda e: e.update(capture_points=[]), r"batches.capture_point holds values outside \[0, 0\)"),
        (lambda e: e.pop("batches"), "batches must be an object of packed columns"),
        (_set("batches", "step", "0", ""), r"batches.step must be \[dtype code, base64 text\]"),
        (
            _set("batches", "step", [2**63 - 1], "i8"),
            r"batches.step holds values outside \[-9.0072e\+15, 9.0072e\+15\)",
        ),
        (_set("batches", "step", [2**53], "i8"), "batches.step holds values outside"),
        (_set("batches", "epoch", [-(2**53) - 1], "i8"), "batches.epoch holds values outside"),
        (_set("batches", "step", [1.5], "f8"), "batches.step must be integers; got float64"),
        (_set("batches", "size", [-3], "i8"), "batches.size holds values outside"),
        (_set("batches", "lr", "fast", ""), r"batches.lr must be \[dtype code, base64 text\]"),
        (_set("batches", "lr", [float("inf")], "f8"), r"batches.lr must be finite floats \(NaN: none given\)"),
        (_set("batches", "lr", [float("-inf")], "f4"), "batches.lr must be finite floats"),
        (_set("batches", "lr", [1], "i8"), "batches.lr must be finite floats"),
        (_set("batches", "lr", [1.0], "f2"), r"batches.lr must be \[dtype code, base64 text\] with a code of"),
        (_set("batches", "lr", ["e4m3", "AA=="], ""), r"batches.lr must be \[dtype code"),  # float8: unknown
        (_set("batches", "lr", ["f8", "A*=="], ""), "batches.lr is not valid base64"),
        (_set("batches", "lr", ["f8", "AAAA"], ""), "batches.lr holds 3 bytes, not a whole number of f8 values"),
        (_set("batches", "meta", [16], "u1"), r"batches.meta holds values outside \[0, 16\)"),
        (_set("batches", "capture_point", [1], "i4"), r"batches.capture_point holds values outside \[0, 1\)"),
        (_set("batches", "epoch", [0, 0], "i8"), "batches columns must have one equal, positive length"),
        (_set("batches", "weird", [0], "i8"), r"batches has unknown column\(s\) \['weird'\]"),
        (_set("records", "rows", [8], "i8"), "records columns must have one length"),
        (_set("records", "layer", [0, 7], "i4"), r"records.layer holds values outside \[0, 2\)"),
        (_set("records", "layer", [0, -1], "i4"), r"records.layer holds values outside \[0, 2\)"),
        (_set("records", "kind", [0, 7], "u1"), r"records.kind holds values outside \[0, 5\)"),
        (_set("records", "batch", [1, 0], "i4"), r"records.batch holds values outside \[0, 1\)"),
        (
            _set("records", "rows", [8, 3], "i8"),
            "records.rows of a dense, projected or norms record must equal its batch.s size",
        ),
        (_set("records", "bytes", [2**62, 1], "i8"), "records.bytes holds values outside"),
        (_set("samples", "sample_id", [1, 2, 3], "i8"), r"samples columns must have one row per sample \(4\)"),
        (_set("samples", "label", [True] * 4, "b1"), "samples.label must be numbers; got bool"),
        (_set("samples", "loss", [1] * 4, "i4"), "samples.loss must be floats; got int32"),
        (_set("samples", "margin", [1] * 4, "i8"), "samples.margin must be floats; got int64"),
        (lambda e: e["samples"].pop("sample_id"), r"samples lacks column\(s\) \['sample_id'\]"),
        (lambda e: e.update(capture_points=["\x1b]0;x\x07"]), r"capture_points name holds control characters"),
        (lambda e: e.update(layers=["fc", "ln\x1b[2K"]), r"layers name holds control characters"),
        (lambda e: e.update(capture_points=["x" * 1025]), r"capture_points name is longer than 1024 characters"),
    ],
)
def test_a_journal_line_with_a_bad_field_is_ignored_and_listed(store4: tuple, edit: Any, message: str) -> None:
    path, expected = store4
    edit_line(path, 1, edit)
    store = within(PROMPT, lambda: open_store(path))
    problems = store.verify()
    assert problems[0].startswith("index-rank0.jsonl line 2: ") and problems[0].endswith("; ignored")
    assert re.search(message, problems[0]), problems[0]
    assert "\x1b" not in problems[0] and len(problems) == 2  # and shard 1, now unlisted
    assert store.summary()["index_problems"] == 1
    assert store.sample_ids().tolist() == [0, 1, 2, 3, *range(8, 16)]
    for i in (0, 2, 3):
        check(store, of_shard(expected, i))


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ('"bytes":', '"bytes":1' + "0" * 4400 + ',"x":', "damaged: not JSON"),  # a number of 4400 digits
        ('"bytes":', '"bytes":1e400,"x":', "bytes must be a byte count"),
        ('"bytes":', '"bytes":NaN,"x":', "bytes must be a byte count"),
        ('"bytes":', '"x":' + "[" * 100_000 + "]" * 100_000 + ',"bytes":', "damaged: not JSON"),  # deep nesting
    ],
)
def test_journal_text_that_json_cannot_hold_is_ignored(store4: tuple, old: str, new: str, message: str) -> None:
    path, _ = store4
    edit_text(path, 1, old, new)
    store = within(PROMPT, lambda: open_store(path))
    assert store.verify()[0].startswith(f"index-rank0.jsonl line 2: {message}")
    assert store.sample_ids().tolist() == [0, 1, 2, 3, *range(8, 16)]


def test_nan_lr_means_none_and_a_shard_listed_twice_is_read_once(store4: tuple) -> None:
    path, expected = store4
    edit_line(path, 1, _set("batches", "lr", [float("nan")], "f8"))
    with open(journal(path), "ab") as handle:
        handle.write(journal(path).read_bytes().splitlines(keepends=True)[0])
    store = open_store(path)
    assert store.verify() == ["index-rank0.jsonl line 5: lists rank0-000000.safetensors again; ignored"]
    assert store.batch_refs()[1].lr is None and store.sample_ids().tolist() == list(range(16))
    check(store, expected)


# -- problem lines stay short ---------------------------------------------------------------------------


def test_verify_of_a_shard_listed_with_400k_batches_gives_short_lines_promptly(store4: tuple) -> None:
    path, expected = store4
    extra, records = 400_000 - 1, 100_000

    def many(entry: dict[str, Any]) -> None:
        """Batch 0 as written, then 399,999 batches of one sample; the first 100,000 with a dense record."""
        for key, (code, _) in entry["batches"].items():
            fill = 1 if key == "size" else 0
            entry["batches"][key] = column(np.r_[unpacked(entry["batches"][key]), np.full(extra, fill)], code)
        for key, (code, _) in entry["samples"].items():
            entry["samples"][key] = column(np.r_[unpacked(entry["samples"][key]), np.arange(extra) + 100], code)
        added: dict[str, Any] = {
            "batch": np.arange(records) + 1,
            "layer": 1,
            "kind": 2,
            "rows": 1,
            "bytes": 20,
            "dense_bytes": 20,
        }
        for key, (code, _) in entry["records"].items():
            values = np.broadcast_to(added[key], (records,))
            entry["records"][key] = column(np.r_[unpacked(entry["records"][key]), values], code)

    edit_line(path, 1, many)
    store = within(PROMPT, lambda: open_store(path))
    problems = within(6 * PROMPT, store.verify)  # linear in batches and records (no batch-by-record scan)
    assert problems == [
        "rank0-000001.safetensors: lacks 499999 tensor key(s) the index lists: b1/meta/sample_id, b1/r0/grad.weight,"
        " b10/meta/sample_id, b10/r0/grad.weight, b100/meta/sample_id and 499994 more"
    ]
    check(store, of_shard(expected, 2))


def test_opening_a_store_allocates_far_less_than_the_caps(store4: tuple) -> None:
    assert _open_measured(store4[0])["peak"] < 16 * MiB  # not the 256 MiB a manifest or a line may take


def test_verify_names_five_batches_with_wrong_sample_ids_and_counts_the_rest(store4: tuple) -> None:
    path, _ = store4
    n = 2000
    save_file({f"b{j}/meta/sample_id": torch.tensor([j]) for j in range(n)}, str(shard(path, 1)))
    entry = journal_objects(path)[1]
    entry.update(layers=[], capture_points=["train"])
    entry["batches"] = {k: column(np.full(n, 1 if k == "size" else 0), "i8") for k in entry["batches"]}
    entry["batches"]["lr"] = column(np.full(n, np.nan), "f8")
    entry["records"] = {k: column([], "i8") for k in entry["records"]}
    entry["samples"] = {"sample_id": column(np.arange(n) + 1, "i8")}  # each one off
    edit_line(path, 1, lambda e: e.update(entry))
    resync(path, 1)
    problems = open_store(path).verify()
    assert problems == [
        "rank0-000001.safetensors: batches b0, b1, b2, b3, b4 and 1995 more do not hold the sample ids the index lists"
    ]
