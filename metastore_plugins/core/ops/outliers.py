"""Outlier scores: per-class z-scores of gradient norms and a ranking helper.

Mislabeled or atypical training samples tend to have unusually large gradients
(and self-influence) compared with other samples *of the same label*. The
per-class z-score ``(v_i - mean_c) / std_c`` with ``c`` the label of ``i`` makes
classes with different typical norms comparable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from metastore_plugins.core.errors import ConfigError


def zscore_by_class(values: Tensor, labels: Tensor, eps: float = 1e-12) -> Tensor:
    """Per-class z-scores ``(N,)`` of ``values`` ``(N,)`` (e.g. gradient norms) given ``labels`` ``(N,)``.

    Uses the population standard deviation of each class; a class whose values are
    all equal (or that has one member) gets z-score 0. Computed in float64.

    Raises:
        ValueError: if ``values`` and ``labels`` are not 1-D of one length.
    """
    if values.dim() != 1 or labels.shape != values.shape:
        raise ConfigError(
            f"values and labels must be 1-D of one length, got shapes {tuple(values.shape)} and {tuple(labels.shape)}"
        )
    classes, inverse = torch.unique(labels, return_inverse=True)  # (C,), (N,)
    v = values.double()  # (N,)
    counts = torch.bincount(inverse, minlength=classes.numel()).double()  # (C,)
    mean = v.new_zeros(classes.numel()).index_add_(0, inverse, v) / counts  # (C,)
    centred = v - mean[inverse]  # (N,)
    var = v.new_zeros(classes.numel()).index_add_(0, inverse, centred.pow(2)) / counts  # (C,)
    std = var.sqrt()[inverse]  # (N,)
    return torch.where(std > eps, centred / std.clamp_min(eps), torch.zeros_like(centred))


@dataclass(frozen=True)
class Ranking:
    """Indices ``(k,)`` into the scored samples and their scores, most suspicious first."""

    indices: Tensor
    scores: Tensor


def rank_outliers(scores: Tensor, k: int | None = None, largest: bool = True) -> Ranking:
    """The ``k`` highest (``largest=True``) or lowest scores of ``(N,)``, stably ordered.

    Equal scores keep their original order, so rankings are reproducible.
    """
    if scores.dim() != 1:
        raise ConfigError(f"scores must be 1-D, got shape {tuple(scores.shape)}")
    k = scores.numel() if k is None else max(0, min(int(k), scores.numel()))
    order = torch.sort(scores, descending=largest, stable=True).indices[:k]  # (k,)
    return Ranking(order, scores[order])
