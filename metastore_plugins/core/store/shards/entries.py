"""One shard's index entry: its file, checksum, and its batches, records and sample rows as columns.

A :class:`ShardEntry` is what a journal line (version 2) or a version 1 manifest's shard
object says, checked with bounds by :func:`entry_from_json` / :func:`entry_from_v1` before
anything reads it. Columns are numpy arrays (``batches``: one row per stored batch;
``records``: one per record, grouped by batch; ``samples``: one per sample, batches in order).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from metastore_plugins.core.errors import JournalError
from metastore_plugins.core.records import FLOAT_SAMPLE_COLUMNS, KIND_CODES, META_BITS, PER_SAMPLE_KINDS, SAMPLE_COLUMNS
from metastore_plugins.core.store.shards.journal import pack, unpack
from metastore_plugins.core.store.shards.manifest import ENCODING_NAMES, MAX_INT, name_problem

BATCH_FIELDS = ("capture_point", "step", "epoch", "micro_batch", "size", "lr", "meta")
RECORD_FIELDS = ("batch", "layer", "kind", "rows", "bytes", "dense_bytes")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_XXH3_128 = re.compile(r"[0-9a-f]{32}")
#: The most capture-point or layer names one journal line may list.
MAX_NAMES = 2**16
#: The highest shard number a name ``rank{r}-NNNNNN(NNN).safetensors`` can hold (6 to 9 digits).
MAX_SHARD_NUMBER = 10**9 - 1


@dataclass
class ShardEntry:
    """One shard as the index lists it."""

    file: str
    bytes: int
    sha256: str
    encoding: str
    rank: int
    capture_points: list[str]
    layers: list[str]
    batches: dict[str, np.ndarray]  # BATCH_FIELDS -> (n_b,); capture_point and layer index the name lists
    records: dict[str, np.ndarray]  # RECORD_FIELDS -> (n_r,)
    samples: dict[str, np.ndarray] | None  # SAMPLE_COLUMNS present -> (n_s,); None until read (version 1)
    xxh3_128: str | None = None  # the fast checksum of the query path (lines written since issue 35); None: sha256

    @property
    def rows(self) -> int:
        return int(self.batches["size"].sum())

    def batch_labels(self) -> list[str]:
        """Per batch, what tells it from another batch of equal tensors: its capture point's name and its step,
        epoch, micro-batch, size, learning rate and metadata bits (its sample ids are among its tensors)."""
        points = [self.capture_points[int(c)] for c in self.batches["capture_point"]]
        fields = [[repr(v) for v in self.batches[key].tolist()] for key in BATCH_FIELDS[1:]]
        return [json.dumps([point, *row]) for point, *row in zip(points, *fields)]

    def to_json(self) -> dict[str, Any]:
        """The journal object of this entry (columns packed)."""
        assert self.samples is not None
        return {
            "file": self.file,
            "bytes": self.bytes,
            "sha256": self.sha256,
            **({} if self.xxh3_128 is None else {"xxh3_128": self.xxh3_128}),
            "encoding": self.encoding,
            "capture_points": self.capture_points,
            "layers": self.layers,
            "batches": {key: pack(self.batches[key]) for key in BATCH_FIELDS},
            "records": {key: pack(self.records[key]) for key in RECORD_FIELDS},
            "samples": {key: pack(value) for key, value in self.samples.items()},
        }


def shard_pattern(rank: int) -> re.Pattern[str]:
    """Names of rank ``rank``'s shards: ``rank{r}-{n:06d}.safetensors`` (ASCII digits)."""
    return re.compile(rf"rank{rank}-[0-9]{{6,9}}\.safetensors", re.ASCII)


def _need(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise JournalError(f"{where} {what}")


def _within(values: np.ndarray, low: float, high: float) -> bool:
    return values.size == 0 or bool(low <= values.min() and values.max() < high)


def _columns(raw: Any, fields: tuple[str, ...], required: tuple[str, ...], where: str) -> dict[str, np.ndarray]:
    _need(isinstance(raw, dict), where, "must be an object of packed columns")
    unknown = sorted(set(raw) - set(fields))
    _need(not unknown, where, f"has unknown column(s) {ascii(unknown)[:80]}")
    missing = [key for key in required if key not in raw]
    _need(not missing, where, f"lacks column(s) {missing}")
    return {key: unpack(raw[key], f"{where}.{key}") for key in fields if key in raw}


def _integer(columns: dict[str, np.ndarray], key: str, where: str, low: float, high: float) -> np.ndarray:
    values = columns[key]
    _need(values.dtype.kind in "iu", f"{where}.{key}", f"must be integers; got {values.dtype}")
    values = values.astype(np.int64)
    _need(_within(values, low, high), f"{where}.{key}", f"holds values outside [{low:g}, {high:g})")
    return values


def _names(raw: Any, where: str, empty_ok: bool = False) -> list[str]:
    _need(isinstance(raw, list) and len(raw) <= MAX_NAMES, where, f"must be a list of at most {MAX_NAMES} names")
    for name in raw:
        problem = name_problem(name, empty_ok)
        _need(problem is None, where, f"name {problem}")
    return list(raw)


def entry_from_json(raw: dict[str, Any], rank: int, layers: dict[str, Any]) -> ShardEntry:
    """Check a journal object against the rank and its manifest's layers; :class:`JournalError` if untrusted."""
    file = raw.get("file")
    _need(
        isinstance(file, str) and shard_pattern(rank).fullmatch(file) is not None,
        "file",
        f"must be a rank{rank}-NNNNNN.safetensors name",
    )
    _need(isinstance(raw.get("bytes"), int) and 0 <= raw["bytes"] < MAX_INT, "bytes", "must be a byte count")
    _need(
        isinstance(raw.get("sha256"), str) and _SHA256.fullmatch(raw["sha256"]) is not None,
        "sha256",
        "must be 64 hex digits",
    )
    xxh3 = raw.get("xxh3_128")  # optional (issue 35): absent in lines written before
    _need(
        xxh3 is None or (isinstance(xxh3, str) and _XXH3_128.fullmatch(xxh3) is not None),
        "xxh3_128",
        "must be 32 hex digits",
    )
    _need(raw.get("encoding") in ENCODING_NAMES, "encoding", f"must be one of {ENCODING_NAMES}")
    capture_points = _names(raw.get("capture_points"), "capture_points")
    layer_names = _names(raw.get("layers"), "layers", empty_ok=True)
    unknown = [name for name in layer_names if name not in layers]
    _need(not unknown, "layers", f"{ascii(unknown)[:80]} are not in the rank's manifest")
    b = _columns(raw.get("batches"), BATCH_FIELDS, BATCH_FIELDS, "batches")
    n_b = len(b["step"])
    _need(n_b > 0 and all(len(v) == n_b for v in b.values()), "batches", "columns must have one equal, positive length")
    batches = {key: _integer(b, key, "batches", -MAX_INT, MAX_INT) for key in ("step", "epoch", "micro_batch")}
    batches["capture_point"] = _integer(b, "capture_point", "batches", 0, len(capture_points))
    batches["size"] = _integer(b, "size", "batches", 0, 2**31)
    batches["meta"] = _integer(b, "meta", "batches", 0, 2 ** len(META_BITS))
    lr = b["lr"]
    _need(lr.dtype.kind == "f" and not np.isinf(lr).any(), "batches.lr", "must be finite floats (NaN: none given)")
    batches["lr"] = lr.astype(np.float64)
    r = _columns(raw.get("records"), RECORD_FIELDS, RECORD_FIELDS, "records")
    n_r = len(r["batch"])
    _need(all(len(v) == n_r for v in r.values()), "records", "columns must have one length")
    records = {key: _integer(r, key, "records", 0, MAX_INT) for key in ("rows", "bytes", "dense_bytes")}
    records["batch"] = _integer(r, "batch", "records", 0, n_b)
    records["layer"] = _integer(r, "layer", "records", 0, len(layer_names))
    records["kind"] = _integer(r, "kind", "records", 0, len(KIND_CODES))
    _need(bool((np.diff(records["batch"]) >= 0).all()), "records.batch", "must be grouped by batch in order")
    per_sample = np.isin(records["kind"], [KIND_CODES.index(kind) for kind in PER_SAMPLE_KINDS])
    _need(
        bool((records["rows"][per_sample] == batches["size"][records["batch"][per_sample]]).all()),
        "records.rows",
        "of a dense, projected or norms record must equal its batch's size",
    )
    assert isinstance(file, str)  # checked above
    entry = ShardEntry(
        file, raw["bytes"], raw["sha256"], raw["encoding"], rank, capture_points, layer_names, batches, records, None
    )
    entry.samples = _samples(_columns(raw.get("samples"), SAMPLE_COLUMNS, ("sample_id",), "samples"), entry.rows)
    entry.xxh3_128 = xxh3
    return entry


def _samples(s: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    _need(all(len(v) == rows for v in s.values()), "samples", f"columns must have one row per sample ({rows})")
    samples = {"sample_id": _integer(s, "sample_id", "samples", -(2**63), 2**63)}
    for key in ("label", "prediction"):
        if key in s:
            _need(s[key].dtype.kind in "iuf", f"samples.{key}", f"must be numbers; got {s[key].dtype}")
            samples[key] = s[key].astype(np.int64 if s[key].dtype.kind in "iu" else np.float64)
    for key in FLOAT_SAMPLE_COLUMNS:
        if key in s:
            _need(s[key].dtype.kind == "f", f"samples.{key}", f"must be floats; got {s[key].dtype}")
            samples[key] = s[key].astype(np.float32)
    return samples


def entry_from_v1(shard: dict[str, Any], rank: int) -> ShardEntry:
    """The entry of a version 1 manifest's (checked) shard object; samples are read from the shard later."""
    batches = shard["batches"]
    points = list(dict.fromkeys(batch["capture_point"] for batch in batches))
    layer_names = list(dict.fromkeys(r["layer"] for batch in batches for r in batch["records"]))
    columns = {
        key: np.array([batch[key] for batch in batches], dtype=np.int64)
        for key in ("step", "epoch", "micro_batch", "size")
    }
    columns["capture_point"] = np.array([points.index(batch["capture_point"]) for batch in batches], dtype=np.int64)
    columns["lr"] = np.array([np.nan if batch["lr"] is None else batch["lr"] for batch in batches], dtype=np.float64)
    columns["meta"] = np.full(len(batches), -1, dtype=np.int64)  # unknown: any optional column may be stored
    flat = [(j, r) for j, batch in enumerate(batches) for r in batch["records"]]
    records = {
        "batch": np.array([j for j, _ in flat], dtype=np.int64),
        "layer": np.array([layer_names.index(r["layer"]) for _, r in flat], dtype=np.int64),
        "kind": np.array([KIND_CODES.index(r["kind"]) for _, r in flat], dtype=np.int64),
        **{key: np.array([r[key] for _, r in flat], dtype=np.int64) for key in ("rows", "bytes", "dense_bytes")},
    }
    return ShardEntry(
        shard["file"],
        shard["bytes"],
        shard["sha256"],
        shard["encoding"],
        rank,
        points,
        layer_names,
        columns,
        records,
        None,
    )


def meta_columns(mask: int) -> list[str] | None:
    """The optional metadata tensors a batch's ``meta`` bit mask says its shard holds (None: unknown, version 1)."""
    return None if mask < 0 else [name for name, bit in META_BITS.items() if mask & bit]


def new_entry(
    file: str, nbytes: int, sha256: str, encoding: str, rank: int, batches: list[tuple[dict[str, Any], dict[str, Any]]]
) -> ShardEntry:
    """The entry of a shard just written: ``batches`` are ``(info, meta)`` per stored batch, where ``info``
    holds capture_point, step, epoch, micro_batch, size, lr and ``records`` (layer, kind, rows, bytes,
    dense_bytes) and ``meta`` the batch's metadata tensors (``(B,)`` or ``(B, ...)``, on the CPU)."""
    point_of = {name: i for i, name in enumerate(dict.fromkeys(info["capture_point"] for info, _ in batches))}
    layer_of = {
        name: i for i, name in enumerate(dict.fromkeys(r["layer"] for info, _ in batches for r in info["records"]))
    }
    points, layers = list(point_of), list(layer_of)
    columns = {
        key: np.array([info[key] for info, _ in batches], dtype=np.int64)
        for key in ("step", "epoch", "micro_batch", "size")
    }
    columns["capture_point"] = np.array([point_of[info["capture_point"]] for info, _ in batches], dtype=np.int32)
    columns["lr"] = np.array([np.nan if info["lr"] is None else info["lr"] for info, _ in batches], dtype=np.float64)
    columns["meta"] = np.array(
        [sum(bit for key, bit in META_BITS.items() if key in meta) for _, meta in batches], dtype=np.uint8
    )
    flat = [(j, r) for j, (info, _) in enumerate(batches) for r in info["records"]]
    records: dict[str, np.ndarray] = {
        "batch": np.array([j for j, _ in flat], dtype=np.int32),
        "layer": np.array([layer_of[r["layer"]] for _, r in flat], dtype=np.int32),
        "kind": np.array([KIND_CODES.index(r["kind"]) for _, r in flat], dtype=np.uint8),
        **{key: np.array([r[key] for _, r in flat], dtype=np.int64) for key in ("rows", "bytes", "dense_bytes")},
    }
    samples = sample_columns([(info["size"], meta) for info, meta in batches])
    return ShardEntry(file, nbytes, sha256, encoding, rank, points, layers, columns, records, samples)


def sample_columns(batches: list[tuple[int, dict[str, torch.Tensor]]]) -> dict[str, np.ndarray]:
    """The journal's sample columns of ``(size, metadata tensors)`` batches (``sample_id`` required)."""
    samples = {"sample_id": np.concatenate([meta["sample_id"].numpy().astype(np.int64) for _, meta in batches])}
    for key in SAMPLE_COLUMNS[1:]:
        if any(key in meta for _, meta in batches):
            samples[key] = _scalar_column(key, [(size, meta.get(key)) for size, meta in batches])
    return samples


def _scalar_column(key: str, parts: list[tuple[int, torch.Tensor | None]]) -> np.ndarray:
    """One value per sample: 1-d columns as they are, others (absent, or ``(B, ...)``) as -1 or NaN."""
    arrays = [
        None if v is None or v.dim() != 1 else (v.float() if v.dtype == torch.bfloat16 else v).numpy() for _, v in parts
    ]
    floating = key in FLOAT_SAMPLE_COLUMNS or any(a is not None and a.dtype.kind not in "iub" for a in arrays)
    dtype = np.float32 if key in FLOAT_SAMPLE_COLUMNS else (np.float64 if floating else np.int64)
    fill = np.nan if floating else -1
    return np.concatenate(
        [np.full(n, fill, dtype) if a is None else a.astype(dtype) for (n, _), a in zip(parts, arrays)]
    )
