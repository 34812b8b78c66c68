"""What the HF callback reads off a ``Trainer`` run: the evaluations it will schedule, the tokenizer's decoder for the
reports' tables, and where the Trainer's TensorBoard events go (the callback's event handlers are the package's
``__init__``)."""

from __future__ import annotations

import copy
import functools
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from transformers import DefaultFlowCallback, TrainerControl, TrainerState, TrainingArguments

from metastore_plugins.core.training.adapter_support import newest_event_dir


def scheduled_evaluations(args: TrainingArguments, state: TrainerState, loader: Any) -> int:
    """The evaluations this ``train()`` call will run, counted as the installed Trainer schedules them.

    ``eval_on_start`` adds one. ``"steps"``: every step from the one after ``state.global_step`` (a resumed run)
    to ``state.max_steps`` that is a multiple of ``state.eval_steps`` (the Trainer's absolute number) and not
    before ``eval_delay``, plus the last step when the installed ``DefaultFlowCallback`` evaluates at the end
    of training off the grid (transformers 5 does; asked of it, not of its version). ``"epoch"``: every epoch
    left (the Trainer's ``state.num_train_epochs``, a partial last epoch included), from ``eval_delay`` on.
    """
    strategy = str(getattr(args.eval_strategy, "value", args.eval_strategy))
    first, last = int(state.global_step), int(state.max_steps)
    delay = float(getattr(args, "eval_delay", 0) or 0)
    count = 1 if getattr(args, "eval_on_start", False) else 0
    if strategy == "steps" and last > first:
        every = max(1, int(state.eval_steps or 1))
        start = max(first + 1, math.ceil(delay))  # the first step that may evaluate
        count += max(0, last // every - (start - 1) // every)
        if last % every and last >= delay:
            probe, control = copy.copy(state), TrainerControl()  # the flow callback only sets the control
            probe.global_step = last
            DefaultFlowCallback().on_step_end(args, probe, control)
            count += bool(control.should_evaluate)
    elif strategy == "epoch":
        length = len(loader) if hasattr(loader, "__len__") else 0
        accumulation = max(1, int(args.gradient_accumulation_steps))
        per_epoch = max(1, -(-length // accumulation)) if length else 0
        done = first // per_epoch if per_epoch else 0
        epochs = min(int(state.num_train_epochs or 0), done + max(0, last - first))  # an epoch ends at a step or later
        count += sum(1 for epoch in range(done, epochs) if delay <= epoch + 1)
    return count


def token_decoder(tokenizer: Any) -> Callable[[Sequence[int]], str] | None:
    """A HF tokenizer's ``decode`` without special tokens (``None`` without a tokenizer)."""
    decode = getattr(tokenizer, "decode", None)
    return functools.partial(decode, skip_special_tokens=True) if callable(decode) else None


def report_logdirs(args: TrainingArguments, tensorboard_dir: Path | None, started: float) -> list[Path]:
    """Where the TensorBoard reports go: none unless the Trainer reports to TensorBoard; else ``tensorboard_dir``,
    or the directory of the Trainer's own TensorBoard writer (created at the start of training)."""
    report_to = args.report_to if isinstance(args.report_to, (list, tuple)) else [args.report_to]
    if "tensorboard" not in report_to and "all" not in report_to:
        return []
    if tensorboard_dir is not None:
        return [tensorboard_dir]
    if os.getenv("TENSORBOARD_LOGGING_DIR"):
        return [Path(os.path.expanduser(os.environ["TENSORBOARD_LOGGING_DIR"]))]
    runs = Path(args.output_dir or ".") / "runs"
    return [newest_event_dir(runs, started) or runs / "metastore"]
