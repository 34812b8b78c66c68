"""Weight snapshots in the store: the weights at a checkpoint pass, for exact recomputation.

``<store>/snapshots/<name>-rank<r>.safetensors`` holds the trainable parameters as fp32 and the
floating-point buffers (BatchNorm running statistics) in their own dtype. To save bytes a snapshot
refers to the previous one of its rank (``base`` in its metadata) and stores, per parameter ``p``
(:mod:`~metastore_plugins.core.store.snapshots.snapshot_delta`):

- nothing, when every row (dim 0) of ``p`` is bitwise equal to the base's (frozen in practice);
- ``rows/<p>`` (``(n,)`` int64 row indices) and ``part/<p>`` (``(n, ...)`` those rows), when that is
  smaller than ``p``: ``n (row_bytes + 8) < p_bytes`` (an embedding whose unseen tokens never moved);
- ``full/<p>`` otherwise. Buffers likewise, under ``buffers/full/``, ``buffers/rows/``, ``buffers/part/``.

Loading resolves the chain exactly: ``s_k`` is ``s_0`` (full) with the rows of ``s_1 .. s_k`` applied
in order, every value a bitwise copy. Files are written whole to a temporary name and renamed;
``__metadata__`` holds the format tag, name, step, rank, base, attributes (JSON), the parameters'
shapes (``shapes``, JSON) and the buffers' (``buffer_shapes``; absent in snapshots written before
buffers were kept). Writing a name again first rewrites in full the snapshots whose base it is.

Every file of ``snapshots/`` is opened through :class:`~metastore_plugins.core.store.files.StoreDir`
(never through a link, never a FIFO or device) and checked by
:mod:`~metastore_plugins.core.store.snapshots.snapshot_check` before a value of it is used: its sha256 against
``snapshots-rank{r}.jsonl`` (appended before the file is renamed into place), its header, dtypes,
shapes and values.
"""

from __future__ import annotations

import json
import os
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save
from torch import Tensor, nn

from metastore_plugins.core.errors import ConfigError, StoreError
from metastore_plugins.core.store.files import StoreDir
from metastore_plugins.core.store.shards.journal import JournalAppender, encode_line
from metastore_plugins.core.store.snapshots import snapshot_check as check
from metastore_plugins.core.store.snapshots.snapshot_delta import apply, delta

FORMAT = check.FORMAT
DIRECTORY = "snapshots"
BUFFERS = check.BUFFERS

#: A snapshot's contents: (parameters, buffers) by name; buffers None where the snapshot kept none.
Weights = tuple[dict[str, Tensor], dict[str, Tensor] | None]


@dataclass(frozen=True)
class SnapshotInfo:
    """One snapshot: its name, step, rank, file and size, base, attributes, and the sha256 recorded for it
    (None: written before checksums)."""

    name: str
    step: int
    rank: int
    path: Path
    nbytes: int
    base: str | None = None
    attributes: dict[str, Any] = field(default_factory=dict)
    sha256: str | None = None


def trainable(model: nn.Module) -> dict[str, Tensor]:
    """The trainable parameters of ``model`` by name (shared ones once)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def floating_buffers(model: nn.Module) -> dict[str, Tensor]:
    """The floating-point buffers of ``model`` by name (running statistics; not integer counters or masks)."""
    return {name: b for name, b in model.named_buffers() if b.is_floating_point()}


def snapshot_bytes(model: nn.Module) -> int:
    """Bytes of a full snapshot of ``model``: its trainable parameters as fp32 and its floating buffers."""
    buffers = sum(b.numel() * b.element_size() for b in floating_buffers(model).values())
    return 4 * sum(p.numel() for p in trainable(model).values()) + buffers


def snapshot_path(store_dir: str | os.PathLike[str], name: str, rank: int = 0) -> Path:
    """``<store_dir>/snapshots/<name>-rank<rank>.safetensors``, for a valid name and rank."""
    check.check_name(name, rank)
    return Path(store_dir) / DIRECTORY / check.file_name(name, rank)


class SnapshotWriter:
    """Writes the snapshots of one rank, each relative to the previous one (kept in memory, on the CPU).

    Args:
        store_dir: the store directory (``snapshots/`` is made in it).
        rank: the rank whose snapshots these are.
        continue_chain: the first snapshot refers to the latest one of ``rank`` already in the store
            (loaded once) instead of being written in full.
    """

    def __init__(self, store_dir: str | os.PathLike[str], rank: int = 0, *, continue_chain: bool = False) -> None:
        self.store_dir, self.rank = Path(store_dir), rank
        self._base: tuple[str, dict[str, Tensor], dict[str, Tensor] | None] | None = None
        for info in reversed(_infos(self.store_dir, rank) if continue_chain else []):  # the latest readable one
            try:
                self._base = (info.name, *_resolve(self.store_dir, info.name, rank))
                break
            except StoreError:
                continue

    def write(
        self, model: nn.Module, *, name: str, step: int, attributes: dict[str, Any] | None = None
    ) -> SnapshotInfo:
        """Write ``model``'s trainable weights (and floating buffers) as snapshot ``name``; returns what was written.

        Raises:
            ValueError: naming the parameter, when a weight is NaN or inf (nothing is written).
            StoreError: naming the file, when ``snapshots/`` or the journal is a link or not what it should be.
        """
        check.check_name(name, self.rank)
        params = {
            key: p.detach().to("cpu", torch.float32, copy=True).contiguous() for key, p in trainable(model).items()
        }
        buffers = {key: b.detach().to("cpu", copy=True).contiguous() for key, b in floating_buffers(model).items()}
        bad = [key for key, value in (params | buffers).items() if not bool(torch.isfinite(value).all())]
        if bad:
            raise ConfigError(
                f"snapshot {name!r} at step {step}: {bad[:5]} hold NaN or inf values, which no recomputation can use; "
                "the run diverged (lower the learning rate) or take the snapshot earlier"
            )
        with StoreDir(self.store_dir, create=True) as root, root.subdir(DIRECTORY, create=True) as folder:
            if folder.exists(check.file_name(name, self.rank)):
                self._detach_dependents(root, folder, name)
            base_name, base, base_buffers = (
                self._base if self._base is not None and self._base[0] != name else ("", {}, {})
            )
            tensors = delta(params, base, "") | delta(buffers, base_buffers or {}, BUFFERS)
            meta = {"name": name, "step": str(int(step)), "rank": str(self.rank), "base": base_name}
            attrs = json.dumps(attributes or {}, allow_nan=False)
            _save(root, folder, tensors, {**meta, "attributes": attrs}, (params, buffers))
        self._base = (name, params, buffers)
        return _infos(self.store_dir, self.rank, only=name, strict=True)[0]

    def _detach_dependents(self, root: StoreDir, folder: StoreDir, name: str) -> None:
        """Rewrite in full each snapshot whose base is ``name`` (about to be replaced); broken ones stay as they are."""
        for info in _infos(self.store_dir, self.rank):
            if info.base != name:
                continue
            try:
                params, buffers = _resolve(self.store_dir, info.name, self.rank)
            except StoreError:
                continue
            tensors = {f"full/{k}": v for k, v in params.items()}
            tensors |= {f"{BUFFERS}full/{k}": v for k, v in (buffers or {}).items()}
            meta = {"name": info.name, "step": str(info.step), "rank": str(self.rank), "base": ""}
            _save(root, folder, tensors, {**meta, "attributes": json.dumps(info.attributes)}, (params, buffers))


def _save(root: StoreDir, folder: StoreDir, tensors: dict[str, Tensor], meta: dict[str, str], params: Weights) -> None:
    """Record the file's sha256 in the rank's journal, then write the file whole through a temporary and rename it.

    ``params``: what it resolves to. A failed write cuts the journal line back (a crash between the two
    leaves a line whose file is the earlier one or none: never a file without its line).
    """
    shapes = [json.dumps({key: list(value.shape) for key, value in (group or {}).items()}) for group in params]
    data = save(tensors, metadata={"format": FORMAT, **meta, "shapes": shapes[0], "buffer_shapes": shapes[1]})
    rank = int(meta["rank"])
    good = check.read_journal(root, rank).good_size
    _, line = check.record_line(meta["name"], rank, int(meta["step"]), data)
    with closing(JournalAppender(root, check.journal_name(rank), good)) as journal:
        journal.append(encode_line(line))
        try:
            folder.atomic_write(check.file_name(meta["name"], rank), data)
        except BaseException:
            journal.cut(good)
            raise


def _open(store_dir: Path) -> tuple[StoreDir, StoreDir] | None:
    """The store's root and ``snapshots/`` (None when either is missing); StoreError when ``snapshots/`` is a link."""
    try:
        root = StoreDir(store_dir)
    except StoreError:
        return None
    if root.kind(DIRECTORY) is None:
        root.close()
        return None
    try:
        return root, root.subdir(DIRECTORY)
    except BaseException:
        root.close()
        raise


def _read_info(folder: StoreDir, name: str, rank: int, journal: check.Journal) -> SnapshotInfo:
    """The snapshot's header (every field checked), read alone: no tensor is read."""
    file = check.file_name(name, rank)
    path = folder.path / file
    fd, stat = folder.open_read(file)
    try:
        length = check.header_of(os.pread(fd, 8, 0), stat.st_size, path)
        meta, _ = check.check_header(os.pread(fd, length, 8), path, name, rank)
    finally:
        os.close(fd)
    records = journal.records.get(name, [])
    sha = next((r.sha256 for r in reversed(records) if r.bytes == stat.st_size), None)
    base = meta["base"] or None
    return SnapshotInfo(name, int(meta["step"]), rank, path, stat.st_size, base, meta["attributes"], sha)


def _infos(
    store_dir: Path, rank: int | None = None, strict: bool = False, only: str | None = None
) -> list[SnapshotInfo]:
    """The snapshots of ``rank`` (all: None) by step, rank, name; damaged ones raise if ``strict``, else are skipped."""
    opened = _open(store_dir) if strict else _try(lambda: _open(store_dir))
    if opened is None:
        return []
    root, folder = opened
    found, journals = [], {}
    with root, folder:
        files = [(m.group(1), int(m.group(2))) for m in map(check.FILE.fullmatch, sorted(folder.listdir())) if m]
        files = [(n, r) for n, r in files if rank in (None, r) and only in (None, n)]
        for name, file_rank in files:
            try:
                if file_rank not in journals:  # only the lines that can record these files parsed
                    journals[file_rank] = check.read_journal(root, file_rank, [n for n, r in files if r == file_rank])
                found.append(_read_info(folder, name, file_rank, journals[file_rank]))
            except StoreError:
                if strict:
                    raise
    return sorted(found, key=lambda info: (info.step, info.rank, info.name))


def _try(opener: Any) -> Any:
    try:
        return opener()
    except StoreError:
        return None


def list_snapshots(store_dir: str | os.PathLike[str]) -> list[SnapshotInfo]:
    """The snapshots of a store, by step then rank (none: an empty list). Headers only: no tensor is read.

    Raises:
        StoreError: naming the file, when a snapshot's header is damaged, or a file is a link, FIFO or device.
    """
    return _infos(Path(store_dir), strict=True)


def check_snapshots(store_dir: str | os.PathLike[str], checksums: bool = True) -> tuple[list[SnapshotInfo], list[str]]:
    """The readable snapshots of a store and one line per problem (``metastore inspect``).

    Problems: a damaged or unreadable file (with ``checksums``, every file read whole and checked),
    a damaged journal line, and a snapshot a journal records whose file is gone (``snapshots/`` deleted).
    """
    store_dir = Path(store_dir)
    try:
        root = StoreDir(store_dir)
    except StoreError:
        return [], []
    infos: list[SnapshotInfo] = []
    problems: list[str] = []
    journals: dict[int, check.Journal] = {}
    with root:
        for entry in sorted(root.listdir()):
            if match := check.JOURNAL.fullmatch(entry):
                try:
                    journals[int(match.group(1))] = journal = check.read_journal(root, int(match.group(1)))
                except StoreError as exc:
                    journals[int(match.group(1))] = journal = check.Journal({}, [str(exc)], 0)
                problems += journal.problems
        folder = None
        try:
            folder = root.subdir(DIRECTORY) if root.kind(DIRECTORY) is not None else None
        except StoreError as exc:
            problems.append(str(exc))
        files = sorted(folder.listdir()) if folder is not None else []
        for match in filter(None, map(check.FILE.fullmatch, files)):
            name, rank = match.group(1), int(match.group(2))
            journal = journals.get(rank, check.Journal({}, [], 0))
            try:
                infos.append(_read_info(folder, name, rank, journal))  # type: ignore[arg-type]  # files: folder's
                if checksums:
                    _read(folder, name, rank, journal)  # type: ignore[arg-type]
            except StoreError as exc:
                problems.append(str(exc))
        if folder is not None:
            folder.close()
    for rank, journal in journals.items():
        gone = sorted(name for name in journal.records if check.file_name(name, rank) not in files)
        if gone:
            why = "" if folder is not None else " (the folder is gone, or unreadable: see above)"
            problems.append(
                f"{store_dir / check.journal_name(rank)} records snapshots {gone[:10]} of rank {rank} whose files are "
                f"missing from {store_dir / DIRECTORY}{why}: recomputing at them cannot run; take them again, or "
                "remove their lines if deleted on purpose"
            )
    return sorted(infos, key=lambda info: (info.step, info.rank, info.name)), problems


def load_snapshot(store_dir: str | os.PathLike[str], name: str, rank: int = 0) -> dict[str, Tensor]:
    """The full fp32 weights of every trainable parameter of snapshot ``name`` (its chain of bases resolved).

    Raises:
        StoreError: naming the file, when it (or a base it refers to) is missing or damaged.
    """
    return _resolve(Path(store_dir), name, rank)[0]


def load_snapshot_state(store_dir: str | os.PathLike[str], name: str, rank: int = 0) -> Weights:
    """``(parameters, buffers)`` of snapshot ``name``: :func:`load_snapshot`'s and the floating buffers by name
    (None for a snapshot written before buffers were kept)."""
    return _resolve(Path(store_dir), name, rank)


def _read(folder: StoreDir, name: str, rank: int, journal: check.Journal) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The checked metadata and tensors of one snapshot file, its bytes verified against the journal."""
    path = folder.path / check.file_name(name, rank)
    data, _ = check.verified_bytes(folder, name, rank, journal)
    length = check.header_of(data[:8], len(data), path)
    meta, _ = check.check_header(data[8 : 8 + length], path, name, rank)
    try:
        tensors = load(data)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise StoreError(f"{path}: a damaged snapshot ({exc}); delete it and take it again") from exc
    for key, value in tensors.items():
        check.check_values(key, value, path)
    return meta, tensors


def _resolve(store_dir: Path, name: str, rank: int) -> Weights:
    check.check_name(name, rank)
    opened = _open(store_dir)
    if opened is None:
        raise StoreError(
            f"{snapshot_path(store_dir, name, rank)}: the snapshot is missing (no snapshots/); take it again"
        )
    root, folder = opened
    with root, folder:
        journal = check.read_journal(root, rank)
        chain: list[str] = []
        current: str | None = name
        while current:
            if not folder.exists(check.file_name(current, rank)):
                known = ", ".join(info.name for info in _infos(store_dir, rank)) or "none"
                what = "snapshot is" if current == name else f"base snapshot {current!r} of {name!r} is"
                path = snapshot_path(store_dir, current, rank)
                raise StoreError(f"{path}: the {what} missing (snapshots of rank {rank}: {known}); take it again")
            if current in chain:
                path = snapshot_path(store_dir, current, rank)
                raise StoreError(f"{path}: snapshot {name!r} refers to itself through its bases; take it again")
            chain.append(current)
            current = _read_info(folder, current, rank, journal).base
        groups: dict[str, dict[str, Tensor]] = {"": {}, BUFFERS: {}}
        meta: dict[str, Any] = {}
        for current in reversed(chain):  # the oldest first: the last is ``name`` itself
            meta, tensors = _read(folder, current, rank, journal)
            path = folder.path / check.file_name(current, rank)
            apply(tensors, groups, path)
            for prefix, shapes in ("", meta["shapes"]), (BUFFERS, meta.get("buffer_shapes", {})):
                values = groups[prefix] = {key: value for key, value in groups[prefix].items() if key in shapes}
                wrong = sorted(k for k, shape in shapes.items() if k not in values or [*values[k].shape] != shape)
                if wrong:
                    what = "buffers" if prefix else "parameters"
                    raise StoreError(f"{path}: a damaged snapshot: {what} {wrong[:5]} missing or of the wrong shape")
    return groups[""], groups[BUFFERS] if "buffer_shapes" in meta else None


def write_snapshot(
    store_dir: str | os.PathLike[str],
    model: nn.Module,
    *,
    name: str,
    step: int,
    rank: int = 0,
    attributes: dict[str, Any] | None = None,
) -> SnapshotInfo:
    """Write one snapshot of ``model``, relative to the latest snapshot of ``rank`` in the store (if any).

    Loads that snapshot to compare with; :class:`SnapshotWriter` keeps it in memory across writes.
    """
    writer = SnapshotWriter(store_dir, rank, continue_chain=True)
    return writer.write(model, name=name, step=step, attributes=attributes)
