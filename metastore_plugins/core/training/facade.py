""":class:`RunFacade`: one training run's capture as an adapter drives it: open, steps, passes, end, reports.

Every adapter (the Lightning and HF callbacks, :func:`metastore_plugins.track` for a plain loop) holds one and
calls it from its framework's events; the facade applies the same settings, capture policy, budget, loss
check, checkpoint schedule and reports whichever adapter drives it. What it runs is
:class:`~metastore_plugins.core.training.run.RunCapture`, the run start
(:mod:`~metastore_plugins.core.training.run_start`), the plan's run shape (:mod:`.expectations`), the report
pass (:mod:`.report_pass`) and the start and end lines (:mod:`.lines`); an adapter needs nothing else of the
package than this, its settings type (:class:`~.settings.CaptureSettings`) and the framework-free helpers
of :mod:`.adapter_support` (sample ids, loaders, learning rates).

Example (the order of the calls; a plain loop's adapter, :mod:`metastore_plugins.loop`, is the shortest)::

    facade = RunFacade("MyAdapter", settings, every_n=1, every_n_setting="checkpoint_every_n_epochs")
    facade.prepare(model)
    facade.open(store_dir, model, ..., train_loader=loader, val_loader=val_loader, train_batches=..., periods=3)
    facade.checkpoint_passes(model, loader, val_loader, loss_of, name=START_PASS, ..., step=0)  # before step 0
    facade.begin_step(model); loss.backward(); facade.end_backward(); facade.finish_step(batch, ids, step=s)
    facade.optimizer_step(lr); optimizer.step()
    if facade.due(epoch): facade.checkpoint_passes(model, loader, val_loader, loss_of, name=f"epoch-{epoch}", ...)
    recompute = facade.end(); facade.reports(store_dir, step=s, rank=0, datasets=..., recompute=recompute)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from metastore_plugins.core.analysis.refine import RecomputeFn
from metastore_plugins.core.capture.session import LossReduction
from metastore_plugins.core.errors import StateError
from metastore_plugins.core.model.losses import BatchLoss
from metastore_plugins.core.model.pass_sources import START_PASS, CheckpointSchedule, PassSource, dataset_size
from metastore_plugins.core.policy.allowance import PassAllowance
from metastore_plugins.core.reports.files import DecodeFn, RenderFn, text_renderer
from metastore_plugins.core.reports.tensorboard import summary_writer
from metastore_plugins.core.training.adapter_support import end_reports, open_run, refuse_compiled, run_end
from metastore_plugins.core.training.expectations import expect_run
from metastore_plugins.core.training.lines import end_line, start_line
from metastore_plugins.core.training.report_pass import ReportResult
from metastore_plugins.core.training.run import RunCapture
from metastore_plugins.core.training.run_start import Decision
from metastore_plugins.core.training.settings import CallbackOptions, CaptureSettings

__all__ = ["FacadeHolder", "RunFacade"]


class RunFacade:
    """One run's capture, from the adapter's settings to its reports (see the module docstring).

    Args:
        owner: the adapter's name, for messages (``"MetaStoreCallback"``).
        settings: the adapter's ``**settings`` (:class:`~.settings.CaptureSettings`), checked now.
        every_n: a checkpoint pass at every ``every_n``-th epoch or evaluation (0: none); ``every_n_setting``
            names it in the adapter's signature, for the error message.
        start_pass: the adapter makes the pass before the first step (``start/val``) where the schedule does.

    Attributes:
        options, schedule: the checked settings and the checkpoint schedule.
        run: the :class:`RunCapture` from :meth:`open` to :meth:`end` / :meth:`close` (None otherwise).
        report_result: what :meth:`reports` made; seconds: the run's passes, refinement and basis time.
    """

    def __init__(
        self, owner: str, settings: CaptureSettings, *, every_n: int, every_n_setting: str, start_pass: bool = True
    ) -> None:
        self.options = CallbackOptions.of(owner, settings)
        self.schedule = self.options.schedule(every_n, every_n_setting)
        self.schedule.start_pass &= start_pass
        self.allowance: PassAllowance | None = None  # what sized the schedule (open)
        self.run: RunCapture | None = None
        self.report_result: ReportResult | None = None
        self.seconds: dict[str, float] = {}
        self.early_tags: list[tuple[str, dict[str, Any]]] = []  # tag(steps=...) before the run opens

    @property
    def owner(self) -> str:
        return self.options.owner

    @property
    def capturing(self) -> bool:
        """The run is open and captures its training steps (``capture_train_steps``)."""
        return self.run is not None and self.options.capture_train_steps

    # -- open ----------------------------------------------------------------------------

    def prepare(self, model: nn.Module, *, compiled: bool = False, compile_setting: str = "torch.compile",
                capturable: bool = False) -> None:  # fmt: skip
        """Refuse, before training, a compiled model (``compiled``: the trainer will compile it; ``compile_setting``
        names how) and ``modules=`` paths the model lacks (with ``capturable``: a model nothing of which would
        be stored)."""
        refuse_compiled(model, compiled, self.owner, compile_setting)
        self.options.check_model(model, capturable=capturable)

    def open(
        self,
        dirpath: Path,
        model: nn.Module,
        *,
        setting: str,
        resume: str,
        continuing: bool,
        step: int,
        rank: int,
        world_size: int,
        agree: Callable[[Decision], Decision],
        loss_reduction: LossReduction,
        config: dict[str, Any],
        announce: Callable[[str], None] | None,
        train_loader: Any,
        val_loader: Any,
        train_batches: int,
        train_batch_size: int,
        periods: int,
        pass_at_end: bool = False,
    ) -> Path | None:
        """Claim ``dirpath`` and open this rank's :class:`RunCapture` (:func:`~.adapter_support.open_run`: the
        first six keywords), then tell its policy the run's shape for the plan (:func:`~.expectations.expect_run`:
        the loaders' set sizes, ``train_batches`` micro-batches of ``train_batch_size`` on this rank (0: unknown),
        ``periods`` epochs or evaluations; a budget below what that needs raises, the run closed). Returns where an
        earlier store moved (``overwrite=True``), or None."""
        self.run, moved = open_run(
            self.options, dirpath, setting=setting, resume=resume, continuing=continuing, step=step, agree=agree,
            rank=rank, world_size=world_size, loss_reduction=loss_reduction, config=config, announce=announce,
            early_tags=self.early_tags,
        )  # fmt: skip
        sizes = (_size(train_loader), _size(val_loader))
        try:
            self.allowance = expect_run(
                self.options, self.run, model, self.schedule, train_batches=train_batches, sizes=sizes,
                train_batch_size=train_batch_size, periods=periods, rank=rank, world_size=world_size,
                pass_at_end=pass_at_end, start_pass=self.schedule.at_start(step),
            )  # fmt: skip
        except BaseException as error:
            self.close(error)  # a budget below the run's needs: the run's lock and writer thread go with it
            raise
        return moved

    def start_line(self, dirpath: Path, period: str) -> str:
        """The line to log when training starts (``period``: what the schedule counts, ``"epoch(s)"``)."""
        return start_line(self.options, dirpath, self.schedule, period, self.allowance)

    # -- training steps ------------------------------------------------------------------

    def begin_step(self, model: nn.Module, **options: Any) -> None:
        """Capture the coming forward and backward (:meth:`RunCapture.begin_step`), when training steps are."""
        if self.run is not None and self.options.capture_train_steps:
            self.run.begin_step(model, **options)

    def end_backward(self) -> None:
        """Read the factors of the backward just done (before a GradScaler updates its scale)."""
        if self.run is not None:
            self.run.end_backward()

    def finish_step(self, batch: Any, ids: Tensor, **meta: Any) -> None:
        """Store the step's records as the policy and budget say, the loss checked against the reduction once
        (:meth:`RunCapture.finish_step`: ``step=``, ``epoch=``, ``micro_batch=``, ``lr=``, ``batch_loss=``)."""
        if self.run is not None and self.options.capture_train_steps:
            self.run.finish_step(batch, ids, **meta)

    def optimizer_step(self, lr: float | None) -> None:
        """Note an optimizer step and its learning rate, which the next checkpoint pass stands for."""
        if self.run is not None:
            self.run.optimizer_step(lr)

    def epoch_ended(self) -> None:
        """Have the steps captured so far written (without waiting)."""
        if self.run is not None:
            self.run.epoch_ended()

    def checkpoint_saved(self) -> None:
        """Wait until every step captured so far is on disk (the trainer saved a checkpoint)."""
        if self.run is not None:
            self.run.checkpoint_saved()

    # -- checkpoint passes ---------------------------------------------------------------

    def due(self, period: int) -> bool:
        """Whether the schedule makes a checkpoint pass at epoch (or evaluation) ``period`` of an open run."""
        return self.run is not None and self.schedule.due(period)

    def checkpoint_passes(
        self,
        model: nn.Module,
        train_loader: Any,
        val_loader: Any,
        loss_of: BatchLoss,
        *,
        train_batch_size: int,
        val_batch_size: int,
        name: str,
        rank: int,
        world_size: int,
        **where: Any,
    ) -> list[PassSource]:
        """One checkpoint pass ``name`` over the schedule's samples of the two loaders' datasets; ``where``: the
        rest of :meth:`RunCapture.checkpoint_passes`'s keywords (``to_device``, ``step``, ``epoch``, ``lr``,
        ``context``, ``attributes``). ``name`` :data:`START_PASS`: the pass before the first step, made when the
        schedule makes one at ``step`` (call it right after :meth:`open`; :meth:`RunCapture.checkpoint_passes`).
        Returns its sources (none when the run is not open or no pass is made)."""
        if self.run is None or (name == START_PASS and not self.schedule.at_start(where["step"])):
            return []
        sources = self.schedule.sources(
            train_loader, val_loader, train_batch_size=train_batch_size, val_batch_size=val_batch_size
        )
        self.run.checkpoint_passes(model, sources, loss_of, name=name, rank=rank, world_size=world_size, **where)
        return sources

    def start_basis(
        self, model: nn.Module, train_loader: Any, loss_of: BatchLoss, *, train_batch_size: int, **where: Any
    ) -> None:
        """Before the first step of a run whose schedule makes passes but no start pass (no validation loader yet:
        the HF callback), the curvature eigenbasis the first steps are kept on, fitted on the pass's training
        samples where the plan projects a layer (:meth:`RunCapture.checkpoint_passes` with :data:`START_PASS` and
        no validation split); the first checkpoint pass keeps it. ``where``: :meth:`checkpoint_passes`'s other
        keywords (``rank``, ``world_size``, ``to_device``, ``step``, ``epoch``, ``lr``)."""
        if self.run is None or self.schedule.start_pass or self.schedule.every_n_epochs <= 0 or where["step"] != 0:
            return
        sources = self.schedule.sources(train_loader, None, train_batch_size=train_batch_size, val_batch_size=1)
        self.run.checkpoint_passes(model, sources, loss_of, name=START_PASS, basis_only=True, **where)

    def tag(self, name: str, step: int, **options: Any) -> Any:
        """``run.tag(name, step=step, ...)`` (see :meth:`RunCapture.tag`); before the run opens, a tag with ``steps=``
        is kept and written when it opens (:meth:`~.settings.CallbackOptions.run_capture`), and returns None."""
        if self.run is not None:
            return self.run.tag(name, step=step, **options)
        if options.get("steps") is None or options.get("keep") == "snapshot":
            raise StateError(
                f"{self.owner}.tag() before training starts needs steps=(first, last) (or steps=one step), and is "
                "written when training starts; a tag of the current step, or keep='snapshot' (the weights now), "
                "must be set while training runs: call it from a hook of your model or of a callback"
            )
        self.early_tags.append((name, dict(options)))
        return None

    # -- end -----------------------------------------------------------------------------

    def end(self) -> RecomputeFn | None:
        """Training ended: keep the run's seconds and its exact recomputation for the reports, then close it."""
        recompute, self.seconds = run_end(self.run)
        self.close()
        return recompute

    def close(self, error: BaseException | None = None, *, how: str | None = None) -> None:
        """Close the run if open (what was captured is written; ``error`` / ``how`` go to the store's run log)."""
        run, self.run = self.run, None
        if run is not None:
            run.close(error, how=how)

    def reports(
        self,
        dirpath: Path,
        *,
        step: int,
        rank: int,
        datasets: Mapping[str, Any],
        recompute: RecomputeFn | None,
        experiments: Sequence[Any] = (),
        logdirs: Sequence[Path] = (),
        decode: DecodeFn | None = None,
    ) -> ReportResult | None:
        """The end-of-training reports, when ``reports=True`` (on every rank: under DDP each scores its share).

        TensorBoard events go to the trainer's ``experiments`` (its open SummaryWriters) and to new writers on
        ``logdirs`` (closed after); ``decode`` (a tokenizer's) shows the samples' decoded ``input_ids`` in the
        tables. ``datasets``: split -> dataset, for the samples shown.
        """
        if not self.options.reports:
            return None
        writers = [summary_writer(logdir) for logdir in logdirs]
        render: RenderFn | None = text_renderer(decode, datasets)
        try:
            self.report_result = end_reports(self.options, dirpath, [*experiments, *writers], step=step, rank=rank,
                                             datasets=datasets, recompute=recompute, render=render)  # fmt: skip
        finally:
            for writer in writers:
                writer.close()
        return self.report_result

    def end_line(self, dirpath: Path, logdirs: Sequence[Path]) -> str:
        """The line to log when training ends: what was written, how long it took, how to open it."""
        return end_line(self.options, dirpath, self.report_result, logdirs, self.seconds)


def _size(loader: Any) -> int | None:
    """The size of a loader's dataset (None: unknown, or no loader)."""
    return dataset_size(getattr(loader, "dataset", None))


class FacadeHolder:
    """What an adapter shows of the run its :attr:`facade` drives: its settings, schedule, reports and seconds."""

    facade: RunFacade

    @property
    def options(self) -> CallbackOptions:
        """The adapter's checked settings."""
        return self.facade.options

    @property
    def schedule(self) -> CheckpointSchedule:
        """When checkpoint passes run, and over which samples."""
        return self.facade.schedule

    @property
    def report_result(self) -> ReportResult | None:
        """What the end-of-training reports made (None before, or with ``reports=False``)."""
        return self.facade.report_result

    @property
    def seconds(self) -> dict[str, float]:
        """Wall seconds of the run's checkpoint passes, exact recomputation and basis fits (after training)."""
        return self.facade.seconds
