"""The golden store: a small store written once by make_golden.py and committed.

It pins the on-disk format of docs/format.md. The reader must keep reading it (listing,
metadata, restored gradients equal to torch.func's), and today's writer must still write
the same files, keys, dtypes and manifest fields. If a change breaks this test, old stores
no longer read the same: bump ``schema_version`` and keep a reader for version 1 instead
of regenerating the golden store.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

from metastore_plugins import open_store
from metastore_plugins.core.store import manifest as mf

GOLDEN = Path(__file__).resolve().parent / "golden"
STORE = GOLDEN / "store"
EXPECTED = json.loads((GOLDEN / "expected.json").read_text())
TOLERANCE = {"fp32": 1e-5, "int8": 2e-2}  # max |store - torch.func| / max |torch.func|, per parameter
FILES = [
    "manifest-rank0.json",
    "manifest-rank1.json",
    "rank0-000000.safetensors",
    "rank0-000001.safetensors",
    "rank1-000000.safetensors",
]


def _rows(cp: str) -> list[dict[str, Any]]:
    """Expected rows of a capture point in selection order: (step, micro-batch, rank), then batch order."""
    rows = [r for r in EXPECTED["samples"] if r["capture_point"] == cp]
    return sorted(rows, key=lambda r: (r["step"], r["micro_batch"], r["rank"]))  # stable: batch order kept


def test_the_golden_store_is_small_and_complete() -> None:
    assert sorted(p.name for p in STORE.iterdir()) == FILES
    assert sum(p.stat().st_size for p in GOLDEN.rglob("*") if p.is_file()) < 50_000


def test_listing() -> None:
    store = open_store(STORE)
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


@pytest.mark.parametrize("cp", ["train", "final/test"])
def test_metadata(cp: str) -> None:
    store = open_store(STORE)
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
def test_restored_gradients_match_torch_func(row: dict[str, Any]) -> None:
    store = open_store(STORE)
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


def _layout(directory: Path) -> dict[str, Any]:
    """Every shard's keys with dtype and shape, and the manifests without sizes and checksums."""
    out: dict[str, Any] = {}
    for path in sorted(directory.iterdir()):
        if path.suffix == ".json":
            manifest = json.loads(path.read_text())
            for shard in manifest["shards"]:
                assert len(shard.pop("sha256")) == 64 and shard.pop("bytes") > 0
            out[path.name] = manifest
        else:
            with safe_open(str(path), framework="pt") as handle:
                out[path.name] = {
                    "metadata": handle.metadata(),
                    "keys": {
                        key: (str(handle.get_tensor(key).dtype), tuple(handle.get_tensor(key).shape))
                        for key in handle.keys()
                    },
                }
    return out


def test_keys_and_dtypes_follow_the_documented_format() -> None:
    for path in (STORE / "manifest-rank0.json", STORE / "manifest-rank1.json"):
        manifest = json.loads(path.read_text())
        assert manifest["format"] == "metastore" and manifest["schema_version"] == 1 == mf.SCHEMA_VERSION
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
    """make_golden.py run now gives the same files, keys, dtypes, shapes and manifest fields."""
    import make_golden

    make_golden.build(tmp_path)
    golden, today = _layout(STORE), _layout(tmp_path)
    assert sorted(today) == sorted(golden)
    for name in golden:
        assert today[name] == golden[name], name
    # fp32 shards hold the same numbers (up to float rounding across torch versions)
    for name in ("rank0-000000.safetensors", "rank0-000001.safetensors"):
        with (
            safe_open(str(STORE / name), framework="pt") as old,
            safe_open(str(tmp_path / name), framework="pt") as new,
        ):
            for key in old.keys():
                torch.testing.assert_close(new.get_tensor(key), old.get_tensor(key), rtol=1e-5, atol=1e-7)
