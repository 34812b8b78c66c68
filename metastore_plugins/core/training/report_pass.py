"""The end-of-training report pass: the analysis of a store, its files and TensorBoard events, in one call.

:func:`report_run` runs the queries (self-influence, the training steps' norms, the last pass's
sketches, influence) and writes what :mod:`~metastore_plugins.core.reports` builds from them;
:func:`build_reports` is the callbacks' call of it (their settings, every rank, errors as warnings).
Both return a :class:`ReportResult`.

Example::

    writer = summary_writer("runs/demo/tb")                  # torch.utils.tensorboard.SummaryWriter
    result = report_run("runs/demo/store", "runs/demo/reports", [writer])
    result.outliers[0]["sample_id"] == result["outliers"][0]["sample_id"]
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from metastore_plugins.core.analysis import GradientStore, open_store
from metastore_plugins.core.analysis.method_table import AUTO
from metastore_plugins.core.analysis.refine import RecomputeFn
from metastore_plugins.core.analysis.signals import TRAINING_STEPS
from metastore_plugins.core.errors import DistributedQueryError
from metastore_plugins.core.heap import large_blocks_mapped
from metastore_plugins.core.model.rng import preserved_rng
from metastore_plugins.core.policy.plan_record import projected_size
from metastore_plugins.core.reports import RenderFn, report_tables, write_tables
from metastore_plugins.core.reports.dynamics import dynamics_norms, gradient_map, write_dynamics
from metastore_plugins.core.reports.files import REPORTS_ELSEWHERE
from metastore_plugins.core.reports.partitioned import agreed, distributed, report_store, share_of, writes
from metastore_plugins.core.reports.render import SampleLookup
from metastore_plugins.core.reports.samples import renderers
from metastore_plugins.core.reports.stored import keep_within_budget, stored_self_influence, with_gradients
from metastore_plugins.core.reports.tables import checkpoint_points, outlier_points
from metastore_plugins.core.reports.tensorboard import (
    FIGURES,
    SummaryWriterLike,
    report_figures,
    self_influence_table,
    write_projector,
    write_tensorboard,
)
from metastore_plugins.core.store.reading.readcache import SHARDS
from metastore_plugins.core.store.reading.record_memo import MEMO_BYTES, RECORDS
from metastore_plugins.core.store.writable import check_writable
from metastore_plugins.core.store.writing.run_log import noted_once, one_note, store_incomplete
from metastore_plugins.core.training.settings import CallbackOptions

#: The most shard bytes the read cache holds while a callback builds its reports (in the trainer's process;
#: the default allowance, up to 4 GiB, is for a query process of its own). Below it, a shard read again
#: costs a read from the page cache and a checksum.
REPORT_CACHE_BYTES = 512 * 2**20


@dataclass(eq=False)
class ReportResult(Mapping[str, Any]):
    """What a report pass made; read as attributes or, as before, as a mapping of the fields that are set.

    A rank other than 0 of a partitioned pass holds ``partition`` alone (``result.keys() == {"partition"}``).

    Attributes:
        outliers, influence: the rows of the outlier and influence tables (``influence``: ``[]`` without test passes).
        outlier_columns, outlier_caption: the outlier table's columns and the lines that say what ranks its rows.
        files: the files written (tables, summary, figures the store's budget kept).
        grids: the figures of image samples drawn (``"outliers"``, ``"influence"``).
        figures, tags: the figure tags drawn and the TensorBoard tags written.
        partition: what this rank scored of a partitioned pass
            (:func:`~metastore_plugins.core.reports.partitioned.share_of`); None in one process.
        seconds: how long the pass took (set by :func:`build_reports`).
    """

    outliers: list[dict[str, Any]] | None = None
    influence: list[dict[str, Any]] | None = None
    outlier_columns: Sequence[str] | None = None
    outlier_caption: list[str] | None = None
    files: list[str] | None = None
    grids: list[str] | None = None
    figures: list[str] | None = None
    tags: list[str] | None = None
    partition: dict[str, Any] | None = None
    seconds: float | None = None

    def _set(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def __getitem__(self, key: str) -> Any:
        return self._set()[key]  # a KeyError naming an option not set

    def __iter__(self) -> Iterator[str]:
        return iter(self._set())

    def __len__(self) -> int:
        return len(self._set())

    def __repr__(self) -> str:
        return f"ReportResult({self._set()!r})"


def projector_dim(store: GradientStore) -> int:
    """The sketch size of the projector view: a projected store's projections, else 8."""
    return projected_size(store.path, store.manifests) or 8


@noted_once  # an incomplete store is warned about once in the pass (and said in the outlier table's caption)
@RECORDS.active(MEMO_BYTES)  # each record decoded once for the several questions the reports ask
def report_run(
    store_dir: str | os.PathLike[str] | GradientStore,
    reports_dir: str | os.PathLike[str],
    writers: Sequence[SummaryWriterLike] = (),
    *,
    step: int = 0,
    k: int = 20,
    train_split: str = "train",
    test_split: str = "val",
    dynamics: bool = True,
    projector: bool = True,
    render: RenderFn | None = None,
    samples: SampleLookup | None = None,
    outliers_from: str = "auto",
    recompute: RecomputeFn | None = None,
    rank_outliers_by: str = "auto",
    per_layer_scalars: bool = False,
    influence_method: str = AUTO,
) -> ReportResult | None:
    """Files via :func:`~metastore_plugins.core.reports.write_reports` into ``reports_dir``, and the same reports
    to each writer.

    ``store_dir``: the store's path, or an opened store. A
    :class:`~metastore_plugins.core.distributed.DistributedStore` runs the pass on every rank of its
    group (call it on each, with the same arguments): the queries split the scoring, in this order
    on every rank: self-influence; when rank 0 has writers (a broadcast flag), the norms of the
    training steps and the sketches of the last pass; influence. Then rank 0 alone refines
    (``recompute``), renders, draws and writes files and events; the other ranks ignore ``writers``,
    ``render``, ``samples`` and ``recompute``, and return a result of ``partition`` alone
    (:func:`~metastore_plugins.core.reports.partitioned.share_of`), which rank 0's result holds too.

    ``render(split, sample id)`` adds each sample's text to the tables (see ``write_reports``).
    ``outliers_from="training"`` takes self-influence in-run over the training steps instead of at
    the checkpoint passes (:func:`~metastore_plugins.core.reports.tables.outlier_points`);
    ``rank_outliers_by`` chooses the ranking (:func:`~metastore_plugins.core.reports.tables.outlier_scores`),
    ``influence_method`` what scores the influence table (``"auto"``: EK-FAC where the passes can be
    preconditioned, else TracIn; :func:`~metastore_plugins.core.reports.influence_table.influence_rows`).
    The loss-vs-self-influence scatter is saved as ``loss_vs_self_influence.png`` and logged as
    ``metastore/loss_vs_self_influence``; the data map (``data_map.png``, ``metastore/data_map``)
    and the heatmap of the training steps' gradient norms (``gradient_norms.png``,
    ``metastore/gradient_norms``) where they hold what these need. ``samples(split, sample id)``
    returns dataset items: where they are small images, a thumbnail grid of the top outliers and a
    figure for each of the first ``INFLUENCE_FIGURES`` influence rows are written too
    (``outliers.png``, ``influence-val_{id}.png`` and ``metastore/outlier_samples``,
    ``metastore/influence_samples/val_{id}``). ``per_layer_scalars``:
    a gradient-norm scalar chart per layer besides the summary scalars (``write_dynamics``).
    ``recompute`` refines estimated influence scores exactly
    (a projected store; :func:`~metastore_plugins.core.analysis.refine.refine_influence`). Figures
    need matplotlib; without it they are skipped with a warning and everything else is written.

    Returns the :class:`ReportResult`, or ``None`` (with a warning) when the store holds no checkpoint
    passes to report on.
    """
    store = store_dir if isinstance(store_dir, GradientStore) else open_store(store_dir)
    writing, since = writes(store), len(getattr(store, "shares", ()))
    points = checkpoint_points(store, train_split)
    if not points and TRAINING_STEPS not in store.capture_points():
        why = store.incomplete or "checkpoint passes were turned off or no epoch finished"
        if writing:
            warnings.warn(
                f"no reports: the store {store.path} holds no checkpoint passes 'epoch-*/{train_split}' ({why})",
                stacklevel=2,
            )
        return None
    if writing:  # a folder that cannot be written (a read-only store's reports/): said before the work, not after
        check_writable(Path(reports_dir), REPORTS_ELSEWHERE)
    sources = outlier_points(store, points, outliers_from)
    scores = stored_self_influence(store, sources)  # read once, for the table and the histograms
    views = agreed(store, bool(writers), "report: whether rank 0 writes TensorBoard events")
    norms = dynamics_norms(store) if views and dynamics and with_gradients(store, [TRAINING_STEPS]) else None
    sketched = with_gradients(store, points[-1:], inner=True)  # what the budget kept of the last pass
    sketches = (  # (N, d^2); no cache file: the reports keep to the store's budget
        store.sketches(sketched[0], dim=projector_dim(store), cache=False) if views and projector and sketched else None
    )
    tables = report_tables(
        store,
        train_split=train_split,
        test_split=test_split,
        k=k,
        render=render if writing else None,
        scores=scores,
        outliers_from=outliers_from,
        recompute=recompute if writing else None,  # the model runs on rank 0 only, without collectives
        rank_outliers_by=rank_outliers_by,
        influence_method=influence_method,
    )  # its influence query is the last collective: what follows on rank 0 keeps no other rank waiting
    if store.incomplete:  # the tables' first line says what they lack
        tables["outlier_caption"] = [store.incomplete, *tables.get("outlier_caption", [])]
    partition = share_of(store, since)
    if not writing:
        return ReportResult(partition=partition)
    written = write_tables(store, Path(reports_dir), tables)
    table = self_influence_table(store, sources, scores)
    gmap = gradient_map(norms, store.metadata(TRAINING_STEPS)["step"]) if norms is not None else None
    figures, pngs = report_figures(
        written,
        table,
        samples,
        Path(reports_dir),
        train_split=train_split,
        test_split=test_split,
        gmap=gmap,
        store=store,
    )
    files = keep_within_budget(store, written["files"] + [str(path) for path in pngs])  # figures past it: not kept
    kinds = {tag.partition("/")[0] for tag in figures}  # outlier_samples, influence_samples: image samples
    tags: list[str] = []
    result = ReportResult(
        outliers=written["outliers"],
        influence=written["influence"],
        outlier_columns=written["outlier_columns"],
        outlier_caption=written["outlier_caption"],
        files=files,
        grids=[FIGURES[kind] for kind in ("outlier_samples", "influence_samples") if kind in kinds],
        figures=list(figures),
        tags=tags,
        partition=partition,
    )
    for writer in writers:
        tags += write_tensorboard(writer, dict(result), table, step=step, figures=figures)
        if norms is not None:  # the training steps hold gradients
            tags += write_dynamics(writer, store, norms=norms, per_layer_scalars=per_layer_scalars)
        if sketches is not None:
            dim = projector_dim(store)
            tags += write_projector(writer, store, points[-1], step=step, dim=dim, sketches=sketches)
        flush = getattr(writer, "flush", None)
        if callable(flush):
            flush()
    return result


def build_reports(
    options: CallbackOptions, store_dir: Path, writers: Sequence[Any], *, step: int, rank: int = 0, **sources: Any
) -> ReportResult | None:
    """The end-of-training reports of a callback with ``options`` into ``<store_dir>/reports`` and ``writers``.

    Call it on every rank. Under a process group of several ranks, each opens the store
    partitioned and scores its share; rank 0 writes (docs/distributed.md): ``writers`` and
    ``sources`` (:func:`report_run`'s ``render=``, ``samples=``, ``recompute=``) count on rank 0
    only, and the other ranks return a result of ``partition`` alone. ``sample_renderer`` replaces
    ``render=`` and ``samples=``. Without one, ranks other than 0
    return ``None`` at once. A store the reports cannot be built from (no class predictions
    of a regression model, say), or a rank that failed mid-pass, gives a warning, not an
    error: the store is complete, and training ended well. Whatever building them draws from
    the global random number generators (a dataset's augmentation, read for thumbnails) is undone.
    """
    if rank != 0 and not distributed():
        return None
    if rank == 0 and options.sample_renderer is not None:  # the user's rendering replaces the callback's
        text, lookup = renderers(options.sample_renderer)
        sources = {**sources, "render": text, "samples": lookup}
    started = time.perf_counter()
    try:
        # no shard bytes kept after; an incomplete store is said in the reports' caption, not by each query
        with preserved_rng(), SHARDS.within(REPORT_CACHE_BYTES), large_blocks_mapped(), one_note(str(store_dir)):
            result = report_run(
                report_store(store_dir),
                store_dir / "reports",
                writers if rank == 0 else (),
                step=step,
                k=options.report_k,
                outliers_from=options.outliers_from,
                rank_outliers_by=options.rank_outliers_by,
                influence_method=options.influence_method,
                per_layer_scalars=options.per_layer_scalars,
                **(sources if rank == 0 else {}),
            )
        if result is not None:
            result.seconds = time.perf_counter() - started
        return result
    except (KeyError, ValueError, DistributedQueryError) as exc:
        where = f" on rank {rank}" if distributed() else ""
        complete = "is complete" if store_incomplete(store_dir) is None else "is incomplete (see metastore inspect)"
        warnings.warn(
            f"{options.owner} could not build the reports{where} ({exc!r}); the store {store_dir} {complete}. "
            "Pass reports=False to skip them",
            stacklevel=3,
        )
        return None
