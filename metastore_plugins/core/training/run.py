""":class:`RunCapture`: the capture of one process rank beside a trainer, from its first step to its close.

It owns the :class:`~metastore_plugins.core.capture.CaptureSession` of each step, the
:class:`~metastore_plugins.core.store.StoreWriter`, the capture policy, the tags and the snapshots of the run.
What one training step does is its base, :class:`~metastore_plugins.core.training.run_step.StepCapture`.
The callbacks map their framework's events onto it; what they share besides lives beside it in
:mod:`~metastore_plugins.core.training` (settings, run start, report pass) and in
:mod:`~metastore_plugins.core.model` (sample ids, losses, checkpoint pass sources).

Example::

    run = RunCapture("runs/demo/store", rank=0)  # per step: begin_step(model), backward, end_backward(),
    ...                                           # finish_step(batch, ids, step=...); at the end close()
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, closing, contextmanager, nullcontext
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from metastore_plugins.core.analysis.index_parts import PartsBuilt, build_rank_parts
from metastore_plugins.core.analysis.refine import RecomputeFn
from metastore_plugins.core.capture import CaptureSession, LayerRecord
from metastore_plugins.core.capture.batch_mixing import batch_mixed_config, batch_mixed_lines
from metastore_plugins.core.capture.layers.generic import generic_rule_lines
from metastore_plugins.core.capture.session import LossReduction
from metastore_plugins.core.heap import large_blocks_mapped
from metastore_plugins.core.model.losses import (
    BatchLoss,
    DefaultPerSampleLoss,
    LabelsFn,
    PerSampleLossFn,
    default_labels,
)
from metastore_plugins.core.model.pass_sources import START_PASS, TRAIN_SPLIT, PassSource, within_memory
from metastore_plugins.core.model.recompute import pass_recomputer
from metastore_plugins.core.policy.budget import Budget
from metastore_plugins.core.policy.plan_record import CapturePlan
from metastore_plugins.core.policy.runtime import CapturePolicy
from metastore_plugins.core.store.maintenance.compaction import CompactionReport, close_and_compact
from metastore_plugins.core.store.shards.encoding import DEFAULT_ENCODING, Encoding
from metastore_plugins.core.store.snapshots.weights import SnapshotInfo, SnapshotWriter
from metastore_plugins.core.store.tags.book import TagBook
from metastore_plugins.core.store.tags.tag_line import tag_attributes
from metastore_plugins.core.store.writing.writer import StoreWriter
from metastore_plugins.core.training.basis_fit import (
    BASIS_SAMPLES,
    BasisSource,
    fit_from_sums,
    fit_on_pass,
    fit_pass_bases,
    fits_on_pass,
    keeps_basis,
    training_source,
)
from metastore_plugins.core.training.pass_rates import PassRates
from metastore_plugins.core.training.run_step import StepCapture
from metastore_plugins.core.training.step_basis import StepSums

__all__ = ["RunCapture"]


class RunCapture(StepCapture):
    """Owns the capture session of each step and the store writer of one process rank.

    Args:
        path: the store directory.
        rank: the process rank (each rank writes its own shards).
        loss_reduction: how the training loss combines per-sample losses (``"mean"``/``"sum"``).
        per_sample_loss: ``(forward output, batch) -> (B,)``; default
            :func:`default_per_sample_loss` of the labels (:class:`DefaultPerSampleLoss`).
        labels: ``batch -> (B,)``; default :func:`default_labels`.
        encoding, flush_seconds, config: passed to :class:`StoreWriter`.
        session_options: more :class:`CaptureSession` arguments (``modules``, ``unsupported``, ...).
        owner: who runs the capture (a callback's name), for messages.
        budget: the policy and byte budget of this rank (:class:`~metastore_plugins.core.policy.budget.Budget`;
            :class:`CapturePolicy` keeps to it); default every layer exact, no budget.
        announce: called with each line of the capture plan when it is made (a logger's ``info``).
        index: build this rank's parts of the nearest-gradient index in :meth:`close`, after the last
            training step and compaction (:func:`~metastore_plugins.core.analysis.index_parts.build_rank_parts`:
            nothing during the steps; its time in ``seconds["index"]`` and docs/benchmarks.md, its bytes
            outside the budget); later ``k=`` queries and the reports then use it. A close while an
            exception is handled builds none. Off by default: a query builds the parts it needs.
        start_step: the trainer's step this run starts at (0, or where it resumes): the store's run log records
            the run's start there, and how it ended at :meth:`close`. ``None``: no start is recorded.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        rank: int = 0,
        loss_reduction: LossReduction = "mean",
        per_sample_loss: PerSampleLossFn | None = None,
        labels: LabelsFn | None = None,
        encoding: Encoding = DEFAULT_ENCODING,
        flush_seconds: float | None = 10.0,
        config: dict[str, Any] | None = None,
        session_options: dict[str, Any] | None = None,
        owner: str = "RunCapture",
        budget: Budget | None = None,
        announce: Callable[[str], None] | None = None,
        index: bool = False,
        start_step: int | None = None,
    ) -> None:
        self.path = Path(path)
        self.loss_reduction = loss_reduction
        self.per_sample_loss = per_sample_loss
        self.default_loss = DefaultPerSampleLoss()  # a language model's head is learnt from its loss (loss_scale.py)
        self.labels = labels or default_labels
        self.session_options = dict(session_options or {})
        self.writer = StoreWriter(
            self.path, rank=rank, encoding=encoding, flush_seconds=flush_seconds, config=config, run_start=start_step
        )
        self.index = index
        self.index_parts: PartsBuilt | None = None  # what close() built of the index
        self.rank = rank
        self.tags = TagBook(self.path, rank)
        self.snapshots = SnapshotWriter(self.path, rank)
        keep_for, on_change = self.tags.keep_for, self._plan_changed  # tags set what steps keep; the manifest the plan
        self.policy = CapturePolicy(
            budget or Budget(), encoding=encoding, owner=owner, on_change=on_change, keep_for=keep_for
        )
        self._announce = announce
        self.last_pass: tuple[Any, ...] | None = None  # what the last checkpoint pass ran, for recomputer()
        self.compaction: CompactionReport | None = None  # what close() merged
        self._session: CaptureSession | None = None  # attached from the first step to close()
        self._output_hook: Any = None
        self._collecting = False
        self._output: Any = None
        self._records: list[LayerRecord] | None = None  # of the last backward, unscaled
        self._scaling: Callable[[LayerRecord], LayerRecord] = lambda record: record
        self.skipped_steps = 0  # fp16 steps whose gradients overflowed: not stored
        self.owner = owner
        self._reduction_checked = False
        self.rates = PassRates()  # the optimizer steps' rates since the last pass
        #: wall seconds spent in checkpoint passes (``"passes"``) and in exact recomputation for the reports
        #: (``"refinement"``, through :meth:`recomputer`), for the end-of-training line and the benchmarks
        self.seconds: dict[str, float] = {"passes": 0.0, "refinement": 0.0, "basis": 0.0}
        #: training samples the curvature eigenbasis of projected passes is fitted on (0: seeded projections)
        self.basis_samples = BASIS_SAMPLES
        self.step_sums: StepSums | None = None  # the steps' K-FAC sums (basis_from("steps"))
        self.announce_at_first_step: Callable[[], None] | None = None
        self._starting = False  # in the start pass: a plan made there is said at the first training step
        self._basis_untested = False  # a basis-only start fit, no validation pass on it yet: the next pass keeps it

    def basis_from(self, source: BasisSource) -> None:
        """Fit each checkpoint's eigenbasis on ``basis_samples`` of its samples (``"checkpoint"``) or on the K-FAC
        sums of the training steps since the previous one (``"steps"``: :mod:`~.step_basis`)."""
        self.step_sums = StepSums() if source == "steps" else None

    # -- checkpoint passes ---------------------------------------------------------------

    def optimizer_step(self, lr: float | None) -> None:
        """Note one optimizer step and the learning rate it applies (``None``: 1), for the next pass's weight
        (:class:`~metastore_plugins.core.training.pass_rates.PassRates`)."""
        self.rates.step(lr)

    def checkpoint_pass(
        self,
        model: nn.Module,
        batches: Iterator[tuple[Tensor, Any]],
        loss_of: BatchLoss,
        *,
        capture_point: str,
        step: int,
        epoch: int,
        lr: float | None,
        context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> int:
        """Capture ``(ids, batch)`` batches at the current weights in eval mode; ``.grad``, mode and RNGs are restored.

        ``loss_of(batch, k)`` runs the model and returns the batch loss (reduced as
        ``loss_reduction`` says). Returns the number of samples captured. Whatever the batches
        and ``loss_of`` draw from the global random number generators is undone
        (:func:`~metastore_plugins.core.model.rng.preserved_rng`): training goes on as if no pass ran.
        """
        count = 0
        steps = self.capture_only_steps(model, batches, loss_of, capture_point=capture_point, context=context)
        with closing(steps):
            for k, ids, batch in steps:
                self.end_backward()
                self.finish_step(batch, ids, step=step, capture_point=capture_point, epoch=epoch, micro_batch=k, lr=lr)
                count += len(ids)
        return count

    def checkpoint_passes(
        self,
        model: nn.Module,
        sources: Sequence[PassSource],
        loss_of: BatchLoss,
        *,
        name: str,
        rank: int,
        world_size: int,
        to_device: Callable[[Any], Any],
        step: int,
        epoch: int,
        lr: float | None,
        context: Callable[[], AbstractContextManager[Any]] = nullcontext,
        attributes: Mapping[str, Any] | None = None,
        basis_only: bool = False,
    ) -> None:
        """One checkpoint pass: each source's share for this rank (:func:`rank_share`), as capture point ``name/split``.

        ``to_device`` moves a collated batch to the model's device; the rest is :meth:`checkpoint_pass`'s.
        The pass is tagged ``name`` (with ``epoch``, ``lr``: the rate the last optimizer step before
        the pass trained at, ``lr`` given (the rate now) when none ran since the previous pass, and
        ``attributes``: the metrics the trainer logged), and takes a weight snapshot when the capture
        plan has one for it. Its records carry the summed rate of the steps since the previous pass
        (:meth:`~metastore_plugins.core.training.pass_rates.PassRates.start_pass`).

        ``name`` :data:`~metastore_plugins.core.model.pass_sources.START_PASS` is the pass before the first
        training step: the validation samples only (``start/val``), the test side in in-run influence of the steps
        before the first epoch-end pass (:func:`~metastore_plugins.core.analysis.in_run.step_windows` pairs each
        step with the passes around it).
        Where the plan (made there when none is yet) projects a layer, the curvature eigenbasis is fitted first on
        the training source (the steps after it go on that basis, as after any pass). No training split, no
        snapshot, not one of the plan's ``planned_passes`` (its samples are planned beside them); nothing without a
        validation split, unless ``basis_only`` (the HF callback: no evaluation loader before the first evaluation),
        which fits that basis where the plan projects the passes; the next pass then keeps it, so that its
        validation samples are the test side of the steps before it on their own basis.
        """
        start = name == START_PASS
        captured = [source for source in sources if source.split != TRAIN_SPLIT] if start else list(sources)
        basis_only = basis_only and start and not captured and self.basis_samples > 0 and bool(sources)
        if not captured and not basis_only:
            return
        with self._start_pass(start):
            started = time.perf_counter()
            if not start:
                self.last_pass = (model, sources, loss_of, to_device, context)
            weight, trained_at = self.rates.start_pass(lr)
            attributes = {"epoch": epoch, "lr": trained_at, "pass_lr": weight, "checkpoint": True, **(attributes or {})}
            if not start and self.policy.should_snapshot(step):
                self.snapshot(model, name=name, step=step, attributes=attributes)
            if not start and self.policy.pass_dropped:
                return  # the budget keeps no part of this pass (said, and recorded in the plan): no tag, no records
            if captured:
                self.tags.add(name, steps=step, automatic=True, attributes=tag_attributes(attributes))
            captured = within_memory(
                captured, self.policy.factor_sample_bytes
            )  # batches whose factors fit PASS_BATCH_BYTES
            projecting = start or self.policy.projects_passes()  # the start pass: known once the plan is made
            fitted_on = training_source(sources) if self.basis_samples and projecting else None
            held, held_split = None, None  # the training side read once for the fit and the pass
            with large_blocks_mapped():  # the pass's temporaries leave no holes in the heap for the steps
                fitting = time.perf_counter()
                if self.step_sums is not None and not start:  # from the steps since the last pass: no forward
                    sums = self.step_sums.take()
                    if self.policy.projects_passes() or self.policy.projects_steps():
                        fit_from_sums(self.policy, sums, step)
                elif (
                    fitted_on is not None
                    and not (self._basis_untested and self.policy.bases)
                    and not keeps_basis(self.policy, fitted_on, self.basis_samples)
                ):  # the passes' projected layers go on the eigenbasis at these weights
                    own = next((s for s in captured if s.split == fitted_on.split), None) if not start else None
                    if own is not None and fits_on_pass(self.policy, own, self.basis_samples, world_size):
                        held_split = own.split
                        held = fit_on_pass(
                            self, model, ((ids, to_device(batch)) for ids, batch in own.batches(rank, world_size)),
                            loss_of, capture_point=f"{name}/{own.split}", step=step, context=context,
                        )  # fmt: skip
                    else:
                        fit_pass_bases(self, model, fitted_on, loss_of, rank=rank, world=world_size,
                                       to_device=to_device, step=step, context=context, samples=self.basis_samples,
                                       planning=start, for_passes=basis_only)  # fmt: skip
                    self._basis_untested = basis_only and bool(self.policy.bases)
                self.seconds["basis"] += time.perf_counter() - fitting  # part of the passes' seconds
                for source in captured:
                    point = f"{name}/{source.split}"
                    if held is not None and source.split == held_split:
                        for k, batch_held in enumerate(held):  # kept on the basis just fitted on them
                            self.keep(batch_held, step=step, capture_point=point, epoch=epoch, micro_batch=k, lr=weight)
                        continue
                    self.checkpoint_pass(
                        model,
                        ((ids, to_device(batch)) for ids, batch in source.batches(rank, world_size)),
                        loss_of,
                        capture_point=point,
                        step=step,
                        epoch=epoch,
                        lr=weight,
                        context=context,
                    )
                    self._basis_untested &= source.split == TRAIN_SPLIT  # validation samples on it: the test side
            self.seconds["passes"] += time.perf_counter() - started

    @contextmanager
    def _start_pass(self, start: bool) -> Iterator[None]:
        """Mark the start pass while it runs: a plan made there is said at the first training step
        (:meth:`_plan_changed`: what a training-mode step leaves out, below a BatchNorm, is known only then)."""
        self._starting = start
        try:
            yield
        finally:
            self._starting = False

    # -- plan, tags and snapshots ----------------------------------------------------------

    def tag(self, name: str, *, step: int, **options: Any) -> Any:
        """Tag ``step`` (or ``steps=(a, b)``) with ``name`` and attributes; ``keep=`` sets what those steps keep.

        ``keep="snapshot"`` takes a weight snapshot of the hooked model now. See :class:`TagBook.add`.
        """
        found = self.tags.add(name, current_step=step, **options)
        if found.keep == "snapshot" and self._session is not None:
            self.snapshot(self._session.model, name=name, step=step, attributes=found.attributes)
        return found

    def snapshot(
        self, model: nn.Module, *, name: str, step: int, attributes: Mapping[str, Any] | None = None
    ) -> SnapshotInfo:
        """Write the trainable weights of ``model`` into the store (``snapshots/``), counted in the budget."""
        info = self.snapshots.write(model, name=name, step=step, attributes=tag_attributes(attributes or {}))
        self.policy.spend(info.nbytes)
        return info

    def recomputer(self) -> RecomputeFn | None:
        """Recomputes samples of the last pass's splits exactly at a snapshot (None before any pass)."""
        if self.last_pass is None:
            return None
        model, sources, loss_of, to_device, context = self.last_pass
        inner = pass_recomputer(
            self.path, self.rank, model, sources, loss_of, to_device=to_device, context=context,
            loss_reduction=self.loss_reduction, session_options=self.session_options,
        )  # fmt: skip

        def timed(split: str, sample_ids: Sequence[int], checkpoint: str) -> Sequence[LayerRecord]:
            started = time.perf_counter()
            try:
                return inner(split, sample_ids, checkpoint)
            finally:
                self.seconds["refinement"] += time.perf_counter() - started

        return timed

    def _plan_changed(self, plan: CapturePlan) -> None:
        if self._starting and self.announce_at_first_step is None and not plan.degraded:
            # made in the start pass (eval mode): what a training-mode step leaves out is known at the first step
            self.writer.update_config({"capture_plan": plan.to_json()}, save=True)
            self.announce_at_first_step = lambda: self._plan_changed(self.policy.plan or plan)
            return
        mixed = self._session.batch_mixed_parameters() if self._session is not None else {}  # below a train-mode BN
        self.writer.update_config({"capture_plan": plan.to_json(), **batch_mixed_config(mixed)}, save=True)  # now
        if self._announce is not None and not plan.degraded:  # one message, once; slow rules named
            generic = generic_rule_lines(self._session.generic_parameters() if self._session is not None else [])
            self._announce(f"{self.owner}: " + "\n".join([*plan.lines(), *generic, *batch_mixed_lines(mixed)]))

    # -- lifecycle -----------------------------------------------------------------------

    def epoch_ended(self) -> None:
        """Have what is captured so far written as a shard (without waiting for it)."""
        self.writer.flush(wait=False)

    def checkpoint_saved(self) -> None:
        """Block until what is captured so far is on disk: the store holds every step the checkpoint saw."""
        self.writer.flush()

    def close(self, error: BaseException | None = None, *, how: str | None = None) -> None:
        """Remove hooks, write everything queued and compact this rank's small shards. Safe to call twice.

        ``error``: the exception that ends training (by default the one being handled, if any; none: training
        finished), recorded in the store's run log (``metastore inspect`` names it); ``how`` says it in the run
        log's words instead (:data:`~metastore_plugins.core.store.writing.run_log.HOW`).
        """
        error = error if error is not None else sys.exc_info()[1]
        try:
            self.abort_step()
            self._close_session()
        finally:
            self.compaction = close_and_compact(self.writer, error, how) or self.compaction
        if self.index and self.index_parts is None and error is None:  # after compaction: its shards
            self.index_parts = build_rank_parts(self.path, self.rank)
            self.seconds["index"] = self.index_parts.seconds
