"""The loss contract, and the labels, logits and per-sample losses of the common batch and output shapes.

One contract: the **batch loss** of a batch at the model's current weights, a scalar combined from the
batch's per-sample losses ``l_i`` as the run's
:data:`~metastore_plugins.core.capture.session.LossReduction` says (``mean_i l_i`` or ``sum_i l_i``).
It comes in two forms, converted at the edge: :data:`LossFn` ``(model, batch)`` is what users write
(``recompute(loss_fn=...)``, :mod:`metastore_plugins.testing`), :class:`BatchLoss` ``(batch, k)`` what an
adapter's checkpoint pass runs (``k``: the micro-batch index, which Lightning's ``training_step`` takes);
:func:`unbound_loss` turns a pass's loss into the users' form. The per-sample losses recorded with
the factors, :data:`PerSampleLossFn` (of the batch) or :data:`PerSampleLoss` (of its labels), are values, not
a loss to differentiate.

The callbacks' defaults read ``(x, y)`` batches and dicts with ``"labels"``; outputs that are logits, have
``.logits`` or ``["logits"]``; cross-entropy of ``(B, C)`` logits on ``(B,)`` class labels, and for a language
model's ``(B, T, V)`` logits on ``(B, T)`` token labels (a causal or masked LM, token classification, a seq2seq
decoder) the sum of each sequence's token losses, ``-100`` labels left out (:class:`DefaultPerSampleLoss`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from metastore_plugins.core.errors import ConfigError, LossScaleError

LABEL_KEYS = ("labels", "label", "y")
#: The label of a token no loss is taken on (padding, a prompt, an unmasked token): PyTorch's and transformers' own.
IGNORE_INDEX = -100

#: ``(model, batch) -> scalar``: the batch loss, reduced over samples as the run's loss reduction says.
LossFn = Callable[[nn.Module, Any], Tensor]
#: ``(forward output, batch) -> (B,)`` per-sample losses.
PerSampleLossFn = Callable[[Any, Any], Tensor]
#: ``(forward output, labels) -> (B,)`` per-sample losses (the plain loop's; :func:`default_per_sample_loss`).
PerSampleLoss = Callable[[Any, Tensor], Tensor]
#: ``batch -> (B,)`` labels.
LabelsFn = Callable[[Any], Tensor]


class BatchLoss(Protocol):
    """``(batch, k) -> scalar``: the batch loss of ``batch``, the ``k``-th micro-batch of a pass, at the model's
    current weights (the model is the caller's: a checkpoint pass runs it)."""

    def __call__(self, batch: Any, k: int, /) -> Tensor: ...


def unbound_loss(loss_of: BatchLoss) -> LossFn:
    """A :class:`BatchLoss` as a :data:`LossFn` (its model is already bound; each batch counts as micro-batch 0)."""
    return lambda _model, batch: loss_of(batch, 0)


__all__ = [
    "IGNORE_INDEX",
    "LABEL_KEYS",
    "BatchLoss",
    "DefaultPerSampleLoss",
    "LabelsFn",
    "LossFn",
    "PerSampleLoss",
    "PerSampleLossFn",
    "default_labels",
    "default_per_sample_loss",
    "logits_of",
    "margins_of",
    "predictions_of",
    "token_level",
    "token_losses",
    "unbound_loss",
]


def default_labels(batch: Any) -> Tensor:
    """Labels of a ``(x, y)`` batch or a dict batch with ``"labels"`` (or ``"label"``, ``"y"``)."""
    if isinstance(batch, Mapping):
        for key in LABEL_KEYS:
            if key in batch:
                return batch[key]
        raise ConfigError(
            f"the dict batch has no labels under {LABEL_KEYS} (keys: {list(batch)}); pass labels=callable(batch)"
        )
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[1]
    raise ConfigError(
        f"cannot tell the labels of a {type(batch).__name__} batch"
        + (f" of {len(batch)} elements" if isinstance(batch, (tuple, list)) else "")
        + "; the defaults read (x, y) batches and dicts with 'labels'. Pass labels=callable(batch)"
    )


def logits_of(output: Any) -> Tensor | None:
    """The ``logits`` of a forward output: a tensor, ``output.logits`` or ``output["logits"]``."""
    if isinstance(output, Mapping):
        output = output.get("logits")
    output = getattr(output, "logits", output)
    return output if isinstance(output, Tensor) else None


def token_level(logits: Tensor | None, labels: Tensor) -> bool:
    """Whether ``logits`` and ``labels`` are a language model's: ``(B, T, V)`` logits on ``(B, T)`` integer labels."""
    return (
        logits is not None
        and logits.dim() == 3
        and labels.dim() == 2
        and tuple(logits.shape[:2]) == tuple(labels.shape)
        and not (labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool)
    )


def token_losses(logits: Tensor, labels: Tensor, *, shift: bool) -> tuple[Tensor, Tensor]:
    """Each sequence's sum of token cross-entropies and the number of tokens summed (``-100`` labels left out).

    Args:
        logits: ``(B, T, V)``.
        labels: ``(B, T)`` token ids, ``-100`` where no loss is taken.
        shift: the logits at position ``t`` predict ``labels[t + 1]`` (a causal LM shifts inside the model, as
            transformers' ``ForCausalLMLoss`` does); otherwise ``labels[t]`` (masked LM, token classification,
            a seq2seq decoder's logits on its labels).

    Returns:
        ``(B,)`` float32 sums (detached) and ``(B,)`` int64 counts.
    """
    z = logits.detach().float()  # (B, T, V)
    y = labels.detach().to(z.device).long()  # (B, T)
    if shift:
        z, y = z[:, :-1], y[:, 1:]  # (B, T - 1, V), (B, T - 1)
    flat = F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none")
    return flat.view(y.shape).sum(1), (y != IGNORE_INDEX).sum(1)  # (B,), (B,)


def default_per_sample_loss(output: Any, labels: Tensor, *, shift: bool | None = None) -> Tensor:
    """Cross-entropy of ``(B, C)`` logits on ``(B,)`` class labels, per sample; for ``(B, T, V)`` logits on ``(B, T)``
    token labels, each sequence's sum of token losses (:func:`token_losses`, ``shift`` as there; it must be given)."""
    logits = logits_of(output)
    if logits is not None and token_level(logits, labels):
        if shift is None:
            raise LossScaleError(
                f"the per-sample loss of (B, T, V) logits {tuple(logits.shape)} on (B, T) token labels is the sum of "
                "each sequence's token losses, with the labels shifted by one for a causal LM or not (masked LM, token "
                "classification, seq2seq), as the model's own loss tells (MetaStoreTrainerCallback reads it); it was "
                "not told here (neither matched the model's loss: label smoothing? a loss of another kind? or a run "
                "whose loss the capture does not see built, as in Lightning). Pass per_sample_loss=callable(output, "
                "batch) -> (B,)"
            )
        return token_losses(logits, labels, shift=shift)[0]
    if logits is None or logits.dim() != 2 or labels.dim() != 1 or labels.is_floating_point():
        shape = None if logits is None else tuple(logits.shape)
        raise ConfigError(
            "the default per-sample loss is cross-entropy of (B, C) logits on (B,) class labels, or of (B, T, V) "
            f"logits on (B, T) token labels; got logits of shape {shape} and labels of shape {tuple(labels.shape)}. "
            "Pass per_sample_loss=callable(output, batch) -> (B,)"
        )
    return F.cross_entropy(logits.detach().float(), labels.to(logits.device).long(), reduction="none")


class DefaultPerSampleLoss:
    """The callbacks' per-sample loss when none is given: :func:`default_per_sample_loss` with ``shift`` remembered.

    Whether a language model's labels are shifted is told by the model's own loss, once
    (:func:`~metastore_plugins.core.training.loss_scale.learn_token_shift` sets :attr:`shift`).
    """

    def __init__(self) -> None:
        self.shift: bool | None = None  # None: not known yet (or no token-level batch seen)

    def __call__(self, output: Any, labels: Tensor) -> Tensor:
        return default_per_sample_loss(output, labels, shift=self.shift)


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
