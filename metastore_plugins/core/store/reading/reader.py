"""``StoreReader``: the storage engine's read side, which every query, report and command builds on.

It lists what a run directory holds, selects stored batches, restores per-sample gradients
and checks shards; it answers no question about them (that is
:mod:`metastore_plugins.core.analysis`, whose ``open_store`` returns a ``GradientStore``
built on this class).

Example::

    reader = StoreReader(find_store_dir("runs/demo"))          # find_store_dir: reading/locate.py
    reader.capture_points()                     # ['epoch-0/train', 'epoch-0/val', 'train']
    ids = reader.sample_ids("epoch-0/val")      # aligned with every per-sample result
    grads = reader.restore(ids[0], capture_point="epoch-0/val", layer="classifier")
    assert reader.verify() == []
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor

from metastore_plugins.core.errors import MissingDependencyError, StoreError
from metastore_plugins.core.records import KIND_CODES, PER_SAMPLE_KINDS, restore_all
from metastore_plugins.core.store.reading.batches import BatchRef, ShardFiles
from metastore_plugins.core.store.reading.disk_usage import disk_usage
from metastore_plugins.core.store.reading.health import check_store, fill_v1_samples
from metastore_plugins.core.store.reading.locate import stores_below
from metastore_plugins.core.store.reading.plan_check import plan_problems
from metastore_plugins.core.store.reading.selection import Selection
from metastore_plugins.core.store.shards import manifest as mf
from metastore_plugins.core.store.shards.index import RankIndex, StoreIndex, read_rank
from metastore_plugins.core.store.writing import run_log


def _as_range(steps: int | tuple[int, int] | None) -> tuple[int, int] | None:
    if steps is None:
        return None
    if isinstance(steps, (int, np.integer)):  # numpy integers too (metadata columns are numpy)
        return int(steps), int(steps)
    lo, hi = steps
    return int(lo), int(hi)


class StoreReader:
    """A read-only view of a run directory: every rank's manifest and index journal, as numpy columns.

    Per-sample results follow *selection order*: batches by (step, micro-batch, rank, position
    in the rank's journal), samples in batch order. A sample seen at several steps (``"train"``
    over several epochs) appears once per occurrence; checkpoint passes hold each sample once.

    Opening reads no shard. The first read of a shard in the process checks its size, tensor keys
    and (with ``checksums``, the default) its checksum against the index (the line's ``xxh3_128``,
    or ``sha256`` in older lines); later reads reuse the checked bytes while the file is unchanged
    (:mod:`~metastore_plugins.core.store.reading.readcache`). A damaged shard raises :class:`StoreError`
    naming the file, and the other shards stay readable.
    """

    def __init__(self, path: str | os.PathLike[str], *, checksums: bool = True) -> None:
        self.path = Path(path)
        manifests = mf.find_manifests(self.path)
        if not manifests:
            what = "does not exist" if not self.path.exists() else "holds no manifest-rank*.json"
            below = stores_below(self.path) if self.path.is_dir() else []
            hint = f"; stores below it: {', '.join(map(str, below))}" if below else ""
            raise StoreError(f"{self.path} is not a metastore store: it {what}{hint}")
        self.ranks_read: list[RankIndex] = [read_rank(self.path, rank, path) for rank, path in manifests]
        self.manifests = [rank.manifest for rank in self.ranks_read]
        self._layers = merged_layers(self.path, manifests, self.manifests)
        entries = [entry for rank in self.ranks_read for entry in rank.entries]
        #: what opening found and left out (journal lines, unreadable version 1 shards); verify() lists it
        self.open_problems = [problem for rank in self.ranks_read for problem in rank.problems]
        self.open_problems += fill_v1_samples(self.path, entries, self._layers, checksums)
        self.index = StoreIndex(entries, self._layers)
        self._files = ShardFiles(self.path, self.index, checksums)
        #: how the runs that wrote the store went (:mod:`~metastore_plugins.core.store.writing.run_log`), the steps it
        #: lacks after an error writing it, and the line that says so (None: complete)
        self.run_log = run_log.read_run_log(self.path)
        self.gaps: list[run_log.Gap] = run_log.missing_steps(self.run_log.sessions)
        self.incomplete = run_log.incomplete_note(self.gaps, self.run_log.sessions)

    # -- listing -------------------------------------------------------------------------

    @property
    def config(self) -> dict[str, Any]:
        """The run configuration (rank zero's, merged over ranks)."""
        merged: dict[str, Any] = {}
        for manifest in reversed(self.manifests):
            merged.update(manifest.get("config", {}))
        return merged

    def capture_points(self) -> list[str]:
        names = self.index.capture_point_names
        return [names[i] for i in np.unique(self.index.batch["capture_point"])] if len(self.index) else []

    def steps(self, capture_point: str | None = None) -> list[int]:
        return np.unique(self.index.batch["step"][self._rows_of(capture_point)]).tolist()

    def epochs(self, capture_point: str | None = None) -> list[int]:
        return np.unique(self.index.batch["epoch"][self._rows_of(capture_point)]).tolist()

    def ranks(self) -> list[int]:
        return sorted(int(m["rank"]) for m in self.manifests)

    def layers(self) -> list[str]:
        return list(self._layers)

    def layer_info(self, layer: str) -> dict[str, Any]:
        """Parameters, shapes and layout of a layer, and how its records are represented."""
        self.check_layers([layer])
        records = self.index.record
        at = records["layer"] == self.index.layer_names.index(layer) if len(records["layer"]) else np.zeros(0, bool)
        codes, counts = np.unique(records["kind"][at], return_counts=True)
        return {**self._layers[layer], "kinds": {KIND_CODES[int(c)]: int(n) for c, n in zip(codes, counts)}}

    def parameters(self) -> dict[str, tuple[int, ...]]:
        """Captured parameter name -> shape."""
        return {
            name: tuple(info["param_shapes"][role])
            for info in self._layers.values()
            for role, name in info["params"].items()
        }

    def layer_params(self, layer: str) -> dict[str, str]:
        """A layer's captured parameters: role (``"weight"``, ``"bias"``, ...) -> parameter name."""
        self.check_layers([layer])
        return dict(self._layers[layer]["params"])

    def shard_sha256(self, file_name: str) -> str:
        """The sha256 the index lists for a shard file (``BatchRef.file.name``)."""
        return self.index.shards[self._files.by_name[file_name]].sha256

    def sample_ids(self, capture_point: str | None = None, **where: Any) -> np.ndarray:
        """``(N,)`` dataset indices in selection order; see :meth:`select` for ``where``."""
        return self.select(capture_point, **where).sample_ids()

    def metadata(self, capture_point: str | None = None, **where: Any) -> dict[str, np.ndarray]:
        """Per-sample columns.

        sample_id, label, loss, prediction, margin (-1 or NaN where not stored), step, epoch,
        micro_batch, rank, lr, capture_point.
        """
        return self.select(capture_point, **where).metadata()

    def table(self, capture_point: str | None = None, **where: Any) -> Any:
        """:meth:`metadata` as a ``pyarrow.Table``: ``.to_pandas()``, ``polars.from_arrow(...)``, duckdb.

        Needs pyarrow (``pip install metastore_plugins[table]``; the ``hf`` extra has it).
        """
        try:
            import pyarrow
        except ImportError as exc:
            raise MissingDependencyError("store.table() needs pyarrow: pip install 'metastore_plugins[table]'") from exc
        columns = self.metadata(capture_point, **where)
        columns["capture_point"] = columns["capture_point"].astype(str)
        return pyarrow.table(columns)

    def to_parquet(self, path: str | os.PathLike[str], capture_point: str | None = None, **where: Any) -> Path:
        """Write :meth:`table` as a Parquet file at ``path`` (returned)."""
        import pyarrow.parquet

        pyarrow.parquet.write_table(self.table(capture_point, **where), str(path))
        return Path(path)

    def learning_rate(self, capture_point: str) -> float | None:
        """The learning rate recorded with a capture point (its last batch's)."""
        rows = self._rows_of(capture_point)
        return self._files.ref(int(rows[-1])).lr if len(rows) else None

    # -- selection -----------------------------------------------------------------------

    def select(
        self,
        capture_point: str | None = None,
        *,
        steps: int | tuple[int, int] | None = None,
        epochs: int | Iterable[int] | None = None,
        sample_ids: Iterable[int] | None = None,
        layers: Sequence[str] | None = None,
    ) -> Selection:
        """Choose batches by capture point, inclusive step range and epochs, then samples and layers.

        Raises:
            StoreError: naming an unknown capture point or layer.
        """
        rows = self._rows_of(capture_point)
        batch = self.index.batch
        window = _as_range(steps)
        if window is not None:
            steps_of = batch["step"][rows]
            rows = rows[(window[0] <= steps_of) & (steps_of <= window[1])]
        if epochs is not None:
            wanted = [int(epochs)] if isinstance(epochs, (int, np.integer)) else [int(e) for e in epochs]
            rows = rows[np.isin(batch["epoch"][rows], wanted)]
        if layers is not None:
            layers = [layers] if isinstance(layers, str) else list(layers)
            self.check_layers(layers)
        ids = None if sample_ids is None else np.unique(np.asarray(list(sample_ids), dtype=np.int64).reshape(-1))
        if self.incomplete is not None and run_log.covers(self.gaps, capture_point, self.steps(capture_point), window):
            run_log.warn_incomplete(
                self.path, self.incomplete, stacklevel=3
            )  # once per query (GradientStore's methods)
        return Selection(self._files, rows, ids, None if layers is None else tuple(layers))

    def batch_refs(self, capture_point: str | None = None) -> list[BatchRef]:
        """The stored batches of a capture point (all when ``None``), in selection order.

        Raises:
            StoreError: naming an unknown capture point.
        """
        return [self._files.ref(int(row)) for row in self._rows_of(capture_point)]

    def _rows_of(self, capture_point: str | None) -> np.ndarray:
        """Rows of the index's batch columns of a capture point (all when ``None``), in selection order."""
        if capture_point is None:
            return np.arange(len(self.index))
        names = self.index.capture_point_names
        code = names.index(capture_point) if capture_point in names else -1
        rows = np.flatnonzero(self.index.batch["capture_point"] == code) if len(self.index) else np.zeros(0, np.int64)
        if not len(rows):
            why = f" ({self.incomplete})" if self.incomplete is not None else ""
            raise StoreError(
                f"unknown capture point {capture_point!r} in {self.path}; "
                f"it has: {', '.join(self.capture_points()) or 'none'}{why}"
            )
        return rows

    def check_layers(self, layers: Iterable[str]) -> None:
        """Raise :class:`StoreError` naming any layer the store does not hold."""
        unknown = [layer for layer in layers if layer not in self._layers]
        if unknown:
            raise StoreError(
                f"unknown layer(s) {', '.join(map(repr, unknown))}; the store has: {', '.join(self._layers)}"
            )

    # -- restoring -----------------------------------------------------------------------

    def restore(
        self,
        sample_id: int,
        *,
        capture_point: str | None = None,
        step: int | None = None,
        layer: str | None = None,
    ) -> dict[str, Tensor]:
        """The dense per-sample gradient of one stored sample: parameter name -> ``param.shape``.

        Raises:
            StoreError: if the sample is not stored there, or is stored at several
                (capture point, step) pairs and they were not given.
        """
        selection = self.select(
            capture_point, steps=step, sample_ids=[sample_id], layers=None if layer is None else [layer]
        )
        found = list(selection.batches())
        if not found:
            where = f" at capture point {capture_point!r}" if capture_point else ""
            where += f" at step {step}" if step is not None else ""
            raise StoreError(f"sample {sample_id} is not stored{where}")
        places = sorted({(b.ref.capture_point, b.ref.step) for b in found})
        if len(places) > 1 or found[0].size > 1:
            shown = ", ".join(f"{cp}@{s}" for cp, s in places[:10])
            raise StoreError(f"sample {sample_id} is stored more than once ({shown}); pass capture_point and step")
        _check_restore_size(found[0].records, sample_id)
        grads = restore_all(found[0].records)
        return {name: grad[0] for name, grad in grads.items()}

    # -- health --------------------------------------------------------------------------

    def verify(self, checksums: bool = True) -> list[str]:
        """Problems found, one readable line each; empty when every listed shard is sound.

        Index lines that were ignored, listed shards that are not sound (missing, not a regular
        file, size, sha256, tensor keys, sample ids), journal columns (labels, losses, predictions,
        margins, step, epoch, lr) that contradict the shard's own tensors or description (queries
        serve the journal's; the shard is what was written), and files that look like shards but
        are not listed. Only regular files inside the store are read. A store capture stopped writing
        after an error (a full disk) says so first (:attr:`incomplete`), with run-log lines not read. A rank's
        recorded capture plan that no planner wrote is named with its manifest.
        """
        problems = self.open_problems + [self.incomplete or ""] + self.run_log.problems + plan_problems(self.manifests)
        return [p for p in problems if p] + check_store(self.path, self.index, self._files, checksums)

    def summary(self) -> dict[str, Any]:
        """Sizes on disk against the dense fp32 per-sample gradients the store stands for.

        ``bytes_on_disk``: every file of the store directory, by part in ``bytes_by_part``
        (:func:`~metastore_plugins.core.store.reading.disk_usage.disk_usage`: shards, snapshots, index, caches, reports,
        other); ``shard_bytes``: the listed shards, which ``compression`` compares with ``dense_bytes``.
        """
        shards = self.index.shards
        on_disk = sum(entry.bytes for entry in shards)
        usage = disk_usage(self.path, {entry.file for entry in shards})
        dense = int(self.index.record["dense_bytes"].sum())
        batch = self.index.batch
        return {
            "path": str(self.path),
            "ranks": self.ranks(),
            "shards": len(shards),
            "samples": int(batch["size"].sum()) if len(self.index) else 0,
            "capture_points": {cp: len(self._rows_of(cp)) for cp in self.capture_points()},
            "steps": len(np.unique(batch["step"])) if len(self.index) else 0,
            "layers": len(self._layers),
            "encodings": sorted({entry.encoding for entry in shards}),
            "bytes_on_disk": sum(usage.values()),
            "bytes_by_part": usage,
            "shard_bytes": on_disk,
            "dense_bytes": dense,
            "compression": dense / on_disk if on_disk else None,
            "index_problems": len(self.open_problems),
        }


#: The fields of a layer every rank must give alike.
_LAYER_SPEC = ("params", "param_shapes", "layout")


def merged_layers(
    directory: Path, names: Sequence[tuple[int, Path]], manifests: Sequence[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Every rank's layers in one table; :class:`StoreError` when two ranks describe a layer differently.

    Ranks of one run capture one model, so a layer's ``params``, ``param_shapes`` and ``layout`` are the same in
    every manifest; a store whose ranks disagree (a permuted shape, a flipped layout) would restore gradients of
    the wrong shape or transposed for one rank's batches, so it is refused whole, naming both manifests.
    """
    layers: dict[str, dict[str, Any]] = {}
    first: dict[str, str] = {}
    for (_, path), manifest in zip(names, manifests):
        for name, spec in manifest["layers"].items():
            known = layers.get(name)
            field = next((k for k in _LAYER_SPEC if known is not None and known.get(k) != spec.get(k)), None)
            if known is not None and field is not None:
                raise StoreError(
                    f"{path}: layers[{ascii(name)[:80]}].{field} is {ascii(spec.get(field))[:120]} but "
                    f"{first[name]} says {ascii(known.get(field))[:120]}: the ranks of {directory} describe the layer "
                    "differently (manifests of different models?); every rank must describe each layer alike, "
                    "so restore the right manifest or open the ranks' files in separate directories"
                )
            if known is None:
                layers[name], first[name] = spec, path.name
    return layers


#: The most bytes of dense fp32 gradients one :meth:`StoreReader.restore` call builds (all its layers together),
#: ``$METASTORE_MAX_RESTORE_BYTES`` or 8 GiB: checked against the manifest's shapes before anything is allocated,
#: so a manifest that declares a huge layer (``[2**31 - 1, 8]``: 64 GiB) is refused instead of filling memory.
DEFAULT_MAX_RESTORE_BYTES = 2**33


def max_restore_bytes() -> int:
    """:data:`DEFAULT_MAX_RESTORE_BYTES`, or ``$METASTORE_MAX_RESTORE_BYTES`` (a non-negative integer) when set."""
    text = os.environ.get("METASTORE_MAX_RESTORE_BYTES", "").strip()
    return int(text) if text.isdigit() else DEFAULT_MAX_RESTORE_BYTES


def _check_restore_size(records: Sequence[Any], sample_id: int) -> None:
    """Refuse a restore whose dense gradients (one sample, every record's parameters) pass :func:`max_restore_bytes`.

    The size comes from the manifest's ``param_shapes``, the shapes restore allocates (an embedding's
    ``(B, V, d)``, an outer record's ``(B, G d_out, d_in)``), before anything is allocated.
    """
    cap, total, largest = max_restore_bytes(), 0, ("", 0)
    for record in records:
        if record.kind in PER_SAMPLE_KINDS:
            continue  # dense records are already in memory; projected and norms records are refused by restore
        nbytes = 4 * record.batch_size * sum(math.prod(shape) for shape in record.param_shapes.values())
        total += nbytes
        largest = max(largest, (record.layer, nbytes), key=lambda pair: pair[1])
    if total > cap:
        raise StoreError(
            f"restoring sample {sample_id} would build {total} bytes of dense gradients, over the "
            f"{cap}-byte cap (METASTORE_MAX_RESTORE_BYTES); layer {largest[0]!r} takes {largest[1]} bytes "
            f"(its manifest shapes: {dict(next(r.param_shapes for r in records if r.layer == largest[0]))}): "
            "check that layer's manifest, restore another layer with layer=..., or raise the cap"
        )


__all__ = ["StoreError", "StoreReader"]
