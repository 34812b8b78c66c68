"""What a callback tells its run's capture policy before the first step: the run's shape, for the plan.

The plan (:mod:`~metastore_plugins.core.policy.plan`) needs the training batches and samples, the checkpoint
passes and their samples on this rank; the callbacks know them from their trainer, the schedule and the sets.
"""

from __future__ import annotations

from torch import nn

from metastore_plugins.core.model.pass_sources import CheckpointSchedule
from metastore_plugins.core.policy.allowance import PassAllowance, allot
from metastore_plugins.core.policy.budget import RunShape
from metastore_plugins.core.training.run import RunCapture
from metastore_plugins.core.training.settings import CallbackOptions


def expect_run(
    options: CallbackOptions,
    run: RunCapture,
    model: nn.Module,
    schedule: CheckpointSchedule,
    *,
    train_batches: int,
    train_batch_size: int,
    periods: int,
    sizes: tuple[int | None, int | None],
    rank: int,
    world_size: int,
    pass_at_end: bool = False,
    start_pass: bool = False,
) -> PassAllowance | None:
    """Tell the run's capture policy what the run will be, for its plan.

    ``train_batches``: training micro-batches this rank will capture (0: unknown); ``periods``: epochs (or
    evaluations) the trainer will run, each one the schedule may make a pass at; ``sizes``: the training and
    validation set sizes (None: unknown); ``pass_at_end``: the adapter runs one pass at the end of training
    when the schedule made none (the HF callback), so that one is planned too; ``start_pass``: the adapter makes
    the pass before the first step (:meth:`~metastore_plugins.core.training.run.RunCapture.start_pass`: its
    validation samples are planned besides the passes). Returns the attribution allowance that sized the schedule
    (:func:`allow`; None: the schedule as set).
    """
    train_size, val_size = sizes
    allowance = allow(options, schedule, train_batches * train_batch_size * world_size, periods, sizes)
    passes = len(allowance.periods) if allowance is not None else len(schedule.due_periods(periods))
    passes = max(passes, 1) if pass_at_end and schedule.every_n_epochs else passes
    share = lambda most, size: -(-min(most, most if size is None else size) // max(1, world_size))  # noqa: E731
    train_share = share(schedule.train_samples, train_size)
    val_share = share(schedule.val_samples, val_size) if val_size else 0
    pass_samples = train_share + val_share
    run.policy.expect(
        RunShape.of(
            model,
            train_batches=(train_batches if train_batches > 0 else -1) if options.capture_train_steps else 0,
            train_batch_size=train_batch_size,
            passes=passes,
            pass_samples=pass_samples,
            rank=rank,
            reports=options.reports,
            # the basis is fitted on the passes' training side, or on the steps' sums
            passes_on_basis=bool((run.basis_samples and train_share) or run.step_sums is not None),
            start_samples=val_share if start_pass and passes else 0,
        )
    )
    return allowance


def allow(
    options: CallbackOptions,
    schedule: CheckpointSchedule,
    trained: int,
    periods: int,
    sizes: tuple[int | None, int | None],
) -> PassAllowance | None:
    """Size ``schedule`` by the attribution allowance (:func:`~metastore_plugins.core.policy.allowance.allot`) and
    return it; None (the schedule as set) without ``attribution_time``, without captured training steps (the passes
    are then the only training side) or without the run's length. The same on resuming: the start pass the
    schedule makes on a fresh run is counted either way."""
    known = trained > 0 and periods > 0 and schedule.every_n_epochs > 0
    if options.attribution_time is None or not options.capture_train_steps or not known:
        return None
    train_size, val_size = sizes
    allowance = allot(
        options.attribution_time,
        trained,
        schedule.due_periods(periods),
        val_size=schedule.val_samples if val_size is None else val_size,
        val_most=schedule.val_samples,
        train_most=schedule.train_samples if train_size is None else min(schedule.train_samples, train_size),
        basis_most=options.basis_samples if options.basis_from == "checkpoint" else 0,
        start_pass=schedule.start_pass,
        kept=options.given,
    )
    schedule.allow(allowance.periods, allowance.val_samples, allowance.train_samples)
    return allowance
