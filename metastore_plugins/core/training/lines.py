"""The lines a callback logs when training starts and ends, and where its time went after the training steps."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from metastore_plugins.core.model.pass_sources import CheckpointSchedule
from metastore_plugins.core.policy.allowance import PassAllowance
from metastore_plugins.core.store.writing.run_log import store_incomplete
from metastore_plugins.core.training.settings import CallbackOptions


def start_line(
    options: CallbackOptions,
    store_dir: Path,
    schedule: CheckpointSchedule,
    period: str,
    allowance: PassAllowance | None = None,
) -> str:
    """The one line a callback logs when training starts: where the store goes, and what it keeps (the passes as
    ``allowance`` sized them, where it did)."""
    steps = "every training step" if options.capture_train_steps else "no training steps"
    passes = (
        f"checkpoint passes every {schedule.every_n_epochs} {period} over at most {schedule.train_samples} "
        f"training and {schedule.val_samples} validation samples"
        if schedule.every_n_epochs
        else "no checkpoint passes"
    )
    if allowance is not None:
        at = ", ".join(str(p + 1) for p in allowance.periods)
        passes = f"{allowance.line()}, after {period} {at}"
    return f"{options.owner}: per-sample gradients of {steps} and {passes} go to {store_dir} ({options.encoding})"


def end_line(
    options: CallbackOptions,
    store_dir: Path,
    result: Mapping[str, Any] | None,
    logdirs: Sequence[Path],
    seconds: Mapping[str, float] | None = None,
) -> str:
    """The one line a callback logs when training ends: what was written (and whether the store is incomplete: its
    run log), how long the passes and the reports took (``seconds``: :attr:`RunCapture.seconds`), how to open it."""
    how = [f"metastore inspect {store_dir}"] + [f"tensorboard --logdir {logdir}" for logdir in logdirs]
    seconds = seconds or {}
    refined = seconds.get("refinement", 0.0)
    incomplete = store_incomplete(store_dir)
    if result is None:
        made = "no reports" if options.reports else "reports off"
    else:
        of = f", of which {refined:.1f} s recomputing samples exactly" if refined else ""
        made = f"reports in {store_dir / 'reports'} (built in {result.get('seconds', 0.0):.1f} s{of})"
    passes = f"; checkpoint passes took {seconds['passes']:.1f} s" if seconds.get("passes") else ""
    written = f"written ({incomplete})" if incomplete else "written"
    return f"{options.owner}: store {store_dir} {written}, {made}{passes}; open with: {' | '.join(how)}"


def phase_seconds(seconds: Mapping[str, float], result: Mapping[str, Any] | None) -> dict[str, float]:
    """Where a callback's time went after its training steps: ``pass_seconds`` (checkpoint passes),
    ``report_seconds`` (the reports, recomputation included), ``refine_seconds`` (the reports' exact
    recomputation) and ``basis_seconds`` (fitting the projected passes' eigenbasis, part of the passes);
    ``seconds`` is the callback's ``seconds``, ``result`` its ``report_result``."""
    return {
        "pass_seconds": round(seconds.get("passes", 0.0), 2),
        "report_seconds": round((result or {}).get("seconds", 0.0), 2),
        "refine_seconds": round(seconds.get("refinement", 0.0), 2),
        "basis_seconds": round(seconds.get("basis", 0.0), 2),  # fitting the passes' eigenbasis (in pass_seconds)
    }
