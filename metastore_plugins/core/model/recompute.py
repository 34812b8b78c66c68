"""Exact per-sample gradients recomputed on demand: chosen samples, at a weight snapshot's weights.

The store vs recompute trade: a store kept under ``policy="auto"`` holds projections and exact
norms, and a weight snapshot at each checkpoint pass. :func:`recompute` runs forward and
backward for exactly the samples asked, at the snapshot's weights, under capture, and returns
their exact records: the same numbers a checkpoint pass with ``policy="exact"`` would have kept
(up to float rounding: batches are formed anew).

Example::

    records = recompute(model, train_set, [3, 17], store_dir="runs/demo/metastore", snapshot="epoch-1")
    ops.total_sq_norms(records)      # exact ||g_i(w_epoch-1)||^2 of samples 3 and 17
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import default_collate

from metastore_plugins.core.capture import CaptureSession, LayerRecord
from metastore_plugins.core.capture.session import LossReduction
from metastore_plugins.core.errors import ConfigError, QueryError, StoreError
from metastore_plugins.core.model.losses import BatchLoss, LossFn, default_labels, logits_of, unbound_loss
from metastore_plugins.core.model.pass_sources import PassSource, indexed_batches
from metastore_plugins.core.model.rng import preserved_rng, weights_untouched
from metastore_plugins.core.store.reading.selection import join_records
from metastore_plugins.core.store.snapshots.weights import floating_buffers, load_snapshot_state, trainable


def default_loss(model: nn.Module, batch: Any, reduction: LossReduction = "mean") -> Tensor:
    """Loss of a batch: ``model(**batch).loss`` for dicts (a mean over samples, as HF models compute it),
    else cross-entropy of ``model(x)`` (or of the dict's output logits) on the labels.

    ``reduction="sum"`` returns ``B`` times the mean: ``sum_i loss_i``.
    """
    if isinstance(batch, Mapping):
        output = model(**batch)
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    else:
        output, loss = model(batch[0]), None
    if not isinstance(loss, Tensor):
        logits = logits_of(output)
        if logits is None:
            raise ConfigError("the model's output holds no logits; pass loss_fn=callable(model, batch) -> batch loss")
        loss = F.cross_entropy(logits, default_labels(batch).long())
    return loss * len(default_labels(batch)) if reduction == "sum" else loss


def recompute(
    model: nn.Module,
    dataset: Any,
    sample_ids: Sequence[int],
    *,
    store_dir: str | os.PathLike[str] | None = None,
    snapshot: str | None = None,
    rank: int = 0,
    loss_fn: LossFn | None = None,
    loss_reduction: LossReduction = "mean",
    collate_fn: Callable[[list[Any]], Any] | None = None,
    to_device: Callable[[Any], Any] | None = None,
    batch_size: int = 32,
    session_options: Mapping[str, Any] | None = None,
) -> list[LayerRecord]:
    """Exact records of ``dataset[i]`` for ``i`` in ``sample_ids`` (one batch, in that order), in eval mode.

    Row ``k`` of every record is sample ``sample_ids[k]`` (repeats allowed), its gradient that of its
    own loss ``g_k = grad_w loss(f_w(x_k), y_k)`` at the snapshot's weights ``w``: pass the records to
    :func:`~metastore_plugins.core.ops.total_sq_norms` for ``||g_k||^2`` or to
    :func:`~metastore_plugins.core.ops.total_dots` for ``<g_k, g_l>``.

    Args:
        model: the model (its live weights, buffers, ``.grad``, mode and the RNG states are restored after).
        dataset: a map-style dataset whose items ``collate_fn`` batches: ``(x, y)`` tuples or dicts.
        store_dir, snapshot: the weights to use: the snapshot's parameters and floating buffers
            (the model's current weights when ``snapshot`` is None).
        loss_fn: ``(model, batch) -> scalar`` batch loss; ``loss_reduction`` says how it combines
            per-sample losses. Default: :func:`default_loss` (cross-entropy), reduced as ``loss_reduction`` says.
        collate_fn: batches a list of items (default ``torch.utils.data.default_collate``).
        to_device: moves a batch to the model's device (default: tensors to the model's device).
        batch_size: samples per forward and backward.
        session_options: more :class:`CaptureSession` arguments (``modules``, ``unsupported``).

    Raises:
        StoreError: naming the file, when the snapshot (or a base of it) is missing or damaged, or its
            parameters or buffers do not match ``model``'s.
        ValueError: for no sample ids, ``batch_size < 1`` or a ``snapshot`` without ``store_dir``.
    """
    ids = [int(i) for i in sample_ids]
    if not ids:
        raise ConfigError("recompute needs at least one sample id")
    if batch_size < 1:
        raise ConfigError(f"recompute(batch_size=...) must be >= 1; got {batch_size}")
    if snapshot is not None and store_dir is None:
        raise ConfigError(f"recompute(snapshot={snapshot!r}) needs store_dir=, the store that holds the snapshot")
    weights, buffers = (None, None) if snapshot is None else load_snapshot_state(store_dir or ".", snapshot, rank)
    collate = collate_fn or default_collate
    device = next(model.parameters()).device
    move = to_device or (lambda batch: _to(batch, device))
    batches = (move(collate([dataset[i] for i in ids[lo : lo + batch_size]])) for lo in range(0, len(ids), batch_size))
    return recompute_batches(
        model,
        batches,
        weights=weights,
        buffers=buffers,
        loss_fn=loss_fn,
        loss_reduction=loss_reduction,
        session_options=session_options,
        snapshot=repr(snapshot),
    )


def recompute_batches(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    weights: dict[str, Tensor] | None,
    buffers: dict[str, Tensor] | None = None,
    loss_fn: LossFn | None = None,
    loss_reduction: LossReduction = "mean",
    context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    session_options: Mapping[str, Any] | None = None,
    snapshot: str = "the snapshot",
) -> list[LayerRecord]:
    """Exact records of ``batches`` (joined as one batch) at ``weights`` (the live ones when None), in eval mode.

    ``buffers`` (floating buffers by name, e.g. BatchNorm running statistics) are used too when given;
    ``loss_fn`` defaults to :func:`default_loss` reduced as ``loss_reduction`` says.
    The live weights, buffers, ``.grad``, mode and RNG states are restored afterwards, also on error.
    """
    loss_of: LossFn = loss_fn or functools.partial(default_loss, reduction=loss_reduction)
    if weights is not None:
        _checked(weights, trainable(model), snapshot, "parameters")
    if buffers is not None:
        _checked(buffers, floating_buffers(model), snapshot, "buffers")
    parts: list[list[LayerRecord]] = []
    with (
        weights_untouched(model),
        preserved_rng(),
        _weights(trainable(model), weights),
        _weights(floating_buffers(model), buffers),
    ):
        for batch in batches:
            with CaptureSession(model, loss_reduction=loss_reduction, **dict(session_options or {})) as session:
                session.capture_only = True  # no weight gradients: only what the records need
                with torch.enable_grad(), context():
                    loss = loss_of(model, batch)
                session.backward(loss)
            parts.append(session.factors())
            model.zero_grad(set_to_none=True)
    if not parts:
        raise ConfigError("recompute needs at least one batch")
    # backward hooks of parallel branches (a BERT's three embeddings) fire in any order: align by layer
    aligned = [sorted(part, key=lambda record: record.layer) for part in parts]  # stable: calls stay in order
    signatures = {tuple((r.layer, r.kind) for r in part) for part in aligned}
    if len(signatures) > 1:
        raise ConfigError("the recomputed batches captured different layers (a layer without gradient in some)")
    return join_records(aligned)


def _checked(weights: dict[str, Tensor], params: dict[str, Tensor], snapshot: str, what: str) -> None:
    shapes = [n for n in set(params) & set(weights) if tuple(params[n].shape) != tuple(weights[n].shape)]
    wrong = {"not in the snapshot": set(params) - set(weights), "not in the model": set(weights) - set(params)}
    parts = [f"{how} {sorted(names)[:5]}" for how, names in {**wrong, "of another shape": shapes}.items() if names]
    if parts:
        raise StoreError(
            f"snapshot {snapshot} does not fit this model: {what} {'; '.join(parts)}; recompute with the model "
            "the run trained (the same trainable parameters)"
        )


class _weights:
    """Load ``weights`` into ``params`` for the block, and put the live values back after (even on error)."""

    def __init__(self, params: dict[str, Tensor], weights: dict[str, Tensor] | None) -> None:
        self.params, self.weights = params, weights
        self.saved: dict[str, Tensor] = {}

    def __enter__(self) -> None:
        if self.weights is None:
            return
        with torch.no_grad():
            for name, param in self.params.items():
                self.saved[name] = param.detach().clone()
                param.copy_(self.weights[name].to(param.device, param.dtype))

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for name, value in self.saved.items():
                self.params[name].copy_(value)


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {key: _to(value, device) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to(value, device) for value in batch)
    return batch


def pass_recomputer(
    store_dir: str | os.PathLike[str],
    rank: int,
    model: nn.Module,
    sources: Sequence[PassSource],
    loss_of: BatchLoss,
    *,
    to_device: Callable[[Any], Any],
    context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    loss_reduction: LossReduction = "mean",
    session_options: Mapping[str, Any] | None = None,
) -> Callable[[str, Sequence[int], str], list[LayerRecord]]:
    """``(split, ids, checkpoint) -> records``: samples of a checkpoint pass's splits recomputed at its snapshot.

    Batches are made as the pass made them (``sources``: its datasets, batch sizes and collate
    functions; ``loss_of(batch, k)``: its loss), so that the records are those the pass would
    have kept exact.
    """
    by_split = {source.split: source for source in sources if source.indices is not None}

    def run(split: str, sample_ids: Sequence[int], checkpoint: str) -> list[LayerRecord]:
        if split not in by_split:
            raise QueryError(f"no map-style dataset of split {split!r} to recompute from; it has {sorted(by_split)}")
        source = by_split[split]
        batches = indexed_batches(source.dataset, [int(i) for i in sample_ids], source.batch_size, source.collate_fn)
        weights, buffers = load_snapshot_state(store_dir, checkpoint, rank)
        return recompute_batches(
            model,
            (to_device(batch) for _, batch in batches),
            weights=weights,
            buffers=buffers,
            loss_fn=unbound_loss(loss_of),
            loss_reduction=loss_reduction,
            context=context,
            session_options=session_options,
            snapshot=repr(checkpoint),
        )

    return run
