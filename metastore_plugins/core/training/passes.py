"""Capture one batch into a store, and checkpoint passes, at the lowest level: no capture policy, no budget, no
loss check, no reports.

Deprecated for training loops (issue 48): :func:`metastore_plugins.track` captures a plain PyTorch loop with
the callbacks' policy, budget, loss check, checkpoint passes and reports (docs/loop.md). These stay for tests
and benchmarks that write a store of exact factors directly.

Example::

    with StoreWriter("runs/demo/store") as writer:
        for step, (ids, x, y) in enumerate(loader):
            loss = capture_step(model, lambda: model(x), y, ids, per_sample_ce, writer, step=step, lr=0.1)
            optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import Tensor, nn

from metastore_plugins.core.capture import CaptureSession
from metastore_plugins.core.model.losses import PerSampleLoss, margins_of, predictions_of
from metastore_plugins.core.model.rng import preserved_rng, weights_untouched
from metastore_plugins.core.records import BatchMeta
from metastore_plugins.core.store.writing.writer import StoreWriter


def capture_step(
    model: nn.Module,
    forward: Callable[[], Any],
    labels: Tensor,
    sample_ids: Tensor,
    per_sample_loss: PerSampleLoss,
    writer: StoreWriter,
    *,
    step: int,
    capture_point: str = "train",
    epoch: int = 0,
    micro_batch: int = 0,
    lr: float | None = None,
    loss_scale: float = 1.0,
    session_options: dict[str, Any] | None = None,
) -> Tensor:
    """Forward, backward of ``loss_scale * mean(per-sample losses)``, and queue the records.

    Gradients accumulate into ``.grad`` as in plain training; the stored records are each
    sample's own loss gradient. Returns the (unscaled) mean loss, detached.
    """
    with CaptureSession(model, loss_reduction="mean", loss_scale=loss_scale, **(session_options or {})) as session:
        outputs = forward()
        losses = per_sample_loss(outputs, labels)  # (B,)
        (losses.mean() * loss_scale).backward()
    outcome = losses.detach(), predictions_of(outputs), margins_of(outputs, labels)
    at = BatchMeta(sample_ids, step, capture_point, epoch, micro_batch, labels, *outcome, lr)
    writer.write(session.factors(), at)
    return losses.detach().mean()


def checkpoint_pass(
    model: nn.Module,
    batches: Iterable[tuple[Tensor, Callable[[], Any], Tensor]],
    per_sample_loss: PerSampleLoss,
    writer: StoreWriter,
    *,
    capture_point: str,
    step: int,
    epoch: int = 0,
    lr: float | None = None,
    session_options: dict[str, Any] | None = None,
) -> None:
    """Capture ``(sample ids, forward, labels)`` batches at the current weights, in eval mode.

    ``lr``: the weight TracIn gives the pass, the summed learning rate of the optimizer steps
    since the previous pass (``sum_{t in (c-1, c]} lr_t``, the steps the pass stands for).

    The weights, the parameters' ``.grad`` and the global random number generators are left
    as they were: a checkpoint pass never changes training.
    """
    with weights_untouched(model), preserved_rng():
        for k, (ids, forward, labels) in enumerate(batches):
            capture_step(
                model,
                forward,
                labels,
                ids,
                per_sample_loss,
                writer,
                step=step,
                capture_point=capture_point,
                epoch=epoch,
                micro_batch=k,
                lr=lr,
                session_options=session_options,
            )
