"""Measure how a trainer scaled a model's own loss before ``backward``, instead of assuming it.

Trainers divide the loss a model returns by the number of accumulated micro-batches, or
let the model divide a sum of per-sample losses by the number of items in the whole
accumulated batch, multiply it by a mixed-precision loss scale or by the number of
processes. The stored factors must be each sample's own loss gradient whatever was done:

- :func:`per_sample_weight` tells, from the loss value and the per-sample losses, the
  weight ``c`` of each sample's loss in the model's loss ``c * sum_i l_i`` (``1/B`` for a
  mean, ``1/N`` for a sum over the ``N`` items of an accumulated batch, ``1/N`` for a
  language model's mean over the ``N`` tokens of the batch, ``1`` for a sum);
- :func:`batch_weight` does so for a run's batch, first telling a language model's head
  (:func:`learn_token_shift`: are its labels shifted, as a causal LM's are?) from its loss;
- :class:`MeasuredLossScale` reads the gradient that reaches the model's loss in
  ``backward`` (everything the trainer multiplied it by) and hands a
  :class:`~metastore_plugins.core.capture.CaptureSession` the factor to divide out, as
  its ``grad_scaler``;
- :func:`gradients_finite` tells an overflowed step (a GradScaler skips it) from its records.

Example::

    scale = MeasuredLossScale()
    run.begin_step(model, grad_scaler=scale)     # RunCapture with loss_reduction="mean"
    out = model(**batch)
    scale.watch(out.loss, per_sample_weight(out.loss, per_sample_losses, batch_size))
    trainer_backward(out.loss / accumulation_steps)
    run.end_backward()                           # factors divided by exactly what was applied
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from metastore_plugins.core.errors import ConfigError, LossScaleError
from metastore_plugins.core.model.losses import (
    IGNORE_INDEX,
    DefaultPerSampleLoss,
    LabelsFn,
    PerSampleLossFn,
    logits_of,
    token_level,
    token_losses,
)
from metastore_plugins.core.records import LayerRecord


def per_sample_weight(
    loss: Tensor | float,
    per_sample_losses: Tensor,
    num_items: Tensor | int | float | None = None,
    *,
    tokens: Sequence[int] = (),
    rtol: float = 1e-3,
) -> float:
    """The weight ``c`` with ``loss == c * sum(per_sample_losses)``: ``1/B``, ``1/num_items``, ``1/tokens`` or ``1``.

    Args:
        loss: the scalar loss the model returned.
        per_sample_losses: ``(B,)`` losses of the same samples.
        num_items: the number of items the trainer told the model to divide by, if any.
        tokens: the numbers of tokens a language model's mean over every token of the batch may divide by
            (:func:`token_counts`), each sample's loss being the sum of its token losses.
        rtol: relative tolerance of the match.

    Raises:
        LossScaleError: none of the candidates matches (the loss is not a uniform
            weighting of these per-sample losses), naming what to pass instead.
    """
    value = float(loss)
    losses = per_sample_losses.detach().double().reshape(-1)
    total, size = float(losses.sum()), losses.shape[0]
    candidates = [("mean", 1.0 / size)]
    if num_items is not None and float(num_items) > 0:
        candidates.append(("sum / num_items_in_batch", 1.0 / float(num_items)))
    candidates += [(f"sum / {count} tokens", 1.0 / count) for count in dict.fromkeys(tokens) if count > 0]
    candidates.append(("sum", 1.0))
    for _, weight in candidates:
        if math.isclose(value, weight * total, rel_tol=rtol, abs_tol=1e-6 * max(1.0, abs(value))):
            return weight
    described = ", ".join(f"{name}: {weight * total:.6g}" for name, weight in candidates)
    raise LossScaleError(
        f"the model's loss {value:.6g} is none of the expected reductions of the per-sample losses ({described}); "
        "the stored gradients would be mis-scaled. Pass per_sample_loss=callable(output, batch) -> (B,) that returns "
        "the per-sample losses the model's loss is built from (for a language model, each sequence's sum of its "
        "token losses: the default)"
    )


def token_counts(labels: Tensor) -> tuple[int, ...]:
    """The numbers of tokens a language model's mean over every token of a batch of ``(B, T)`` labels divides by:
    the labels that are not ``-100``, as they are (masked LM, token classification, seq2seq) and shifted by one
    (a causal LM); ``()`` for labels of another shape or type."""
    if labels.dim() != 2 or labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        return ()
    kept = labels != IGNORE_INDEX  # (B, T)
    return int(kept.sum()), int(kept[:, 1:].sum())


def learn_token_shift(
    default: DefaultPerSampleLoss, output: Any, labels: Tensor, loss: Tensor | float, num_items: Any = None
) -> None:
    """Set ``default.shift`` from a language model's loss: the labels shifted by one (a causal LM) or not,
    whichever makes the model's loss a reduction of the sequences' token-loss sums; left unknown when neither
    does (the default then refuses, naming ``per_sample_loss``) or the batch is not token-level."""
    logits = logits_of(output)
    if default.shift is not None or logits is None or not token_level(logits, labels):
        return
    for shift in (False, True):
        sums, counts = token_losses(logits, labels, shift=shift)  # (B,), (B,)
        try:
            per_sample_weight(loss, sums, num_items, tokens=(int(counts.sum()),))
        except LossScaleError:
            continue
        default.shift = shift
        return


class LossSource(Protocol):
    """What :func:`batch_weight` reads of a run (:class:`~metastore_plugins.core.training.run.RunCapture`)."""

    per_sample_loss: PerSampleLossFn | None
    labels: LabelsFn
    default_loss: DefaultPerSampleLoss

    def losses(self, output: Any, batch: Any) -> tuple[Tensor, Tensor]: ...


def batch_weight(run: LossSource, output: Any, batch: Any, loss: Tensor, num_items: Any = None) -> tuple[float, int]:
    """The weight ``c`` of each per-sample loss in the model's ``loss`` of ``batch`` (:func:`per_sample_weight`),
    and the batch size; a language model's head is told first (:func:`learn_token_shift`) when the run's
    per-sample loss is the default. The same in training steps and checkpoint passes."""
    labels = torch.as_tensor(run.labels(batch)).detach()
    if run.per_sample_loss is None:
        learn_token_shift(run.default_loss, output, labels, loss.detach(), num_items)
    _, losses = run.losses(output, batch)
    return per_sample_weight(loss.detach(), losses, num_items, tokens=token_counts(labels)), len(losses)


def check_loss_reduction(loss: Tensor | float, per_sample_losses: Tensor, loss_reduction: str, owner: str) -> None:
    """Raise when ``loss`` is not the ``loss_reduction`` of ``per_sample_losses`` that ``owner`` was given.

    For trainers that take the reduction as a setting (Lightning's ``training_step`` returns a
    loss the callback cannot see built): the mean and the sum of ``B > 1`` losses differ by
    ``B``, so a wrong setting would store every gradient ``B`` times too large or too small.
    A loss that is neither (label smoothing, a regulariser) cannot be checked: ``LossScaleError``.

    Raises:
        ValueError: naming the setting and the value to pass.
        LossScaleError: when the loss is no uniform weighting of the per-sample losses.
    """
    size = per_sample_losses.numel()
    weight = per_sample_weight(loss, per_sample_losses)
    if size < 2 or math.isclose(weight, 1.0 / size):  # a batch of one cannot tell mean from sum
        measured = loss_reduction
    else:
        measured = "sum" if weight == 1.0 else "mean"
    if measured != loss_reduction:
        raise ConfigError(
            f"the training loss {float(loss):.6g} is the {measured} of the batch's {size} per-sample losses, but "
            f"{owner}(loss_reduction={loss_reduction!r}) says {loss_reduction}: every stored gradient would be "
            f"{size}x too {'large' if measured == 'sum' else 'small'}. Pass {owner}(loss_reduction={measured!r})"
        )


class MeasuredLossScale:
    """The factor a model's loss was multiplied by before ``backward``, read from the gradient reaching it.

    Passed to a :class:`~metastore_plugins.core.capture.CaptureSession` (through
    ``RunCapture.begin_step(grad_scaler=...)``) of ``loss_reduction="mean"``: its
    :meth:`get_scale` returns ``upstream * c * B`` so that the session's division by
    ``get_scale() / B`` leaves each sample's own loss gradient.
    """

    def __init__(self) -> None:
        self.upstream: Tensor | None = None
        self.weight = 1.0
        self.batch_size = 1

    def watch(self, loss: Tensor, weight: float, batch_size: int) -> None:
        """Record the gradient that will reach ``loss`` (``c`` = ``weight`` over ``batch_size`` samples)."""
        self.upstream, self.weight, self.batch_size = None, float(weight), int(batch_size)
        if loss.requires_grad:
            loss.register_hook(self._keep)

    def _keep(self, grad: Tensor) -> None:
        self.upstream = grad.detach().reshape(-1)[0].clone()

    def get_scale(self) -> float:
        if self.upstream is None:
            raise LossScaleError(
                "the back-propagated loss was not computed from the model's own output loss (a compute_loss_func, "
                "label smoothing, or a compute_loss override?), so the stored gradients cannot be scaled exactly; "
                "let the model compute the loss from its `labels`"
            )
        return float(self.upstream) * self.weight * self.batch_size


def gradients_finite(records: Sequence[LayerRecord]) -> bool:
    """Whether the records' gradient tensors are finite: their max and min are (no boolean copies, one sync).

    An overflowed fp16 backward shows in the gradients; an overflowed forward makes the loss,
    and so the gradients, non-finite too.
    """
    extremes = [
        t.amax() if bound else t.amin()
        for r in records
        for key in r.gradient_keys()
        for t in (r.tensors[key],)
        if t.numel()
        for bound in (True, False)
    ]
    return not extremes or bool(torch.isfinite(torch.stack(extremes)).all())


__all__ = [
    "LossScaleError",
    "LossSource",
    "MeasuredLossScale",
    "batch_weight",
    "check_loss_reduction",
    "gradients_finite",
    "learn_token_shift",
    "per_sample_weight",
    "token_counts",
]
