"""What a snapshot file may hold, checked before a value of it is used; and the per-rank journal of their checksums.

A snapshot file is trusted only as far as these checks go (issue 29):

- its sha256 equals one recorded for its name in ``snapshots-rank{r}.jsonl`` at the store's root, a
  journal of CRC-checked lines (:func:`~metastore_plugins.core.store.shards.journal.encode_line`) appended
  before the file is renamed into place; a file with no line (written before checksums) is read
  unverified, and said so once;
- its header is at most :data:`MAX_HEADER_BYTES`, JSON nested at most as deep as the parser allows,
  its ``__metadata__`` names the snapshot and rank its file name gives, with a step, a base name,
  attributes (a JSON object) and shapes (lists of sizes);
- its entries are of :data:`ENTRY_DTYPES` (parameters fp32; buffers a float dtype or an int64
  counter; row indices int64), finite, and row updates stay within their tensor
  (:mod:`~metastore_plugins.core.store.snapshots.snapshot_delta`).
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import warnings
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from metastore_plugins.core.errors import ConfigError, JournalError, StoreError
from metastore_plugins.core.store.files import StoreDir
from metastore_plugins.core.store.shards.journal import ParsedPrefixes
from metastore_plugins.core.store.shards.journal_batch import decode_lines, gc_paused

FORMAT = "metastore-snapshot/1"
BUFFERS = "buffers/"  # key prefix of the buffers' entries
NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")
FILE = re.compile(r"(.+)-rank(\d+)\.safetensors")
JOURNAL = re.compile(r"snapshots-rank(\d+)\.jsonl")
#: The longest header read (safetensors' own limit).
MAX_HEADER_BYTES = 100_000_000
#: The largest snapshot journal read: a line is about 200 bytes.
MAX_JOURNAL_BYTES = 64 * 2**20
#: The largest snapshot file read without a recorded size: a bound against sparse files, not a model limit.
MAX_SNAPSHOT_BYTES = 2**40
#: The dtypes of each kind of entry, by ``(buffer?, kind)``.
ENTRY_DTYPES: dict[tuple[bool, str], frozenset[str]] = {
    (False, "full"): frozenset({"F32"}),
    (False, "part"): frozenset({"F32"}),
    (False, "rows"): frozenset({"I64"}),
    (True, "full"): frozenset({"F64", "F32", "F16", "BF16", "I64"}),
    (True, "part"): frozenset({"F64", "F32", "F16", "BF16", "I64"}),
    (True, "rows"): frozenset({"I64"}),
}
_META = ("format", "name", "step", "rank", "base", "attributes", "shapes")
_SHA = re.compile(r"[0-9a-f]{64}")
_unverified: set[Path] = set()  # snapshots without a checksum already said once


def check_name(name: str, rank: int) -> None:
    """Refuse (``ValueError``) a snapshot name that is not :data:`NAME`, or a rank that is not an int >= 0."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ConfigError(f"a snapshot name must be 1-100 letters, digits, '_', '.' or '-'; got {name!r}")
    if not isinstance(rank, int) or rank < 0:
        raise ConfigError(f"a snapshot rank must be an int >= 0; got {rank!r}")


def journal_name(rank: int) -> str:
    return f"snapshots-rank{rank}.jsonl"


def file_name(name: str, rank: int) -> str:
    return f"{name}-rank{rank}.safetensors"


@dataclass(frozen=True)
class Record:
    """One line of a snapshot journal: a snapshot file as it was written."""

    name: str
    step: int
    bytes: int
    sha256: str


@dataclass
class Journal:
    """The lines of one rank's snapshot journal: records by name (in order), damaged lines, trusted size."""

    records: dict[str, list[Record]]
    problems: list[str]
    good_size: int


#: The most snapshot names looked for in a journal's text (each a scan of it); more: every line parsed.
MAX_NEEDLES = 16
#: The snapshot journals this process parsed, with the line count they held: each operation parses only what
#: was appended since (a journal changed anywhere else is parsed again whole).
_PARSED: ParsedPrefixes[tuple[Journal, int]] = ParsedPrefixes()


def read_journal(root: StoreDir, rank: int, names: Collection[str] | None = None) -> Journal:
    """The rank's snapshot journal (empty when there is none); a torn last line is left out of ``good_size``.

    Read whole every time; the lines parsed before in this process are reused while their bytes are unchanged.
    With ``names`` (at most :data:`MAX_NEEDLES`, where the journal was not parsed before), every line's form and
    CRC are checked but only the lines whose text can name one of these snapshots are parsed (the records of the
    others are left out, and nothing is kept for the next read).

    Raises:
        StoreError: naming the file, when it is not a regular file or too large.
    """
    name = journal_name(rank)
    if not root.exists(name):
        return Journal({}, [], 0)
    data = root.read(name, MAX_JOURNAL_BYTES, "a snapshot journal")
    key = str(root.path / name)
    cached = _PARSED.get(key, data)
    before, lines = cached[1] if cached is not None else (Journal({}, [], 0), 0)
    journal = Journal(dict(before.records), list(before.problems), before.good_size)  # the cached one stays as it is
    rest = data[before.good_size :]
    picked = names is not None and cached is None and len(names) <= MAX_NEEDLES
    needles = _needles(names, rank) if picked and names is not None else None
    with gc_paused():  # a journal of many lines: the collector would walk the records again and again
        for entry, offset in decode_lines(rest, needles):  # checked and parsed many lines at once
            if offset == len(rest) and not rest.endswith(b"\n"):
                break  # torn: the writer stopped while appending; its snapshot was never renamed into place
            journal.good_size, lines = before.good_size + offset, lines + 1
            if entry is None:  # holds none of the names: checked, not parsed
                continue
            try:
                if isinstance(entry, JournalError):
                    raise entry
                record = _record(entry, rank)
            except JournalError as exc:
                journal.problems.append(f"{root.path / name}: line {lines} is damaged ({exc}); remove it")
                continue
            journal.records[record.name] = [*journal.records.get(record.name, []), record]
    if needles is None:
        _PARSED.put(key, data, journal.good_size, (journal, lines))
    return journal


def _needles(names: Collection[str], rank: int) -> tuple[bytes, ...]:
    """What the text of a line recording one of ``names`` holds: its file's JSON string, or written with escapes,
    a backslash (a name is ASCII: :data:`NAME`)."""
    return (*(json.dumps(file_name(name, rank)).encode("ascii") for name in names), b"\\")


def record_line(name: str, rank: int, step: int, data: bytes) -> tuple[Record, dict[str, Any]]:
    """The record of snapshot file bytes ``data`` and the JSON object of its journal line."""
    record = Record(name, step, len(data), hashlib.sha256(data).hexdigest())
    return record, {"name": name, "file": file_name(name, rank), "step": step, "bytes": record.bytes,
                    "sha256": record.sha256}  # fmt: skip


def _record(entry: dict[str, Any], rank: int) -> Record:
    name, step, size, sha = (entry.get("name"), entry.get("step"), entry.get("bytes"), entry.get("sha256"))
    ints = type(step) is int and type(size) is int and step >= 0 and size >= 0
    if not (type(name) is str and NAME.fullmatch(name) and entry.get("file") == file_name(name, rank)):
        raise JournalError("its name and file are not those of a snapshot of this rank")
    if not ints or not (type(sha) is str and _SHA.fullmatch(sha)):
        raise JournalError("its step, bytes or sha256 are not a snapshot's")
    return Record(name, step, size, sha)  # type: ignore[arg-type]  # checked above


def verified_bytes(folder: StoreDir, name: str, rank: int, journal: Journal) -> tuple[bytes, Record | None]:
    """The bytes of a snapshot file, checked against the sha256 recorded for it (None: written before checksums).

    Raises:
        StoreError: naming the file, when it is not a regular file, too large, or matches no record.
    """
    records = journal.records.get(name, [])
    cap = max((r.bytes for r in records), default=MAX_SNAPSHOT_BYTES)
    path = folder.path / file_name(name, rank)
    data = folder.read(file_name(name, rank), cap, "a snapshot")
    if not records:
        if journal.problems:
            raise StoreError(f"{path}: no checksum recorded, and its journal is damaged: {journal.problems[0]}")
        if path not in _unverified:
            _unverified.add(path)
            warnings.warn(f"{path}: no checksum recorded (written before checksums); read unverified", stacklevel=4)
        return data, None
    digest = hashlib.sha256(data).hexdigest()
    match = next((r for r in reversed(records) if r.sha256 == digest and r.bytes == len(data)), None)
    if match is None:
        raise StoreError(
            f"{path}: a damaged snapshot: its sha256 {digest[:16]}... matches none recorded in "
            f"{journal_name(rank)} ({records[-1].sha256[:16]}... when it was written); delete it and take it again"
        )
    return data, match


def header_of(prefix: bytes, size: int, path: Path) -> int:
    """The header length a safetensors file's first 8 bytes give, checked against ``size`` and the cap."""
    if len(prefix) < 8:
        raise StoreError(
            f"{path}: a damaged snapshot ({size} bytes, shorter than a header); delete it and take it again"
        )
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > min(MAX_HEADER_BYTES, size - 8):
        raise StoreError(
            f"{path}: a damaged snapshot (a header of {length} bytes in a file of {size}); delete it and take it again"
        )
    return int(length)


def check_header(text: bytes, path: Path, name: str, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(metadata, entries)`` of a snapshot header (the JSON after its 8-byte length), every field checked.

    ``metadata["attributes"]``, ``["shapes"]`` and ``["buffer_shapes"]`` are returned decoded.
    """
    header = _json(text, path, "its header")
    if not isinstance(header, dict):
        raise StoreError(f"{path}: a damaged snapshot (its header is not a JSON object); delete it and take it again")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise StoreError(f"{path}: a damaged snapshot (__metadata__ is not text by key); delete it and take it again")
    missing = sorted(set(_META) - set(meta))
    if meta.get("format") != FORMAT or missing:
        what = f"format {meta.get('format')!r}, missing {missing}"
        raise StoreError(f"{path}: not a metastore snapshot ({what}); move it out of snapshots/")
    if (meta["name"], meta["rank"]) != (name, str(rank)):
        raise StoreError(
            f"{path}: holds snapshot {meta['name'][:100]!r} of rank {meta['rank'][:20]}, not {name!r} of rank {rank}; "
            "move it out of snapshots/ (a snapshot file is never renamed)"
        )
    out: dict[str, Any] = dict(meta)
    if not re.fullmatch(r"[0-9]{1,19}", meta["step"]):
        raise StoreError(f"{path}: a damaged snapshot (step {meta['step'][:40]!r}); delete it and take it again")
    if meta["base"] and not NAME.fullmatch(meta["base"]):
        raise StoreError(f"{path}: a damaged snapshot (base {meta['base'][:120]!r}); delete it and take it again")
    out["attributes"] = _json(meta["attributes"].encode(), path, "attributes")
    if not isinstance(out["attributes"], dict):
        raise StoreError(f"{path}: a damaged snapshot (attributes not a JSON object); delete it and take it again")
    for key in ("shapes", "buffer_shapes"):
        if key in meta:
            out[key] = _shapes(_json(meta[key].encode(), path, key), path, key)
    for key, entry in header.items():
        _check_entry(key, entry, path)
        buffer, kind, tensor = entry_kind(key)
        recorded = out.get("buffer_shapes" if buffer else "shapes", {}).get(tensor)
        if kind == "full" and recorded is not None and entry.get("shape") != recorded:
            raise StoreError(
                f"{path}: a damaged snapshot ({key!r} of shape {str(entry.get('shape'))[:40]}, recorded "
                f"{str(recorded)[:40]}); delete it and take it again"
            )
    return out, header


def _json(text: bytes, path: Path, what: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else "not JSON"
        raise StoreError(f"{path}: a damaged snapshot ({what}: {reason}); delete it and take it again") from None


def _shapes(value: Any, path: Path, key: str) -> dict[str, list[int]]:
    good = isinstance(value, dict) and all(
        isinstance(shape, list) and len(shape) <= 64 and all(type(n) is int and 0 <= n < 2**63 for n in shape)
        for shape in value.values()
    )
    if not good:
        raise StoreError(
            f"{path}: a damaged snapshot ({key} are not lists of sizes by name); delete it and take it again"
        )
    return value


def entry_kind(key: str) -> tuple[bool, str, str]:
    """``(buffer?, kind, tensor name)`` of an entry key such as ``buffers/rows/norm.running_mean``."""
    buffer = key.startswith(BUFFERS)
    kind, _, entry = key[len(BUFFERS) if buffer else 0 :].partition("/")
    return buffer, kind, entry


def _check_entry(key: str, entry: Any, path: Path) -> None:
    buffer, kind, name = entry_kind(key)
    allowed = ENTRY_DTYPES.get((buffer, kind))
    if allowed is None or not name:
        raise StoreError(
            f"{path}: a damaged snapshot (an entry {key[:200]!r} no snapshot holds); delete it and take it again"
        )
    dtype = entry.get("dtype") if isinstance(entry, dict) else None
    if dtype not in allowed:
        raise StoreError(
            f"{path}: a damaged snapshot ({key!r} is {str(dtype)[:20]}, not one of {sorted(allowed)}); "
            "delete it and take it again"
        )


def check_values(key: str, value: Tensor, path: Path) -> None:
    """Refuse NaN or inf in a floating entry (a snapshot of them could not recompute anything)."""
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        raise StoreError(f"{path}: a damaged snapshot ({key!r} holds NaN or inf values); delete it and take it again")
