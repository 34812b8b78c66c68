"""Per-layer records of per-sample gradients, and their exact restoration.

A ``LayerRecord`` is what capture produces for one layer call of one batch and
what the store writes. It holds one of three representations (``kind``):

``"outer"``
    Factors of a Linear/Conv-like layer ``y = x W^T + b`` (weights may be split
    into ``G`` groups). Each kept row ``r`` is one (sample, token/position) pair:

    - ``prefix``   ``(R, G, d_in)``  the layer input ``A`` (unfolded for convolutions)
    - ``suffix``   ``(R, G, d_out)`` the gradient of the loss w.r.t. the output, ``D``
    - ``sample``   ``(R,)`` int32    the sample of the batch the row belongs to
    - ``position`` ``(R,)`` int32    the token / spatial position of the row

    ``grad W_i[g] = sum_{r: sample_r = i} D[r, g]^T A[r, g]`` and
    ``grad b_i = sum_{r: sample_r = i} D[r]``. Rows whose suffix is exactly zero
    contribute nothing and are dropped; ``position`` keeps where kept rows were.

``"embedding"``
    ``ids`` ``(R,)`` int64 token ids, ``suffix`` ``(R, d)``, ``sample``, ``position``:
    ``grad W_i[v] = sum_{r: sample_r = i, ids_r = v} D[r]``.

``"dense"``
    ``grad.<role>`` ``(B, *param_shape)``: the per-sample gradient itself, kept
    when it is smaller than the factors (and for small parameters such as norms).

Two cheaper representations a capture policy may keep instead (built from the above by
:mod:`metastore_plugins.core.ops.represent`; they cannot be restored to gradients):

``"projected"``
    ``projected`` ``(B, k_out, k_in)``: the seeded Kronecker projection ``P_out G_i P_in^T`` of
    each per-sample gradient (:func:`metastore_plugins.core.ops.sketch`, seed
    :data:`PROJECTION_SEED`): inner products between samples are estimates. ``sq_norm`` ``(B,)``:
    each sample's exact squared gradient norm over the record's parameters. A checkpoint pass
    may instead project onto the top of the layer's K-FAC eigenbasis
    (:mod:`metastore_plugins.core.ops.eigenbasis`): ``projected`` then holds ``Q_D^T G_i Q_A``, and
    the record carries :data:`EIGENBASIS_TENSORS` (which basis, and its eigenvalues).

``"norms"``
    ``sq_norm`` ``(B,)`` only: exact squared norms, enough for self-influence and outliers.

Records are stored *raw*: the gradient of the loss as back-propagated. ``scale``
multiplies by the factor that turns them into gradients of each sample's own loss
(undoing the loss reduction and the mixed-precision loss scale).

Under mixed precision every rule reads its operands through
:func:`~metastore_plugins.core.capture.build.as_computed`: the layer input rounded to the dtype the
layer computed in (that of its output gradient), then both factors upcast to fp32 before any
product. Tensors are fp32 in every record.

This module is the one home of the record vocabulary the capture side, the store, the operators
and the queries share: record kinds and their tensor keys, representations, per-sample columns
(:class:`BatchMeta`) and the keys a shard names them by.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, get_args

import torch
from torch import Tensor

from metastore_plugins.core.errors import ConfigError, RepresentationError

# -- record kinds and their tensors ------------------------------------------------------------

RecordKind = Literal["outer", "embedding", "dense", "projected", "norms"]
#: Every record kind, by its code in a journal line's ``kind`` record column (docs/format.md).
KIND_CODES: tuple[RecordKind, ...] = get_args(RecordKind)
#: Kinds that hold the gradient itself (factored or dense): restorable, usable by every query.
EXACT_KINDS: tuple[RecordKind, ...] = ("outer", "embedding", "dense")
#: Kinds a capture policy keeps instead of the gradient (:data:`REPRESENTATIONS`): not restorable.
SUMMARY_KINDS: tuple[RecordKind, ...] = ("projected", "norms")
#: Kinds with one row per sample (no factor rows).
PER_SAMPLE_KINDS: tuple[RecordKind, ...] = ("dense", "projected", "norms")
#: The tensor keys of each kind but ``"dense"``, whose keys are ``grad.<role>`` (:func:`dense_key`).
KIND_TENSORS: dict[str, tuple[str, ...]] = {
    "outer": ("prefix", "suffix", "sample", "position"),
    "embedding": ("ids", "suffix", "sample", "position"),
    "projected": ("projected", "sq_norm"),
    "norms": ("sq_norm",),
}
#: The extra tensors of a ``"projected"`` record made on a curvature eigenbasis: ``basis`` ``(1,)`` the
#: step of the checkpoint whose basis it is, ``eigenvalues`` ``(k_out, k_in)`` K-FAC's eigenvalues of the
#: kept block, ``mean_eigenvalue`` ``(1,)`` the mean K-FAC eigenvalue of the whole layer (the damping's scale).
EIGENBASIS_TENSORS = ("basis", "eigenvalues", "mean_eigenvalue")
#: Tensor keys holding integers (ids, and the sample and position of each row); every other is float.
INTEGER_TENSORS = ("sample", "position", "ids")
#: Tensor keys that are linear in the loss (and therefore scaled); all others are inputs or ids.
_GRADIENT_KEYS = ("suffix", "projected")
#: Tensor keys that are quadratic in the loss (scaled by the square of the factor).
_QUADRATIC_KEYS = ("sq_norm",)
#: Key prefix of a dense record's per-sample gradients: ``grad.<role>``.
DENSE_PREFIX = "grad."
WeightLayout = Literal["out_in", "in_out"]
#: Every weight layout (:class:`LayerRecord`'s ``layout``).
WEIGHT_LAYOUTS: tuple[WeightLayout, ...] = get_args(WeightLayout)


def dense_key(role: str) -> str:
    """The tensor key of a dense record's per-sample gradient of parameter role ``role``."""
    return DENSE_PREFIX + role


def kind_tensors(kind: str, roles: Sequence[str]) -> list[str]:
    """The tensor keys of a record of ``kind`` over parameter roles ``roles`` (the roles name dense keys)."""
    return [dense_key(role) for role in roles] if kind == "dense" else list(KIND_TENSORS[kind])


# -- representations: what a capture policy keeps of a layer ------------------------------------

Representation = Literal["exact", "projected", "norms", "nothing"]
#: Every representation, richest first.
REPRESENTATIONS: tuple[Representation, ...] = get_args(Representation)
#: What a tag may ask its steps to keep: a representation, or a weight snapshot.
KEEP_CHOICES = (*REPRESENTATIONS, "snapshot")
#: The seed of the projections a ``"projected"`` record was made with (query-time sketches use it too).
PROJECTION_SEED = 0
#: The way out for a gradient a projected or norms-only record no longer holds (one wording for every error).
RECOMPUTE_HINT = "recompute the samples exactly from a weight snapshot with GradientStore.recompute"

# -- per-sample columns and shard keys ----------------------------------------------------------

#: What a per-sample column may be given as: a tensor, or a sequence with one value per sample.
ArrayLike = Tensor | Sequence[float] | Sequence[int]
#: The per-sample columns a batch stores beside its records, in stored order (``sample_id`` always).
SAMPLE_COLUMNS = ("sample_id", "label", "loss", "prediction", "margin")
#: Columns stored float32 whatever dtype was given (NaN where a batch has none).
FLOAT_SAMPLE_COLUMNS = ("loss", "margin")
#: Each optional column's bit in a journal batch's ``meta`` mask: which ``b{j}/meta/{column}`` tensors
#: the shard holds. ``margin`` (8) came later: journals written before it never set the bit.
META_BITS = {"label": 1, "loss": 2, "prediction": 4, "margin": 8}
#: The :class:`BatchMeta` field each optional column is given as.
_COLUMN_FIELDS = {"label": "labels", "loss": "losses", "prediction": "predictions", "margin": "margins"}


def batch_prefix(batch: int) -> str:
    """The key prefix of everything a shard holds of its stored batch ``batch``: ``b{batch}/``."""
    return f"b{batch}/"


def record_prefix(batch: int, record: int) -> str:
    """The key prefix of record ``record`` of stored batch ``batch``: ``b{batch}/r{record}/``."""
    return f"b{batch}/r{record}/"


def meta_prefix(batch: int) -> str:
    """The key prefix of the per-sample columns of stored batch ``batch``: ``b{batch}/meta/``."""
    return f"b{batch}/meta/"


def record_key(batch: int, record: int, tensor: str) -> str:
    """The shard key of tensor ``tensor`` of record ``record`` of stored batch ``batch``."""
    return record_prefix(batch, record) + tensor


def meta_key(batch: int, column: str) -> str:
    """The shard key of per-sample column ``column`` of stored batch ``batch``."""
    return meta_prefix(batch) + column


# -- the records ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecordHead:
    """Whose gradients a record of one layer call holds: the layer, its parameters' roles and shapes, the layout.

    Attributes: as :class:`LayerRecord`'s of the same names.
    """

    layer: str
    params: dict[str, str]
    param_shapes: dict[str, tuple[int, ...]]
    layout: WeightLayout = "out_in"


@dataclass(frozen=True)
class LayerRecord:
    """Per-sample gradient information of one layer call on one batch.

    Attributes:
        layer: module path in ``model.named_modules()`` (``""`` for the root).
        kind: representation, see the module docstring.
        batch_size: number of samples ``B`` in the batch.
        params: role (``"weight"``, ``"bias"``, or any name for dense records) ->
            parameter name in ``model.named_parameters()``.
        param_shapes: role -> shape of that parameter.
        tensors: the representation's tensors (see the module docstring).
        layout: for ``"outer"`` records, whether the weight is ``(d_out, d_in)``
            (``nn.Linear``, convolutions) or ``(d_in, d_out)`` (transformers' ``Conv1D``).
    """

    layer: str
    kind: RecordKind
    batch_size: int
    params: dict[str, str]
    param_shapes: dict[str, tuple[int, ...]]
    tensors: dict[str, Tensor]
    layout: WeightLayout = "out_in"
    meta: dict[str, str] = field(default_factory=dict)

    def dense_grad(self, role: str) -> Tensor:
        """``(B, *param_shape)`` per-sample gradient of parameter role ``role`` of a dense record."""
        return self.tensors[dense_key(role)]

    @property
    def basis(self) -> int | None:
        """The checkpoint step of the curvature eigenbasis a ``"projected"`` record was made on (None: seeded)."""
        stored = self.tensors.get("basis") if self.kind == "projected" else None
        return None if stored is None else int(stored.reshape(-1)[0].item())

    @property
    def nbytes(self) -> int:
        """Bytes taken by the record's tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def dense_nbytes(self) -> int:
        """Bytes the dense per-sample gradients of the same parameters would take (fp32)."""
        return self.batch_size * 4 * sum(math.prod(s) for s in self.param_shapes.values())

    def gradient_keys(self) -> list[str]:
        """Keys of the tensors that carry the loss gradient (``suffix``, ``grad.*``), not activations or ids."""
        return [key for key in self.tensors if key in _GRADIENT_KEYS or key.startswith(DENSE_PREFIX)]

    def scale(self, factor: float) -> LayerRecord:
        """Return a copy whose gradient tensors are multiplied by ``factor``."""
        if factor == 1.0:
            return self
        scaled = set(self.gradient_keys())
        return replace(
            self,
            tensors={
                key: value * factor if key in scaled else value * factor**2 if key in _QUADRATIC_KEYS else value
                for key, value in self.tensors.items()
            },
        )

    def restore(self) -> dict[str, Tensor]:
        """Rebuild the dense per-sample gradients: parameter name -> ``(B, *shape)``.

        Raises:
            ValueError: for a ``"projected"`` or ``"norms"`` record, which no longer holds the gradient.
        """
        if self.kind not in EXACT_KINDS:
            raise RepresentationError(
                f"layer '{self.layer}' is kept as {self.kind!r}: its per-sample gradients cannot be rebuilt; "
                f"capture with policy='exact', or {RECOMPUTE_HINT}"
            )
        return _RESTORERS[self.kind](self)


def _restore_outer(record: LayerRecord) -> dict[str, Tensor]:
    prefix, suffix = record.tensors["prefix"], record.tensors["suffix"]  # (R, G, d_in), (R, G, d_out)
    sample = record.tensors["sample"].long()  # (R,)
    if sample.numel() > 1 and not bool((sample[1:] >= sample[:-1]).all()):
        order = torch.argsort(sample, stable=True)  # group rows by sample
        prefix, suffix, sample = prefix[order], suffix[order], sample[order]
    batch = record.batch_size
    counts = torch.bincount(sample, minlength=batch)  # (B,)
    t_max = int(counts.max()) if sample.numel() else 0
    position = torch.arange(sample.numel(), device=sample.device) - (torch.cumsum(counts, 0) - counts)[sample]  # (R,)
    padded_prefix = prefix.new_zeros(batch, t_max, *prefix.shape[1:])  # (B, T_max, G, d_in)
    padded_suffix = suffix.new_zeros(batch, t_max, *suffix.shape[1:])  # (B, T_max, G, d_out)
    padded_prefix[sample, position] = prefix
    padded_suffix[sample, position] = suffix
    params: dict[str, str] = {role: record.params[role] for role in ("weight", "bias") if role in record.params}
    dense = dense_from_factors(RecordHead(record.layer, params, record.param_shapes, record.layout), padded_prefix,
                               padded_suffix)  # fmt: skip
    return {name: dense.tensors[dense_key(role)] for role, name in params.items()}


def _restore_embedding(record: LayerRecord) -> dict[str, Tensor]:
    ids, suffix = record.tensors["ids"].long(), record.tensors["suffix"]  # (R,), (R, d)
    num_embeddings, dim = record.param_shapes["weight"]
    flat = suffix.new_zeros(record.batch_size * num_embeddings, dim)  # (B * V, d)
    flat.index_add_(0, record.tensors["sample"].long() * num_embeddings + ids, suffix)
    return {record.params["weight"]: flat.view(record.batch_size, num_embeddings, dim)}


def _restore_dense(record: LayerRecord) -> dict[str, Tensor]:
    return {name: record.tensors[dense_key(role)] for role, name in record.params.items()}


_RESTORERS = {"outer": _restore_outer, "embedding": _restore_embedding, "dense": _restore_dense}


def restore_all(records: list[LayerRecord]) -> dict[str, Tensor]:
    """Sum the restored per-sample gradients of many records (several calls, tied weights)."""
    total: dict[str, Tensor] = {}
    for record in records:
        for name, grad in record.restore().items():
            total[name] = total[name] + grad if name in total else grad
    return total


def dense_from_factors(head: RecordHead, prefix: Tensor, suffix: Tensor) -> LayerRecord:
    """The ``"dense"`` record of token-major fp32 factors ``(B, T, G, d)``: ``grad W_i[g] = sum_t D[i,t,g]^T A[i,t,g]``
    in one einsum, and ``grad b_i = sum_t D[i,t]``."""
    batch, params, shapes = suffix.shape[0], head.params, head.param_shapes
    grads: dict[str, Tensor] = {}
    if "weight" in params:
        weight = torch.einsum("btgo,btgi->bgoi", suffix, prefix)  # (B, G, d_out, d_in)
        weight = weight.reshape(batch, -1, weight.shape[-1])  # (B, G*d_out, d_in)
        if head.layout == "in_out":
            weight = weight.transpose(1, 2)  # (B, d_in, d_out)
        grads["weight"] = weight.reshape(batch, *shapes["weight"])
    if "bias" in params:
        grads["bias"] = suffix.sum(1).reshape(batch, *shapes["bias"])  # (B, G*d_out)
    return dense_record(head.layer, grads, {role: params[role] for role in grads})


def to_dense(record: LayerRecord) -> LayerRecord:
    """The same gradients as a ``"dense"`` record."""
    if record.kind == "dense":
        return record
    by_name = record.restore()
    return replace(
        record,
        kind="dense",
        tensors={dense_key(role): by_name[name] for role, name in record.params.items()},
    )


def dense_record(layer: str, grads: dict[str, Tensor], params: dict[str, str]) -> LayerRecord:
    """Build a ``"dense"`` record from per-sample gradients ``role -> (B, *shape)``."""
    batch = next(iter(grads.values())).shape[0]
    return LayerRecord(
        layer=layer,
        kind="dense",
        batch_size=batch,
        params=params,
        param_shapes={role: tuple(g.shape[1:]) for role, g in grads.items()},
        tensors={dense_key(role): g.float() for role, g in grads.items()},
    )


@dataclass(frozen=True)
class BatchMeta:
    """What the writer stores beside one batch's records: its place in the run and one entry per sample.

    Attributes:
        sample_ids: ``(B,)`` dataset indices of the batch's samples.
        step: the optimizer step the batch belongs to.
        capture_point: ``"train"``, or the pass that captured it (``"epoch-0/val"``).
        epoch: the epoch of the step.
        micro_batch: the micro-batch of the step (gradient accumulation), or the batch of a pass.
        labels: ``(B, ...)`` labels, or ``None``.
        losses: ``(B,)`` per-sample losses (stored float32), or ``None``.
        predictions: ``(B, ...)`` predictions, or ``None``.
        margins: ``(B,)`` classification margins ``z_y - max_{k != y} z_k`` (stored float32;
            :func:`~metastore_plugins.core.model.losses.margins_of` computes them), or ``None``.
        lr: the learning rate of the step (for a pass: the weight TracIn gives it), or ``None``.
    """

    sample_ids: ArrayLike
    step: int
    capture_point: str = "train"
    epoch: int = 0
    micro_batch: int = 0
    labels: ArrayLike | None = None
    losses: ArrayLike | None = None
    predictions: ArrayLike | None = None
    margins: ArrayLike | None = None
    lr: float | None = None

    def columns(self) -> dict[str, Tensor]:
        """The per-sample columns given, on the CPU and copied: name (:data:`SAMPLE_COLUMNS`) -> ``(B, ...)``.

        Raises:
            ValueError: a column without one entry per sample, or margins of more than one value per sample.
        """
        ids = torch.as_tensor(self.sample_ids).detach().cpu().long().reshape(-1).clone()  # (B,)
        size = ids.shape[0]
        columns = {"sample_id": ids}
        for name, argument in _COLUMN_FIELDS.items():
            values = getattr(self, argument)
            if values is None:
                continue
            column = torch.as_tensor(values).detach().cpu()
            if name in FLOAT_SAMPLE_COLUMNS:
                column = column.float()
            if column.dim() == 0 or column.shape[0] != size:
                raise ConfigError(
                    f"{argument} must have one entry per sample ({size}); got shape {tuple(column.shape)}"
                )
            if name == "margin" and column.dim() != 1:
                raise ConfigError(f"margins must hold one value per sample, shape ({size},); got {tuple(column.shape)}")
            columns[name] = column.contiguous().clone()  # the caller may reuse its buffer before the shard is written
        return columns
