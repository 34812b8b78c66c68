"""Influence on sequences the run did not store: which training sequences raised or lowered the loss of a new text.

The checkpoint passes hold the training sequences' gradients at each checkpoint's weights, and the
store a weight snapshot of each checkpoint (``policy="auto"``). For a batch of new sequences (a text,
or a prompt and completion with the prompt's labels ``-100``), :func:`influence_of_sequences` runs the
model at each snapshot's weights, captures each new sequence's gradient of its own loss (the sum of its
unmasked token losses, as the passes store a training sequence's) and scores it against the pass:

    score(i, j) = sum_t lr_t <g_train_i(w_t), g_new_j(w_c(t))>

in-run TracIn over the training steps ``t`` that hold sequence ``i`` (every trained sequence), each step with the
passes ``c(t)`` before and after it; a store without training steps: ``sum_c lr_c <g_train_i(w_c), g_new_j(w_c)>``
over the checkpoint passes' training sequences. Positive:
training on sequence ``i`` lowered the loss of new sequence ``j`` (a proponent); negative: it raised it.

Example::

    batch = collator([{"input_ids": ids, "labels": [-100] * len(prompt) + completion}])
    scores = store.influence_of_sequences(model, batch)
    scores.top(5)                     # per new sequence: its proponents and opponents (train ids, scores)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch.nn.functional as F
from torch import Tensor, nn

from metastore_plugins.core.analysis.in_run import step_windows
from metastore_plugins.core.analysis.queries import dot_blocks, summed_scores
from metastore_plugins.core.analysis.results import Scores
from metastore_plugins.core.analysis.signals import TRAINING_STEPS
from metastore_plugins.core.errors import QueryError, RepresentationError, StoreError
from metastore_plugins.core.model.losses import IGNORE_INDEX, LossFn, logits_of
from metastore_plugins.core.model.recompute import recompute_batches
from metastore_plugins.core.ops import DEFAULT_MAX_BYTES
from metastore_plugins.core.store import Selection, StoreReader
from metastore_plugins.core.store.snapshots.weights import list_snapshots, load_snapshot_state


def sequence_loss(shift: bool = True) -> LossFn:
    """``(model, batch) -> sum over the batch's sequences of their token cross-entropies`` (``-100`` left out).

    ``shift``: a causal LM's logits at position ``t`` predict ``labels[t + 1]`` (its model shifts inside);
    ``False`` for a masked LM, token classification or a seq2seq decoder's logits on its labels. Summed over
    sequences (``loss_reduction="sum"``), each sequence's captured gradient is that of its own token sum.
    """

    def loss(model: nn.Module, batch: Any) -> Tensor:
        if not isinstance(batch, Mapping) or "labels" not in batch:
            raise QueryError("a batch of sequences is a dict with input_ids and labels (-100 where no loss is taken)")
        logits = logits_of(model(**batch))
        labels = batch["labels"]
        if logits is None or logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(labels.shape):
            shape = None if logits is None else tuple(logits.shape)
            raise QueryError(f"expected (B, T, V) logits on (B, T) labels; got logits {shape}, labels {labels.shape}")
        if shift:
            logits, labels = logits[:, :-1], labels[:, 1:]  # (B, T - 1, V), (B, T - 1)
        flat = logits.reshape(-1, logits.shape[-1]).float()  # (B T, V)
        return F.cross_entropy(flat, labels.reshape(-1).long(), ignore_index=IGNORE_INDEX, reduction="sum")

    return loss


def influence_of_sequences(
    store: StoreReader,
    model: nn.Module,
    batch: Mapping[str, Tensor],
    *,
    train_split: str = "train",
    shift: bool = True,
    loss_fn: LossFn | None = None,
    layers: Sequence[str] | None = None,
    rank: int = 0,
    max_bytes: int = DEFAULT_MAX_BYTES,
    train_from: Literal["steps", "passes"] = "steps",
) -> Scores:
    """TracIn scores of the stored training sequences on the ``B`` sequences of ``batch``: every trained sequence
    from the training steps, each step with the passes before and after it (:func:`.in_run.step_windows`), the new
    sequences' gradients taken at those passes' snapshots; the passes' training samples where the store keeps no
    training steps (or only steps they cannot be scored against: norms only).

    Args:
        model: the model the run trained (its live weights, ``.grad``, mode and RNG states are restored after).
        batch: ``{"input_ids": (B, T), "labels": (B, T), ...}`` as the model takes it (padded, with
            ``attention_mask``); ``-100`` labels (padding, a prompt) are left out of each sequence's loss.
        train_split: the passes scored against: ``<checkpoint>/<train_split>``, each at snapshot ``<checkpoint>``.
        shift, loss_fn: the loss whose gradient is taken, summed over the batch's sequences (:func:`sequence_loss`).
        layers: score on these layers only (every stored layer by default).
        train_from: ``"steps"`` (default): the training steps where the store holds them; ``"passes"``: the
            checkpoint passes' training sequences.

    Returns:
        :class:`Scores` with rows the training sample ids and columns ``0 .. B-1`` (the batch's sequences).

    Raises:
        StoreError: naming the missing snapshots, where a pass has no weight snapshot to recompute at.
        RepresentationError: where a pass keeps a layer projected on a curvature eigenbasis (score with
            ``layers=`` the others) or as norms only.
    """
    points = [cp for cp in store.capture_points() if cp.endswith(f"/{train_split}")]
    if not points:
        raise QueryError(f"the store has no checkpoint passes '*/{train_split}'; it has {store.capture_points()}")
    names = {s.name for s in list_snapshots(store.path) if s.rank == rank}
    missing = [cp.split("/")[0] for cp in points if cp.split("/")[0] not in names]
    if missing:
        raise StoreError(
            f"{store.path}: no weight snapshot {missing} of rank {rank} to recompute new sequences at (snapshots: "
            f"{sorted(names)}); the callbacks' policy='auto' snapshots the weights at each checkpoint pass"
        )
    loss = loss_fn or sequence_loss(shift)
    size = int(batch["labels"].shape[0])
    points = sorted(points, key=lambda cp: store.steps(cp)[0])
    kept: dict[str, Any] = {}

    def new_records(cp: str) -> Any:  # the new sequences' records at the snapshot of pass ``cp``, once each
        if cp not in kept:
            weights, buffers = load_snapshot_state(store.path, cp.split("/")[0], rank)
            kept[cp] = recompute_batches(
                model, [batch], weights=weights, buffers=buffers, loss_fn=loss, loss_reduction="sum", snapshot=cp
            )
        return kept[cp]

    def scored(paired: list[tuple[str, Selection]]) -> Scores:
        row_parts, col_parts = [], []
        for cp, rows in paired:
            block = dot_blocks(rows, [[(size, new_records(cp))]], weighted=True, max_bytes=max_bytes)  # (N, B)
            row_parts.append((rows.sample_ids(), block))
            col_parts.append((np.arange(size), block))
        return summed_scores(row_parts, col_parts)

    if (
        train_from == "steps" and TRAINING_STEPS in store.capture_points()
    ):  # every trained sequence: its steps, with the passes around them
        windows = step_windows(store, TRAINING_STEPS, points)
        try:
            return scored([(cp, store.select(TRAINING_STEPS, steps=at, layers=layers)) for cp, at in windows])
        except RepresentationError:  # steps the new records cannot meet (norms only, another projection)
            pass
    return scored([(cp, store.select(cp, layers=layers)) for cp in points])
