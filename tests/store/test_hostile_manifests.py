"""Hostile manifests (issue 18): fields out of bounds, version 1 manifests, names that only look like
manifests, a rank that is not its file name's, and terminal escapes that must never reach the terminal.

Each gives a one-line ``StoreError`` naming the manifest, or is not read at all (names that are not
manifests); a journal line with a hostile name is ignored and listed by ``verify()``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hostilecases import (
    PROMPT,
    Expected,
    build_store,
    check,
    edit_line,
    golden_v1,
    manifest,
    of_shard,
    save_manifest,
    within,
)

from metastore_plugins import open_store
from metastore_plugins.cli import main
from metastore_plugins.core.errors import StoreError


@pytest.fixture
def store4(tmp_path: Path) -> tuple[Path, Expected]:
    """Four fp32 shards of one batch each (sample ids 0..15), in ``tmp_path / "store"``."""
    path = tmp_path / "store"
    return path, build_store(path)


# -- manifest fields: bounds, names; version 1 manifests ---------------------------------------------


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m["layers"]["fc"]["param_shapes"].update(weight=[10**12, 6]), r"param_shapes\['weight'\] must be"),
        (lambda m: m["layers"]["fc"]["param_shapes"].update(weight=[1e12]), r"param_shapes\['weight'\] must be"),
        (lambda m: m["layers"]["fc"]["param_shapes"].update(weight=[2**20, 2**20]), r"of at most 17179869184 elem"),
        (lambda m: m["layers"]["fc"]["param_shapes"].update(weight=[1] * 9), r"at most 8 sizes"),
        (lambda m: m["layers"]["fc"].pop("layout"), '"layout" must be one of'),
        (lambda m: m["layers"].update({"\x1b]0;x\x07": m["layers"]["fc"]}), r"name holds control characters"),
        (lambda m: m["layers"].update({"\x1b[2K\rproblems: none": m["layers"]["fc"]}), r"holds control characters"),
        (lambda m: m["layers"]["fc"]["params"].update(weight="fc.weight\x9b"), '"params" must map roles'),
        (lambda m: m["layers"].update({"x" * 1025: m["layers"]["fc"]}), "name is longer than 1024 characters"),
        (lambda m: m["layers"]["fc"]["params"].update(weight=""), '"params" must map roles'),
        (lambda m: m.update(rank=10**12), '"rank" must be an integer in 0..10\\^9'),
    ],
)
def test_manifest_fields_out_of_bounds_are_refused_at_open(store4: tuple, edit: Any, message: str) -> None:
    path, _ = store4
    content = manifest(path)
    edit(content)
    save_manifest(path, content)
    with pytest.raises(StoreError, match=message) as raised:
        within(PROMPT, lambda: open_store(path))
    assert "manifest-rank0.json" in str(raised.value) and "\n" not in str(raised.value)
    assert "\x1b" not in str(raised.value) and "\x9b" not in str(raised.value)


def test_a_manifest_holding_a_number_of_5000_digits_is_refused(store4: tuple) -> None:
    path, _ = store4
    text = (path / "manifest-rank0.json").read_text().replace('"rank":0', '"rank":' + "9" * 5000)
    (path / "manifest-rank0.json").write_text(text)
    with pytest.raises(StoreError, match="cannot read manifest .*manifest-rank0.json: Exceeds the limit"):
        open_store(path)


# -- version 1 manifests (still read: a copy of the golden store) ---------------------------------


@pytest.mark.parametrize("name", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/x.safetensors", 7])
def test_version_1_shard_paths_outside_the_run_directory_are_refused(tmp_path: Path, name: Any) -> None:
    path = golden_v1(tmp_path / "store")
    content = manifest(path)
    content["shards"][0]["file"] = name
    save_manifest(path, content)
    with pytest.raises(StoreError, match=r"manifest-rank0.json: shards\[0\].file .*(plain|string)"):
        open_store(path)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.update(shards={}), '"shards" must be a list'),
        (lambda m: m["shards"][1].update(bytes="12"), r"shards\[1\].bytes must be a byte count"),
        (lambda m: m["shards"][1].update(sha256="../../etc"), r"shards\[1\].sha256 must be 64 hex digits"),
        (lambda m: m["shards"][1].update(encoding="pickle"), r"shards\[1\].encoding must be one of"),
        (
            lambda m: m["shards"][0]["batches"][1].update(step="0"),
            r"shards\[0\].batches\[1\].step must be an integer within ±2\^53; got '0'",
        ),
        (lambda m: m["shards"][0]["batches"][0].update(size=-3), r"batches\[0\].size must be a sample count"),
        (lambda m: m["shards"][0]["batches"][0].update(lr="fast"), r"batches\[0\].lr must be a finite number"),
        (lambda m: m["shards"][0]["batches"][0].pop("lr"), r"batches\[0\].lr is missing"),
        (lambda m: m["shards"][0]["batches"][0].update(lr=float("nan")), r"batches\[0\].lr must be a finite number"),
        (lambda m: m["shards"][0]["batches"][0].update(lr=float("inf")), r"batches\[0\].lr must be a finite number"),
        (lambda m: m["shards"][0]["batches"][0].update(step=2**63 - 1), r"batches\[0\].step must be an integer within"),
        (lambda m: m["shards"][0]["batches"][0].update(rank=1), r"batches\[0\].rank must equal the manifest's rank"),
        (lambda m: m["shards"][0]["batches"][0].update(capture_point="\x1b]0;x\x07"), r"holds control characters"),
        (
            lambda m: m["shards"][0]["batches"][0]["records"][0].update(layer="nope"),
            r"records\[0\].layer is not in",
        ),
        (
            lambda m: m["shards"][0]["batches"][0]["records"][1].update(kind="sparse"),
            r"records\[1\].kind must be one of",
        ),
        (
            lambda m: m["shards"][0]["batches"][0]["records"][1].pop("dense_bytes"),
            r"records\[1\].dense_bytes must be a non-negative integer",
        ),
        (lambda m: m["shards"].append(dict(m["shards"][0])), '"shards" lists a shard file twice'),
    ],
)
def test_malformed_version_1_manifests_raise_a_clear_store_error(tmp_path: Path, edit: Any, message: str) -> None:
    path = golden_v1(tmp_path / "store")
    content = manifest(path)
    edit(content)
    save_manifest(path, content)
    with pytest.raises(StoreError, match=message) as raised:
        open_store(path)
    assert "manifest-rank0.json" in str(raised.value) and "\n" not in str(raised.value)


# -- file names ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "manifest-rank\u0661.json",  # ARABIC-INDIC DIGIT ONE
        "manifest-rank\uff11.json",  # FULLWIDTH DIGIT ONE
        "manifest-rank1.json\n",
        "manifest-rank001.json",
        "manifest-rank01.json",
        "manifest-rank-1.json",
        " manifest-rank1.json",
        "manifest-rank1.json.bak",
        "manifest-rank1.JSON",
    ],
)
def test_names_that_only_look_like_manifests_are_not_read(store4: tuple, tmp_path: Path, name: str) -> None:
    path, expected = store4
    other = manifest(path)
    other["rank"] = 1
    (path / name).write_text(json.dumps(other))
    store = open_store(path)
    assert store.ranks() == [0] and store.verify() == []
    check(store, of_shard(expected, 0))
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    (lonely / name).write_text(json.dumps(other))
    with pytest.raises(StoreError, match="is not a metastore store: it holds no manifest-rank"):
        open_store(lonely)


def test_a_manifest_whose_rank_is_not_its_file_names_is_refused(store4: tuple) -> None:
    path, _ = store4
    (path / "manifest-rank1.json").write_bytes((path / "manifest-rank0.json").read_bytes())
    with pytest.raises(StoreError, match=r"manifest-rank1.json: \"rank\" is 0 but the file name says rank 1"):
        open_store(path)


# -- terminal escapes never reach the terminal -----------------------------------------------------


def test_inspect_prints_no_escape_from_hostile_names(store4: tuple, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = store4
    edit_line(path, 1, lambda e: e.update(capture_points=["\x1b[2K\rproblems: none"]))
    edit_line(path, 2, lambda e: e.update(capture_points=["\x1b]0;owned\x07"]))
    (path / "rank0-000009.safetensors.tmp").write_bytes(b"")
    assert main(["inspect", str(path)]) == 1
    out, err = capsys.readouterr()
    assert "\x1b" not in out + err and "\r" not in out + err and "\x07" not in out + err
    assert [line for line in out.splitlines() if line.startswith("problems:")] == ["problems: "]
    assert "index-rank0.jsonl line 2: capture_points name holds control characters" in out
    content = manifest(path)
    content["layers"]["fc\x1b[2K"] = content["layers"]["fc"]
    save_manifest(path, content)
    assert main(["inspect", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "\x1b" not in err and "manifest-rank0.json" in err
