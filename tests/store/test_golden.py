"""The golden stores: small stores written once per format version by make_golden.py and committed.

They pin the on-disk format of docs/format.md. The reader must keep reading each of them
(listing, metadata, restored gradients equal to torch.func's): ``golden/store`` (version 1),
``golden/store_v2`` and ``golden/store_v3`` (version 3 adds the ``projected`` and ``norms``
record kinds, weight snapshots and tags to version 2: the same run writes the same files).
Today's writer must still write the files, keys, dtypes, manifest fields and journal columns of
the current version's store. If a change breaks this test, old stores no longer read the same:
bump ``schema_version`` and keep a reader for the old versions instead of regenerating a golden store.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from safetensors import safe_open
from storecases import journal_entries

from metastore_plugins import open_store
from metastore_plugins.core.store.shards import manifest as mf

GOLDEN = Path(__file__).resolve().parent / "golden"
STORE = GOLDEN / "store"  # version 1
STORE_V2 = GOLDEN / "store_v2"
STORE_V3 = GOLDEN / "store_v3"
STORES = pytest.mark.parametrize("store_dir", [STORE, STORE_V2, STORE_V3], ids=["v1", "v2", "v3"])
EXPECTED = json.loads((GOLDEN / "expected.json").read_text())
TOLERANCE = {"fp32": 1e-5, "int8": 2e-2}  # max |store - torch.func| / max |torch.func|, per parameter
SHARDS = ["rank0-000000.safetensors", "rank0-000001.safetensors", "rank1-000000.safetensors"]
FILES = {
    STORE: ["manifest-rank0.json", "manifest-rank1.json", *SHARDS],
    STORE_V2: ["index-rank0.jsonl", "index-rank1.jsonl", "manifest-rank0.json", "manifest-rank1.json", *SHARDS],
}
FILES[STORE_V3] = FILES[STORE_V2]


def _rows(cp: str) -> list[dict[str, Any]]:
    """Expected rows of a capture point in selection order: (step, micro-batch, rank), then batch order."""
    rows = [r for r in EXPECTED["samples"] if r["capture_point"] == cp]
    return sorted(rows, key=lambda r: (r["step"], r["micro_batch"], r["rank"]))  # stable: batch order kept


@STORES
def test_the_golden_store_is_small_and_complete(store_dir: Path) -> None:
    assert sorted(p.name for p in store_dir.iterdir()) == FILES[store_dir]
    assert sum(p.stat().st_size for p in GOLDEN.rglob("*") if p.is_file()) < 70_000


@STORES
def test_listing(store_dir: Path) -> None:
    store = open_store(store_dir)
    assert store.verify() == []
    assert store.capture_points() == ["final/test", "train"]
    assert store.steps() == [0, 1, 2] and store.steps("train") == [0, 1]
    assert store.ranks() == [0, 1]
    assert sorted(store.layers()) == ["emb", "enc", "head", "norm"]
    assert {name: list(shape) for name, shape in store.parameters().items()} == EXPECTED["parameters"]
    assert {layer: sorted(store.layer_info(layer)["kinds"]) for layer in store.layers()} == {
        "emb": ["embedding"],
        "enc": ["outer"],
        "head": ["outer"],
        "norm": ["dense"],
    }
    assert store.config == {"golden": True, "seed": 0}
    summary = store.summary()
    assert summary["encodings"] == ["fp32", "int8"] and summary["shards"] == 3 and summary["samples"] == 11
    assert store.learning_rate("train") == 0.5


@STORES
@pytest.mark.parametrize("cp", ["train", "final/test"])
def test_metadata(store_dir: Path, cp: str) -> None:
    store = open_store(store_dir)
    rows = _rows(cp)
    meta = store.metadata(cp)
    np.testing.assert_array_equal(store.sample_ids(cp), [r["sample_id"] for r in rows])
    for column in ("sample_id", "label", "prediction", "step", "micro_batch", "rank"):
        np.testing.assert_array_equal(meta[column], [r[column] for r in rows], err_msg=column)
    np.testing.assert_allclose(meta["loss"], [r["loss"] for r in rows], rtol=1e-6)
    np.testing.assert_array_equal(meta["lr"], np.full(len(rows), 0.5))
    np.testing.assert_array_equal(meta["epoch"], np.zeros(len(rows)))
    assert list(meta["capture_point"]) == [cp] * len(rows)


@pytest.mark.parametrize(
    "row", EXPECTED["samples"], ids=lambda r: f"{r['capture_point']}-{r['sample_id']}-{r['encoding']}"
)
@STORES
def test_restored_gradients_match_torch_func(store_dir: Path, row: dict[str, Any]) -> None:
    store = open_store(store_dir)
    restored = store.restore(row["sample_id"], capture_point=row["capture_point"], step=row["step"])
    assert sorted(restored) == sorted(row["grads"])
    for name, values in row["grads"].items():
        expected = torch.tensor(values, dtype=torch.float64)
        actual = restored[name].double()
        assert actual.shape == expected.shape, name
        error = float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))
        assert error <= TOLERANCE[row["encoding"]], (name, error)


# -- the format itself -------------------------------------------------------------------------

_FLOAT = {"fp32": (torch.float32,), "int8": (torch.int8,)}
_RECORD_KEYS = {
    "outer": {"prefix", "suffix", "sample", "position"},
    "embedding": {"ids", "suffix", "sample", "position"},
}


def _shard_layout(path: Path) -> dict[str, Any]:
    with safe_open(str(path), framework="pt") as handle:
        return {
            "metadata": handle.metadata(),
            "keys": {
                key: (str(handle.get_tensor(key).dtype), tuple(handle.get_tensor(key).shape)) for key in handle.keys()
            },
        }


def _layout(directory: Path) -> dict[str, Any]:
    """Every shard's keys with dtype and shape; manifests and journals without sizes, checksums and losses."""
    out: dict[str, Any] = {}
    for path in sorted(directory.iterdir()):
        if path.suffix == ".json":
            out[path.name] = json.loads(path.read_text())
        elif path.suffix == ".jsonl":
            out[path.name] = journal_entries(path.parent, int(path.stem.removeprefix("index-rank")))
            for entry in out[path.name]:
                assert len(entry.pop("sha256")) == 64 and entry.pop("bytes") > 0
                fast = entry.pop("xxh3_128", None)  # an additive field (issue 35): the file's xxh3_128 where written
                assert fast is None or fast == xxhash.xxh3_128_hexdigest((directory / entry["file"]).read_bytes())
                entry["xxh3_128"] = fast is not None
                entry["samples"]["loss"] = entry["samples"]["loss"][0]  # values differ by rounding across versions
        elif path.suffix == ".safetensors":
            out[path.name] = _shard_layout(path)
    return out


def _expected_keys(
    layers: dict[str, Any], encoding: str, batches: list[tuple[int, list[tuple[str, str, int]]]]
) -> set[str]:
    """Keys of docs/format.md for batches of ``(meta bits, [(layer, kind, rows)])``."""
    keys = set()
    for j, (meta, records) in enumerate(batches):
        keys.add(f"b{j}/meta/sample_id")
        keys |= {f"b{j}/meta/{c}" for bit, c in ((1, "label"), (2, "loss"), (4, "prediction")) if meta & bit}
        for k, (layer, kind, _) in enumerate(records):
            names = _RECORD_KEYS.get(kind) or {f"grad.{role}" for role in layers[layer]["params"]}
            for name in names:
                keys.add(f"b{j}/r{k}/{name}")
                if encoding == "int8" and name not in ("sample", "position", "ids"):
                    keys.add(f"b{j}/r{k}/{name}.scale")
    return keys


@pytest.mark.parametrize(("store_dir", "version"), [(STORE_V2, 2), (STORE_V3, 3)], ids=["v2", "v3"])
def test_v2_and_v3_files_follow_the_documented_format(store_dir: Path, version: int) -> None:
    assert mf.SCHEMA_VERSION == 3
    for rank in (0, 1):
        manifest = json.loads((store_dir / f"manifest-rank{rank}.json").read_text())
        assert manifest["format"] == "metastore" and manifest["schema_version"] == version
        assert set(manifest) == {"format", "schema_version", "rank", "config", "layers"} and manifest["rank"] == rank
        for n, entry in enumerate(journal_entries(store_dir, rank)):
            assert set(entry) == {
                "file",
                "bytes",
                "sha256",
                "encoding",
                "capture_points",
                "layers",
                "batches",
                "records",
                "samples",
            }
            assert entry["file"] == f"rank{rank}-{n:06d}.safetensors"
            assert entry["bytes"] == (store_dir / entry["file"]).stat().st_size
            assert {k: v[0] for k, v in entry["batches"].items()} == {
                "capture_point": "i4",
                "step": "i8",
                "epoch": "i8",
                "micro_batch": "i8",
                "size": "i8",
                "lr": "f8",
                "meta": "u1",
            }
            assert {k: v[0] for k, v in entry["records"].items()} == {
                "batch": "i4",
                "layer": "i4",
                "kind": "u1",
                "rows": "i8",
                "bytes": "i8",
                "dense_bytes": "i8",
            }
            assert {k: v[0] for k, v in entry["samples"].items()} == {
                "sample_id": "i8",
                "label": "i8",
                "loss": "f4",
                "prediction": "i8",
            }
            records = list(zip(*(entry["records"][k][1] for k in ("batch", "layer", "kind", "rows"))))
            batches = [
                (
                    meta,
                    [
                        (entry["layers"][layer], ("outer", "embedding", "dense", "projected", "norms")[kind], rows)
                        for b, layer, kind, rows in records
                        if b == j
                    ],
                )
                for j, meta in enumerate(entry["batches"]["meta"][1])
            ]
            layout = _shard_layout(store_dir / entry["file"])
            assert layout["metadata"] == {"format": "metastore", "encoding": entry["encoding"]}
            assert set(layout["keys"]) == _expected_keys(manifest["layers"], entry["encoding"], batches)
            for j, (_, recs) in enumerate(batches):
                for k, (_, kind, rows) in enumerate(recs):
                    if kind != "dense":
                        assert layout["keys"][f"b{j}/r{k}/sample"] == ("torch.int32", (rows,))


def test_v1_files_follow_the_documented_format() -> None:
    for path in (STORE / "manifest-rank0.json", STORE / "manifest-rank1.json"):
        manifest = json.loads(path.read_text())
        assert manifest["format"] == "metastore" and manifest["schema_version"] == 1
        assert set(manifest) == {"format", "schema_version", "rank", "config", "layers", "shards"}
        for shard in manifest["shards"]:
            assert set(shard) == {"file", "bytes", "sha256", "encoding", "rows", "steps", "sample_ids", "batches"}
            assert shard["file"] == f"rank{manifest['rank']}-{manifest['shards'].index(shard):06d}.safetensors"
            encoding = shard["encoding"]
            with safe_open(str(STORE / shard["file"]), framework="pt") as handle:
                assert handle.metadata() == {"format": "metastore", "encoding": encoding}
                stored = {key: handle.get_tensor(key) for key in handle.keys()}
            expected_keys = set()
            for j, batch in enumerate(shard["batches"]):
                assert set(batch) == {"capture_point", "step", "epoch", "micro_batch", "rank", "size", "lr", "records"}
                meta = {f"b{j}/meta/{c}" for c in ("sample_id", "label", "loss", "prediction")}
                assert (
                    stored[f"b{j}/meta/sample_id"].dtype == torch.int64
                    and stored[f"b{j}/meta/loss"].dtype == torch.float32
                )
                expected_keys |= meta
                for k, record in enumerate(batch["records"]):
                    assert set(record) == {"layer", "kind", "rows", "bytes", "dense_bytes"}
                    names = _RECORD_KEYS.get(record["kind"]) or {
                        f"grad.{role}" for role in manifest["layers"][record["layer"]]["params"]
                    }
                    for name in names:
                        key = f"b{j}/r{k}/{name}"
                        expected_keys.add(key)
                        if name in ("sample", "position", "ids"):
                            assert stored[key].dtype == torch.int32 and stored[key].shape == (record["rows"],), key
                        else:
                            assert stored[key].dtype in _FLOAT[encoding], key
                            assert stored[key].shape[0] == record["rows"], key
                            if encoding == "int8":
                                expected_keys.add(key + ".scale")
                                assert stored[key + ".scale"].dtype == torch.float32
                                assert stored[key + ".scale"].shape == (record["rows"],)
            assert set(stored) == expected_keys


def test_todays_writer_writes_the_golden_format(tmp_path: Path) -> None:
    """make_golden.py run now gives the same files, keys, dtypes, shapes, manifests and journal columns."""
    import make_golden

    make_golden.build(tmp_path)
    golden, today = _layout(STORE_V3), _layout(tmp_path)
    assert sorted(today) == sorted(golden)
    for name in golden:
        if name.endswith(".jsonl"):  # lines written now add their xxh3_128 (the golden ones predate it)
            assert all(e.pop("xxh3_128") for e in today[name]) and not any(e.pop("xxh3_128") for e in golden[name])
        if name.endswith(".safetensors"):  # the shard's own description: an additive header key (repair's source)
            assert "index" in today[name]["metadata"] and "index" not in golden[name]["metadata"], name
            del today[name]["metadata"]["index"]
        assert today[name] == golden[name], name
    # fp32 shards hold the same numbers (up to float rounding across torch versions)
    for name in ("rank0-000000.safetensors", "rank0-000001.safetensors"):
        with (
            safe_open(str(STORE_V3 / name), framework="pt") as old,
            safe_open(str(tmp_path / name), framework="pt") as new,
        ):
            for key in old.keys():
                torch.testing.assert_close(new.get_tensor(key), old.get_tensor(key), rtol=1e-5, atol=1e-7)


def test_appending_to_a_version_2_store_makes_it_version_3(tmp_path: Path) -> None:
    import shutil

    from storecases import synthetic_batch

    from metastore_plugins import StoreWriter

    store_dir = tmp_path / "store"
    shutil.copytree(STORE_V2, store_dir)
    before = open_store(store_dir).sample_ids("train").tolist()
    records, _ = synthetic_batch(2)
    with StoreWriter(store_dir, rank=0, encoding="fp32") as writer:
        writer.write(records, sample_ids=torch.arange(4) + 100, step=9, capture_point="later")
    assert json.loads((store_dir / "manifest-rank0.json").read_text())["schema_version"] == 3
    store = open_store(store_dir)
    assert store.verify() == [] and store.sample_ids("train").tolist() == before
    assert store.sample_ids("later").tolist() == [100, 101, 102, 103]
