"""Similarity and TracIn influence built on :func:`dots` and :func:`sq_norms`, and top-k rankings.

TracIn (Pruthi et al., 2020) scores a training sample ``z`` for a test sample ``z'`` as
``sum_c lr_c <grad L(w_c, z), grad L(w_c, z')>`` over checkpoints ``c``, with train and
test gradients taken at the same weights ``w_c``. Self-influence is the same with
``z' = z``: ``sum_c lr_c ||grad L(w_c, z)||^2``. Sums over layers are sums over records:
records that share a parameter (a module called twice) contribute their cross terms.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from metastore_plugins.core.errors import ConfigError, RepresentationError
from metastore_plugins.core.ops._common import DEFAULT_MAX_BYTES, record_pairs, selected_roles
from metastore_plugins.core.ops.cost import Method
from metastore_plugins.core.ops.dots import dots
from metastore_plugins.core.ops.norms import sq_norms
from metastore_plugins.core.records import LayerRecord


def _shares(a: LayerRecord, b: LayerRecord, params: Collection[str] | None) -> bool:
    return bool(set(selected_roles(a, params).values()) & set(selected_roles(b, params).values()))


def _batch_size(records: Sequence[LayerRecord], what: str) -> int:
    sizes = {r.batch_size for r in records}
    if not sizes:
        raise RepresentationError(
            f"{what} batch holds no per-sample gradient records (a capture policy kept it as metadata only: sample "
            "ids, labels and losses); ask the query of capture points that hold gradients (`metastore inspect`)"
        )
    if len(sizes) != 1:
        raise ConfigError(f"{what} records must describe one batch (one batch size), got sizes {sorted(sizes)}")
    return sizes.pop()


def total_dots(
    records_a: Sequence[LayerRecord],
    records_b: Sequence[LayerRecord],
    params: Collection[str] | None = None,
    method: Method = "auto",
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Tensor:
    """``(B_a, B_b)`` inner products of whole-model gradients (sum over every pair of records sharing a parameter)."""
    _batch_size(records_a, "first"), _batch_size(records_b, "second")
    total: Tensor | None = None
    for a, b in record_pairs(records_a, records_b, params):
        part = dots(a, b, params, method, max_bytes)  # (B_a, B_b)
        total = part if total is None else total + part
    if total is None:
        raise ConfigError("the two sets of records share no parameter; pair records of the same model")
    return total


def total_sq_norms(
    records: Sequence[LayerRecord],
    params: Collection[str] | None = None,
    method: Method = "auto",
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Tensor:
    """``(B,)`` squared norms of whole-model per-sample gradients of one batch.

    ``||sum_k g_k||^2 = sum_k ||g_k||^2 + 2 sum_{k<l} <g_k, g_l>`` for records ``k, l``
    sharing a parameter; the cross terms are the diagonals of :func:`dots`.
    """
    _batch_size(records, "the")
    total: Tensor | None = None
    for k, a in enumerate(records):
        part = sq_norms(a, params, method, max_bytes)  # (B,)
        for b in records[k + 1 :]:
            if _shares(a, b, params):
                part = part + 2.0 * torch.diagonal(dots(a, b, params, method, max_bytes))
        total = part if total is None else total + part
    if total is None:
        raise ConfigError("total_sq_norms needs at least one record")
    return total


def cosine(dot_matrix: Tensor, sq_norms_a: Tensor, sq_norms_b: Tensor, eps: float = 1e-12) -> Tensor:
    """Cosine similarities ``<g_i, g_j> / (||g_i|| ||g_j||)`` from dots ``(B_a, B_b)`` and squared norms.

    A zero gradient has cosine 0 with everything (the denominator is clamped at ``eps``).
    """
    denom = torch.outer(sq_norms_a.clamp_min(0).sqrt(), sq_norms_b.clamp_min(0).sqrt())  # (B_a, B_b)
    return dot_matrix / denom.clamp_min(eps)


def influence_scores(
    train_records_by_checkpoint: Sequence[Sequence[LayerRecord]],
    test_records_by_checkpoint: Sequence[Sequence[LayerRecord]],
    learning_rates: Sequence[float],
    params: Collection[str] | None = None,
    method: Method = "auto",
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Tensor:
    """TracIn scores ``(N_train, N_test)``: ``sum_c lr_c <g_train_i(w_c), g_test_j(w_c)>``.

    Args:
        train_records_by_checkpoint: per checkpoint, the records (all layers) of the train batch.
        test_records_by_checkpoint: per checkpoint, the records of the test batch at the same weights.
        learning_rates: per checkpoint, the learning rate in effect there.
        params: parameter names to include (every shared one by default).
        method, max_bytes: passed to :func:`dots`.

    Raises:
        ValueError: if the three sequences differ in length.
    """
    if not len(train_records_by_checkpoint) == len(test_records_by_checkpoint) == len(learning_rates):
        raise ConfigError(
            f"got {len(train_records_by_checkpoint)} train checkpoints, {len(test_records_by_checkpoint)} "
            f"test checkpoints and {len(learning_rates)} learning rates; pass one of each per checkpoint"
        )
    total: Tensor | None = None
    for train, test, lr in zip(train_records_by_checkpoint, test_records_by_checkpoint, learning_rates):
        scores = float(lr) * total_dots(train, test, params, method, max_bytes)  # (N_train, N_test)
        total = scores if total is None else total + scores
    if total is None:
        raise ConfigError("influence_scores needs at least one checkpoint")
    return total


def self_influence(
    records_by_checkpoint: Sequence[Sequence[LayerRecord]],
    learning_rates: Sequence[float],
    params: Collection[str] | None = None,
    method: Method = "auto",
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Tensor:
    """TracIn self-influence ``(N,)``: ``sum_c lr_c ||g_i(w_c)||^2`` (high values: suspicious samples)."""
    if len(records_by_checkpoint) != len(learning_rates) or not learning_rates:
        raise ConfigError(
            f"got {len(records_by_checkpoint)} checkpoints and {len(learning_rates)} learning rates; "
            "pass one learning rate per checkpoint (at least one)"
        )
    parts = [
        float(lr) * total_sq_norms(records, params, method, max_bytes)  # (N,)
        for records, lr in zip(records_by_checkpoint, learning_rates)
    ]
    return torch.stack(parts).sum(0)


@dataclass(frozen=True)
class TopK:
    """Top-k rankings along the ranked dimension, one row per other index.

    Attributes:
        proponents: ``(M, k)`` indices of the ``k`` largest scores, largest first.
        proponent_scores: ``(M, k)`` those scores.
        opponents: ``(M, k)`` indices of the ``k`` smallest (most negative) scores, smallest first.
        opponent_scores: ``(M, k)`` those scores.
    """

    proponents: Tensor
    proponent_scores: Tensor
    opponents: Tensor
    opponent_scores: Tensor


def topk(scores: Tensor, k: int, dim: int = 0) -> TopK:
    """Proponents and opponents: for an ``(N_train, N_test)`` matrix and ``dim=0``, per test sample.

    Args:
        scores: a 2-D score matrix (e.g. from :func:`influence_scores`).
        k: how many to return; clipped to the size of ``dim``.
        dim: the dimension to rank over (0: rows are candidates, one ranking per column).
    """
    if scores.dim() != 2:
        raise ConfigError(f"scores must be a 2-D matrix, got shape {tuple(scores.shape)}")
    ranked = scores if dim == 1 else scores.T  # (M, N)
    k = max(0, min(int(k), ranked.shape[1]))
    top = torch.topk(ranked, k, dim=1, largest=True, sorted=True)
    bottom = torch.topk(ranked, k, dim=1, largest=False, sorted=True)
    return TopK(top.indices, top.values, bottom.indices, bottom.values)
