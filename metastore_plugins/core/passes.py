"""Capture one batch into a store, and checkpoint passes: the loop pieces every adapter shares.

Example::

    with StoreWriter("runs/demo/store") as writer:
        for step, (ids, x, y) in enumerate(loader):
            loss = capture_step(model, lambda: model(x), y, ids, per_sample_ce, writer, step=step, lr=0.1)
            optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from metastore_plugins.core.capture import CaptureSession
from metastore_plugins.core.rng import preserved_rng
from metastore_plugins.core.store.writer import StoreWriter

#: ``(outputs, labels) -> (B,)`` per-sample losses.
PerSampleLoss = Callable[[Any, Tensor], Tensor]


def predictions_of(outputs: Any) -> Tensor | None:
    """Arg-max class of ``(B, C)`` logits (``None`` for other outputs)."""
    logits = getattr(outputs, "logits", outputs)
    if isinstance(logits, Tensor) and logits.dim() == 2 and logits.shape[1] > 1:
        return logits.detach().argmax(1)
    return None


def margins_of(outputs: Any, labels: Any) -> Tensor | None:
    """Classification margins ``z_y - max_{k != y} z_k`` of ``(B, C)`` logits ``z`` and ``(B,)`` class labels ``y``.

    Positive where the model predicts the label; averaged over training steps it is the "area
    under the margin" (AUM, Pleiss et al. 2020) that flags mislabeled samples. Computed in float32
    on the logits' device, detached.

    Returns:
        ``(B,)`` float32 margins, NaN for a sample whose label is not a class in ``0..C-1`` (an
        ignore index such as -100); or ``None`` (nothing is stored, as for :func:`predictions_of`)
        when the outputs are not ``(B, C)`` logits with ``C >= 2``, or the labels are not ``(B,)``
        integers (regression targets, multi-label rows). Capture never fails over this optional column.
    """
    logits = getattr(outputs, "logits", outputs)
    if not (isinstance(logits, Tensor) and logits.dim() == 2 and logits.shape[1] > 1 and isinstance(labels, Tensor)):
        return None
    if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex() or labels.dim() != 1:
        return None
    if labels.shape[0] != logits.shape[0]:
        return None
    z = logits.detach().float()  # (B, C)
    y = labels.detach().to(z.device).long()  # (B,)
    valid = (y >= 0) & (y < z.shape[1])  # (B,)
    y = torch.where(valid, y, torch.zeros_like(y))
    own = z.gather(1, y[:, None])  # (B, 1)
    others = z.scatter(1, y[:, None], float("-inf"))  # (B, C): the label's logit masked out
    margins = (own - others.max(1, keepdim=True).values).squeeze(1)  # (B,)
    return torch.where(valid, margins, torch.full_like(margins, float("nan")))


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
    writer.write(
        session.factors(),
        sample_ids=sample_ids,
        step=step,
        capture_point=capture_point,
        epoch=epoch,
        micro_batch=micro_batch,
        labels=labels,
        losses=losses.detach(),
        predictions=predictions_of(outputs),
        margins=margins_of(outputs, labels),
        lr=lr,
    )
    return losses.detach().mean()


@contextmanager
def weights_untouched(model: nn.Module) -> Iterator[None]:
    """Eval mode for a checkpoint pass; the parameters' ``.grad`` and the train/eval mode come back as they were."""
    saved = {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.grad = saved[name]


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
