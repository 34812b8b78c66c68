"""The nearest-gradient index kept on disk: one part per shard, the FAISS index, a manifest (``<store>/vector_index/``).

:func:`open_index` brings a capture point's index up to date: a part whose shard changed or went away
is rebuilt from the shard, a part or FAISS file that does not match its sha256 (or a damaged manifest)
is said in one warning line and rebuilt, in memory where the store cannot be written. The file
formats are :mod:`metastore_plugins.core.store.vectors.vector_files`'.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from metastore_plugins.core.analysis.scan import scan_of
from metastore_plugins.core.analysis.sketches import check_seed, compute_sketches, sketch_layers
from metastore_plugins.core.analysis.vector_search import (
    Plan,
    RowStack,
    VectorIndex,
    build_ivf,
    build_reduced,
    choose_plan,
    load_faiss,
)
from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.ops import DEFAULT_MAX_BYTES
from metastore_plugins.core.store import Selection, StoreReader
from metastore_plugins.core.store.vectors import vector_check as vc
from metastore_plugins.core.store.vectors import vector_files as vf
from metastore_plugins.core.store.vectors import vector_maps as vm

#: The sketch size of a capture point whose records are factors (a projected one uses its own ``k``).
DEFAULT_DIM = 16


def default_dim(store: StoreReader, capture_point: str, layers: Sequence[str]) -> int:
    """The largest ``k`` of the capture point's projected records (their own sketch: a layer's narrower block on
    the curvature eigenbasis, a 2-class head's 2 x 8, is zero-padded to it by ``ops.sketch``), else
    :data:`DEFAULT_DIM`."""
    memo = (str(store.path), capture_point, tuple(layers), tuple((s.file, s.sha256) for s in store.index.shards))
    if memo not in _DIMS:
        if len(_DIMS) > 64:
            _DIMS.clear()
        _DIMS[memo] = DEFAULT_DIM
        for batch in store.select(capture_point, layers=list(layers)).batches():
            kept = [max(r.tensors["projected"].shape[1:]) for r in batch.records if r.kind == "projected"]
            _DIMS[memo] = int(max(kept)) if kept else DEFAULT_DIM
            break
    return _DIMS[memo]


#: default_dim per (store, capture point, layers, listed shards): one batch read per store state, not per query.
_DIMS: dict[tuple[Any, ...], int] = {}


def open_index(
    store: StoreReader,
    capture_point: str,
    *,
    dim: int | None = None,
    seed: int = 0,
    layers: Sequence[str] | None = None,
    build: bool = True,
    plan: Plan | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    partitioned: bool = False,
) -> VectorIndex | None:
    """The capture point's index, its stale or missing parts (re)built and kept; ``None`` when ``build`` is
    False and none was ever built. ``plan`` overrides :func:`choose_plan` (tests, benchmarks). ``partitioned``:
    the index of this rank's shards only (the store's partitioned scan), its own manifest and search file."""
    order, seed = sketch_layers(store, layers), check_seed(seed)
    dim = default_dim(store, capture_point, order) if dim is None else int(dim)
    selection = store.select(capture_point, layers=order)
    mine = None
    if partitioned:
        selection = scan_of(store).part(selection, f"vector index of {capture_point!r}").selection
        mine = sorted({ref.file.name for ref in selection.refs})
    key, head = index_head(capture_point, dim, seed, order, mine)
    part_key, part_head = index_head(capture_point, dim, seed, order)  # a rank's index shares the whole one's parts
    try:
        manifest = vf.read_manifest(store.path, key)
    except StoreError as exc:
        warn_line(f"{exc}; the index is rebuilt")
        manifest = None
    if manifest is None and not build:
        return None
    if manifest is not None and {k: manifest.get(k) for k in head} != head:
        manifest = None
    known = {str(p.get("shard")): p for p in (manifest or {}).get("parts", [])}
    shard_rows: dict[str, list[int]] = {}
    for row, ref in zip(selection.batch_rows.tolist(), selection.refs):
        shard_rows.setdefault(ref.file.name, []).append(row)
    shards = tuple((shard, store.shard_sha256(shard)) for shard in shard_rows)
    cached = _OPENED.get((str(store.path), key))
    if (
        plan is None
        and manifest is not None
        and cached is not None
        and cached[0] == _signature(store, manifest, shards)
    ):
        cached[1].rebuilt = []
        return cached[1]  # nothing changed since it was opened in this process
    pieces, rebuilt, writable = [], [], True
    vf.remove_temporaries(store.path, key if partitioned else None)  # what a build killed mid-write left
    parts: list[dict[str, Any]] = []
    for shard, rows in shard_rows.items():
        sha, sub = store.shard_sha256(shard), replace(selection, batch_rows=np.asarray(rows, dtype=np.int64))
        entry: dict[str, Any] | None = known.get(shard)
        piece = load_part(store, entry, head, sha, sub) if entry is not None else None
        if piece is None:
            piece = build_piece(sub, head, max_bytes)
            entry, data = encode_part(piece, part_head, part_key, shard, sha)
            writable = writable and _write(store, entry["file"], data)
            rebuilt.append(entry["file"])
            if writable:  # read back as rows: an index larger than memory is never held whole
                piece = load_part(store, entry, head, sha, sub) or piece
        pieces.append(piece)
        parts.append(entry or {})
    ids = np.concatenate([p[0] for p in pieces]) if pieces else np.zeros(0, np.int64)
    lr = np.concatenate([p[1] for p in pieces]) if pieces else np.zeros(0)
    width = len(order) * dim * dim
    faiss, kept = load_faiss(), (manifest or {}).get("ann")
    if plan is None and isinstance(kept, dict) and kept.get("parts") == vf.parts_digest(parts):
        plan = kept_plan(kept)  # a plan asked for once, kept
    plan = plan or choose_plan(len(ids), width, faiss is not None)
    if faiss is None:
        plan = Plan()
    if plan.kind == "reduced":  # wide rows, many: the parts stay mapped, rows are read as candidates are rescored
        vectors: np.ndarray | RowStack = RowStack([p[2] for p in pieces], width)
    else:
        vectors = np.concatenate([np.asarray(p[2]) for p in pieces]) if pieces else np.zeros((0, width), np.float32)
    index = VectorIndex(capture_point, dim, ids, lr, vectors, plan, rebuilt=rebuilt)
    ann_entry = None
    if plan.kind != "flat":
        ann_entry = _open_ann(store, index, key, parts, kept, faiss)
        writable = writable and ann_entry is not None
    new = {**head, "parts": parts, "ann": ann_entry}
    if writable and (rebuilt or new != manifest):
        writable = _write(store, vf.manifest_name(key), vf.encode_manifest(new))
    if writable:
        _OPENED.pop((str(store.path), key), None)
        _OPENED[(str(store.path), key)] = (_signature(store, new, shards), index)
        while len(_OPENED) > MAX_OPENED:
            _OPENED.pop(next(iter(_OPENED)))
    return index


#: A part's sample ids (n,), learning rates (n,), vectors (n, D): in memory, or on disk (read as rows are asked for).
Piece = tuple[np.ndarray, np.ndarray, "np.ndarray | vm.PartRows"]


def index_head(
    capture_point: str, dim: int, seed: int, order: Sequence[str], shards: Sequence[str] | None = None
) -> tuple[str, dict[str, Any]]:
    """``(key, head)`` of an index: the hash naming its files, and what its manifest and parts record. ``shards``:
    an index over these shards only (a rank's), named and recorded apart by their names' sha256."""
    head = {"format": vf.FORMAT, "version": vf.VERSION, "capture_point": capture_point, "dim": dim, "seed": seed}
    head["layers"] = list(order)
    key = vf.key_hash(capture_point, dim, seed, list(order))
    if shards is None:
        return key, head
    head["shards"] = vf.sha256(json.dumps(list(shards)).encode())[:16]
    return vf.sha256(f"{key}/{head['shards']}".encode())[:16], head


def build_piece(selection: Selection, head: dict[str, Any], max_bytes: int = DEFAULT_MAX_BYTES) -> Piece:
    """A part's rows from its shard's batches (``selection``): ``vector_i`` = the row's per-layer Kronecker
    sketches side by side (``compute_sketches(..., "concat")``), with its sample id and its batch's learning rate."""
    order, dim, seed = list(head["layers"]), int(head["dim"]), int(head["seed"])
    ids, sketch = compute_sketches(selection, order, dim, seed, "concat", max_bytes)  # (n,), (n, L dim^2)
    lr = np.concatenate([np.full(ref.size, ref.lr_weight) for ref in selection.refs])  # (n,)
    return ids, lr, sketch.numpy().astype(np.float32)


def encode_part(piece: Piece, head: dict[str, Any], key: str, shard: str, sha: str) -> tuple[dict[str, Any], bytes]:
    """``(manifest entry, file bytes)`` of a part: safetensors ``vector`` (n, D) float32, ``sample_id`` (n,)
    int64, ``lr`` (n,) float64, its metadata the index's head and the shard's name and sha256 (its binding)."""
    ids, lr, vectors = piece
    data = vf.part_bytes(
        {
            "vector": torch.from_numpy(np.asarray(vectors)),
            "sample_id": torch.from_numpy(ids),
            "lr": torch.from_numpy(lr),
        },
        {**{k: str(v) for k, v in head.items()}, "shard": shard, "shard_sha256": sha},
    )
    name = vf.part_name(key, shard)
    return {"file": name, "shard": shard, "shard_sha256": sha, "rows": len(ids), "sha256": vf.sha256(data)}, data


#: Indexes opened in this process, reused while their manifest, shards and files are unchanged.
_OPENED: dict[tuple[str, str], tuple[Any, VectorIndex]] = {}
MAX_OPENED = 4


def _signature(store: StoreReader, manifest: dict[str, Any], shards: tuple[tuple[str, str], ...]) -> Any:
    """What an opened index depends on: its manifest, the shards' sha256, its files' identity (None: unknown)."""
    ann = manifest.get("ann")
    names = [str(p.get("file")) for p in manifest["parts"]] + ([str(ann.get("file"))] if isinstance(ann, dict) else [])
    files = vf.identities(store.path, names)
    return None if files is None else (vf.encode_manifest(manifest), shards, files)


def load_part(
    store: StoreReader,
    entry: dict[str, Any],
    head: dict[str, Any],
    sha: str,
    shard_rows: Selection,
    say: Callable[[str], None] | None = None,
) -> Piece | None:
    """The ``(ids, lr, vectors)`` of a listed part over ``shard_rows`` (its shard's batches of the capture point) when
    its shard's sha256 is ``sha`` and it is sound and bound to that shard by content: its sample ids and learning
    rates the shard's own (from the store's index), and one of its batches, drawn at random, sketched again from
    the shard to the part's numbers (:func:`sketch_problem`). Else None (a damaged file said in one line: a
    warning, or to ``say``). ``vectors``: a :class:`~metastore_plugins.core.store.vectors.vector_maps.PartRows`, read
    as rows are asked for."""
    shard = str(entry.get("shard"))
    if entry.get("shard_sha256") != sha or not isinstance(entry.get("file"), str):
        return None  # stale: its shard changed
    width = len(head["layers"]) * head["dim"] ** 2
    ids, lr = shard_rows.sample_ids(), np.concatenate([np.full(ref.size, ref.lr_weight) for ref in shard_rows.refs])
    try:
        cap = len(ids) * (4 * width + 16) + 4096
        tensors = vm.open_part(store.path, entry["file"], str(entry.get("sha256")), cap, "part")
        problem = vf.part_binding_problem(tensors["__metadata__"], entry) or vc.rows_problem(tensors, (ids, lr), width)
        problem = problem or sketch_problem(tensors["vector"], shard_rows, head)
        if problem is not None:
            raise StoreError(f"{store.path / vf.FOLDER / entry['file']}: {problem}")
    except (StoreError, ValueError, OSError) as exc:
        (say or warn_line)(f"{exc}; rebuilt from {shard}")
        return None
    return tensors["sample_id"], tensors["lr"], tensors["vector"]


#: A part's rows sketched again must agree to this relative error (fp32 round-off of the same sums is about 1e-7).
SKETCH_RTOL = 1e-4


def sketch_problem(vectors: vm.PartRows, shard_rows: Selection, head: dict[str, Any]) -> str | None:
    """Why a part's vectors are not its shard's sketches, or None: one batch of the shard, drawn at random (a
    manifest re-signed over scaled rows cannot know which), is sketched again and compared."""
    sizes = np.array([ref.size for ref in shard_rows.refs])  # (b,)
    if not len(sizes):
        return None
    batch = int(np.random.default_rng().integers(len(sizes)))
    one = replace(shard_rows, batch_rows=shard_rows.batch_rows[batch : batch + 1])
    order, dim, seed = list(head["layers"]), int(head["dim"]), int(head["seed"])
    want = compute_sketches(one, order, dim, seed, "concat", DEFAULT_MAX_BYTES)[1].numpy()  # (B, D)
    start = int(sizes[:batch].sum())
    got = vectors[np.arange(start, start + int(sizes[batch]))]  # (B, D)
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-30)
    if float(np.abs(got - want).max(initial=0.0)) > SKETCH_RTOL * scale:
        return f"its rows of batch {batch} are not the sketches of its shard's (scaled or replaced)"
    return None


def _open_ann(
    store: StoreReader, index: VectorIndex, key: str, parts: list[dict[str, Any]], entry: Any, faiss: Any
) -> dict[str, Any] | None:
    """Set ``index.ann``: the kept FAISS index when it was built over these parts with this plan, else a new one.
    Returns its manifest entry, or None when it could not be written (the index is then kept in memory)."""
    plan, digest = index.plan, vf.parts_digest(parts)
    wanted = ann_fields(plan, len(index.sample_ids))
    if isinstance(entry, dict) and entry.get("parts") == digest and {k: entry.get(k) for k in wanted} == wanted:
        try:
            index.ann = _read_ann(store, entry, index.vectors.shape[1], faiss)
            return dict(entry)
        except StoreError as exc:
            warn_line(f"{exc}; rebuilt")
    if plan.kind == "reduced":
        ann = index.ann = build_reduced(index.vectors, index.lr, plan, faiss)
    else:
        ann = index.ann = build_ivf(index.weighted(), plan, faiss)
    name = f"ann-{key}.faiss"
    data = faiss.serialize_index(ann).tobytes()
    index.rebuilt.append(name)
    if not _write(store, name, data):
        return None
    return {**wanted, "file": name, "sha256": vf.sha256(data), "parts": digest}


def _read_ann(store: StoreReader, entry: dict[str, Any], width: int, faiss: Any) -> Any:
    """The kept FAISS index of ``entry`` (its sha256, kind, width and rows checked before and after FAISS reads it);
    :class:`StoreError` (one line naming the file) when it is not the one the entry describes."""
    path = store.path / vf.FOLDER / str(entry["file"])
    data = vf.read_checked(store.path, entry["file"], entry["sha256"], vf.ann_cap(entry["rows"], width), "FAISS index")
    problem = vf.ann_bytes_problem(data, entry, width)
    if problem is None:
        try:
            ann = faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
        except (RuntimeError, MemoryError, ValueError) as exc:
            problem = f"FAISS cannot read it ({str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else exc!r})"
        else:
            kind = faiss.IndexIVFFlat if entry["kind"] == "ivf" else faiss.IndexPreTransform
            wide = width + 1 if entry["kind"] == "ivf" else width
            if not isinstance(ann, kind) or (ann.d, ann.ntotal) != (wide, entry["rows"]):
                problem = f"it is not the {entry['kind']} index of {entry['rows']} rows its manifest lists"
            elif entry["kind"] == "ivf" and ann.nlist != entry["nlist"]:
                problem = f"it has {ann.nlist} lists, not the {entry['nlist']} its manifest lists"
    if problem is not None:
        raise StoreError(f"{path}: {problem}")
    return ann


def ann_fields(plan: Plan, rows: int) -> dict[str, Any]:
    """What a manifest's ``ann`` entry records of the plan its file was built with (and the rows it holds)."""
    if plan.kind == "reduced":
        fields = {"metric": "inner-product", "reduced": plan.reduced, "candidates": plan.candidates}
    else:
        fields = {"metric": "l2-augmented", "nlist": plan.nlist, "nprobe": plan.nprobe}
    return {"kind": plan.kind, **fields, "rows": rows}


def kept_plan(entry: dict[str, Any]) -> Plan | None:
    """The plan a manifest's ``ann`` entry was built with; None when it names none this version knows."""
    numbers = {k: entry.get(k, 0) for k in ("nlist", "nprobe", "reduced", "candidates")}
    if entry.get("kind") not in ("ivf", "reduced") or not all(type(v) is int and v >= 0 for v in numbers.values()):
        return None
    return Plan(str(entry["kind"]), **numbers)


def _write(store: StoreReader, name: str, data: bytes) -> bool:
    try:
        vf.write(store.path, name, data)
    except (OSError, StoreError):  # read-only store, a link where the folder belongs: kept in memory
        return False
    return True


def warn_line(message: str, stacklevel: int = 2) -> None:
    """The first line of ``message`` as a warning (the index's damage and fallbacks are said in one line);
    ``stacklevel`` as :func:`warnings.warn` counts it from the caller."""
    warnings.warn(message.splitlines()[0] if message else message, stacklevel=stacklevel + 1)


def build_vector_index(
    store: StoreReader,
    capture_point: str,
    *,
    layers: Sequence[str] | None = None,
    dim: int | None = None,
    seed: int = 0,
) -> VectorIndex:
    """Build (or bring up to date) and keep the capture point's index; later ``k=`` queries use it.

    Under a partitioned scan one process builds and writes the whole index first, the others then read it,
    and each rank builds the search file of its own shards' index (``partitioned=True``: the same parts), which
    partitioned ``influence(..., k=)`` queries use.
    """
    options: dict[str, Any] = {"dim": dim, "seed": seed, "layers": layers, "build": True}
    scan = scan_of(store)
    if scan.partitioned:  # rank 0 builds; the others wait for it (the answer sent is None)
        scan.first(lambda: open_index(store, capture_point, **options) and None, f"vector index of {capture_point!r}")
        open_index(store, capture_point, partitioned=True, **options)
    index = open_index(store, capture_point, **options)
    assert index is not None  # build=True always gives one
    return index
