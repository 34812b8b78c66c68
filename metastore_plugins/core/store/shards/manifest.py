"""The manifest of one rank: what changes rarely (config, layers), written atomically.

Version 2 (this writer): a run directory holds ``manifest-rank{r}.json`` (format, version,
rank, config, layers), the rank's journal ``index-rank{r}.jsonl`` (one line per shard, see
:mod:`~metastore_plugins.core.store.shards.journal`) and ``rank{r}-{n:06d}.safetensors`` shards::

    {"format": "metastore", "schema_version": 3, "rank": 0,
     "config": {...},                                   # run configuration, free-form
     "layers": {layer: {"params": {role: name}, "param_shapes": {role: [..]}, "layout": "out_in"}}}

Version 1 listed every shard in the manifest (``"shards": [...]``, rewritten after each shard);
it is still read. In a shard, record tensors are named ``b{j}/r{k}/{tensor}`` (batch ``j`` of
the shard, record ``k`` of the batch) and per-sample metadata ``b{j}/meta/{column}``. Every
field, bound and versioning rule: docs/format.md.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from metastore_plugins.core.errors import StoreError

# their home is records.py (the shard keys) and files.py; many modules import them from here
from metastore_plugins.core.records import EXACT_KINDS, WEIGHT_LAYOUTS
from metastore_plugins.core.records import meta_key as meta_key
from metastore_plugins.core.records import record_key as record_key
from metastore_plugins.core.store.files import atomic_write_bytes as atomic_write_bytes
from metastore_plugins.core.store.files import fsync_dir as fsync_dir

FORMAT = "metastore"
SCHEMA_VERSION = 3
#: The oldest version a writer appends to (and compaction rewrites): version 3 only adds record kinds
#: and files to version 2, so appending upgrades a version 2 manifest to 3.
JOURNAL_VERSION = 2
#: ``manifest-rank{r}.json`` with ``r`` in ASCII digits, no leading zero (``re.fullmatch``: no trailing newline).
MANIFEST_PATTERN = re.compile(r"manifest-rank(0|[1-9][0-9]{0,8})\.json", re.ASCII)
#: The largest manifest a reader parses (version 1 manifests of long runs reach tens of MB).
MAX_MANIFEST_BYTES = 256 * 2**20
#: Bounds on what a manifest or journal may say: integers JSON and float64 hold exactly, parameter
#: sizes a restore can allocate, names a terminal shows as they are.
MAX_INT = 2**53
MAX_PARAM_NUMEL = 2**34
#: The most rows an embedding layer's weight may have: the only size of a layer no stored tensor confirms (its
#: records hold token ids below it), and queries hold a few numbers per row (a ``(k, V)`` projection, ``(V, d)``
#: eigenvalues): 2^22 is 16 times the largest language-model vocabularies, and keeps those within 512 MB.
MAX_EMBEDDING_ROWS = 2**22
MAX_NAME_CHARS = 1024
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
#: The most JSON values a manifest may hold, counted before parsing (:func:`json_values_problem`): parsing
#: allocates about 70 bytes per value whatever its text (``{}`` is 3 bytes of ``{},``), so a 250 MB manifest
#: of empty objects would take 6 GB. A version 2 manifest holds a few per layer; a version 1 manifest about one
#: per 16 bytes, so this admits version 1 manifests of about 130 MB, and costs at most about 600 MB to parse.
MAX_MANIFEST_VALUES = 2**23


def json_values_problem(text: bytes, cap: int) -> str | None:
    """Why ``text`` holds too many JSON values to parse (more than ``cap``), or ``None``; never parses it.

    Counts ``,``, ``[`` and ``{`` (every value after the first of a list or object is preceded by a comma, every
    container opened by a bracket), an upper bound on the values that also counts those characters inside strings,
    in a few passes over the bytes that allocate nothing.
    """
    count = text.count(b",") + text.count(b"[") + text.count(b"{")
    if count <= cap:
        return None
    return (
        f"holds {count} JSON separators and brackets, more than the {cap} a reader parses (parsing allocates "
        "about 70 bytes per value, whatever its text): not one a writer produced"
    )


def manifest_name(rank: int) -> str:
    return f"manifest-rank{rank}.json"


def shard_name(rank: int, index: int) -> str:
    return f"rank{rank}-{index:06d}.safetensors"


def new_manifest(rank: int, config: dict[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "schema_version": SCHEMA_VERSION, "rank": rank, "config": config, "layers": {}}


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Rewrite the rank's manifest atomically (compact JSON)."""
    text = json.dumps(manifest, separators=(",", ":"))
    atomic_write_bytes(directory / manifest_name(manifest["rank"]), text.encode())


def parse_manifest(data: bytes, path: Path, rank: int) -> dict[str, Any]:
    """Check one manifest's bytes (read by the caller, at most :data:`MAX_MANIFEST_BYTES`).

    ``rank`` is the one its file name gives. Raises ``ValueError`` naming the file and the field.
    """
    problem = json_values_problem(data, MAX_MANIFEST_VALUES)
    if problem is not None:
        raise StoreError(f"cannot read manifest {path}: it {problem}")
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError, MemoryError) as exc:
        raise StoreError(f"cannot read manifest {path}: {exc or 'out of memory while parsing it'}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise StoreError(f'{path} is not a metastore manifest (no "format": "{FORMAT}")')
    version: Any = manifest.get("schema_version")  # JSON: checked next
    if not _is_int(version) or version < 1:
        raise StoreError(f"{path} has an invalid schema version {version!r} (a positive integer is expected)")
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"{path} has schema version {version}; this version of metastore_plugins reads "
            f"version {SCHEMA_VERSION} and older: upgrade metastore_plugins"
        )
    check_manifest(manifest, path)
    _need(manifest["rank"] == rank, path, '"rank"', f"is {manifest['rank']} but the file name says rank {rank}")
    return manifest


# -- structure checks: a reader trusts nothing a manifest says before these pass -------------

SHARD_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}\.safetensors", re.ASCII)
ENCODING_NAMES = ("fp32", "fp16", "bf16", "int8")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def in_range(value: Any, low: int = -MAX_INT, high: int = MAX_INT) -> bool:
    """An integer (not a bool) with ``low <= value < high``."""
    return _is_int(value) and low <= value < high


def _need(ok: bool, path: Path, where: str, what: str) -> None:
    if not ok:
        raise StoreError(f"malformed manifest {path}: {where} {what}")


def name_problem(name: Any, empty_ok: bool = False) -> str | None:
    """Why ``name`` cannot be a layer (``""``: the model itself, with ``empty_ok``), parameter or capture
    point name, or ``None``."""
    if not isinstance(name, str) or not (name or empty_ok):
        return f"must be a non-empty string; got {ascii(name)[:40]}"
    if len(name) > MAX_NAME_CHARS:
        return f"is longer than {MAX_NAME_CHARS} characters"
    if _CONTROL.search(name):
        return f"holds control characters (terminal escapes): {ascii(name)[:80]}"
    return None


def check_shard_file(name: Any, path: Path, where: str) -> None:
    """A shard ``file`` must be a plain file name inside the run directory (no ``..``, ``/``, drive)."""
    _need(isinstance(name, str), path, where, f"must be a file name string; got {ascii(name)[:80]}")
    _need(
        SHARD_FILE.fullmatch(name) is not None,
        path,
        where,
        f"{ascii(name)[:80]} is not a plain *.safetensors file name in the run directory (paths and '..' are refused)",
    )


def check_layers(layers: Any, path: Path) -> None:
    """Check the ``layers`` table: names, roles, shapes within :data:`MAX_PARAM_NUMEL`, layout."""
    _need(isinstance(layers, dict), path, '"layers"', "must be an object")
    for name, layer in layers.items():
        where = f"layers[{ascii(name)[:80]}]"
        problem = name_problem(name, empty_ok=True)
        _need(problem is None, path, where, f"name {problem}")
        _need(isinstance(layer, dict), path, where, "must be an object")
        params, shapes = layer.get("params"), layer.get("param_shapes")
        _need(
            isinstance(params, dict) and bool(params) and all(name_problem(v) is None for v in params.values()),
            path,
            where,
            '"params" must map roles to parameter names (printable strings)',
        )
        _need(all(name_problem(role) is None for role in params), path, where, '"params" roles must be printable')
        _need(
            isinstance(shapes, dict) and set(shapes) == set(params),
            path,
            where,
            '"param_shapes" must give a shape per role',
        )
        for role, shape in shapes.items():
            good = isinstance(shape, list) and len(shape) <= 8 and all(in_range(d, 0, 2**31) for d in shape)
            good = good and math.prod(shape) <= MAX_PARAM_NUMEL
            _need(
                good,
                path,
                f"{where}.param_shapes[{role!r}]",
                f"must be a list of at most 8 sizes of at most {MAX_PARAM_NUMEL} elements; got {ascii(shape)[:80]}",
            )
        _need(layer.get("layout") in WEIGHT_LAYOUTS, path, where, f'"layout" must be one of {WEIGHT_LAYOUTS}')


def check_manifest(manifest: dict[str, Any], path: Path) -> None:
    """Check every field a reader uses, with bounds; raise ``ValueError`` naming the file and the field."""
    _need(in_range(manifest.get("rank"), 0, 10**9), path, '"rank"', "must be an integer in 0..10^9")
    _need(isinstance(manifest.get("config", {}), dict), path, '"config"', "must be an object")
    check_layers(manifest.get("layers"), path)
    if manifest["schema_version"] >= 2:
        return
    shards: Any = manifest.get("shards")
    _need(isinstance(shards, list), path, '"shards"', "must be a list")
    for i, shard in enumerate(shards):
        where = f"shards[{i}]"
        _need(isinstance(shard, dict), path, where, "must be an object")
        check_shard_file(shard.get("file"), path, f"{where}.file")
        _need(in_range(shard.get("bytes"), 0), path, f"{where}.bytes", "must be a byte count")
        sha = shard.get("sha256")
        _need(
            isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha) is not None,
            path,
            f"{where}.sha256",
            "must be 64 hex digits",
        )
        _need(shard.get("encoding") in ENCODING_NAMES, path, f"{where}.encoding", f"must be one of {ENCODING_NAMES}")
        batches: Any = shard.get("batches")
        _need(isinstance(batches, list), path, f"{where}.batches", "must be a list")
        for j, batch in enumerate(batches):
            _check_batch(batch, manifest, path, f"{where}.batches[{j}]")
    files = [shard["file"] for shard in shards]
    _need(len(set(files)) == len(files), path, '"shards"', "lists a shard file twice")


def _check_batch(batch: Any, manifest: dict[str, Any], path: Path, where: str) -> None:
    _need(isinstance(batch, dict), path, where, "must be an object")
    problem = name_problem(batch.get("capture_point"))
    _need(problem is None, path, f"{where}.capture_point", str(problem))
    for key in ("step", "epoch", "micro_batch"):
        _need(
            in_range(batch.get(key)), path, f"{where}.{key}", f"must be an integer within ±2^53; got {batch.get(key)!r}"
        )
    _need(batch.get("rank") == manifest["rank"], path, f"{where}.rank", "must equal the manifest's rank")
    _need(in_range(batch.get("size"), 0, 2**31), path, f"{where}.size", "must be a sample count")
    _need("lr" in batch, path, f"{where}.lr", "is missing (a number or null)")
    lr = batch["lr"]
    _need(lr is None or (_is_number(lr) and math.isfinite(lr)), path, f"{where}.lr", "must be a finite number or null")
    records = batch.get("records")
    _need(isinstance(records, list), path, f"{where}.records", "must be a list")
    for k, record in enumerate(records):
        at = f"{where}.records[{k}]"
        _need(isinstance(record, dict), path, at, "must be an object")
        _need(record.get("layer") in manifest["layers"], path, f"{at}.layer", 'is not in "layers"')
        _need(record.get("kind") in EXACT_KINDS, path, f"{at}.kind", f"must be one of {EXACT_KINDS}")
        for key in ("rows", "bytes", "dense_bytes"):
            _need(in_range(record.get(key), 0), path, f"{at}.{key}", "must be a non-negative integer")


def find_manifests(directory: Path) -> list[tuple[int, Path]]:
    """``(rank, path)`` of the rank manifests of a run directory, in rank order.

    Raises:
        StoreError: when the directory exists but cannot be listed (permissions).
    """
    try:
        entries = list(directory.iterdir()) if directory.is_dir() else []
    except OSError as exc:
        raise StoreError(f"cannot read the directory {directory}: {exc.strerror or exc}") from exc
    found = [(int(match.group(1)), p) for p in entries if (match := MANIFEST_PATTERN.fullmatch(p.name))]
    return sorted(found)
