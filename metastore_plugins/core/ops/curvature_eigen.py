"""K-FAC / EK-FAC on ``"projected"`` records made on a curvature eigenbasis (:mod:`.eigenbasis`).

Such a record holds ``R_i = Q_D^T [W_i | b_i] Q_A`` for the top ``(k_out, k_in)`` block of the layer's
Kronecker eigenbasis at its checkpoint, so the curvature is diagonal there: K-FAC's eigenvalues are
the record's ``eigenvalues`` ``l_D l_A^T``, EK-FAC's are ``(1/N) sum_i R_i^2`` over the training
pass, and ``(F + delta I)^-1`` is the division ``R_j / (Lambda + delta)``, with ``delta`` a fraction of
the record's ``mean_eigenvalue`` (the whole layer's). Records of two bases (two checkpoints, or a
seeded projection) never meet: every function here checks the basis.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from metastore_plugins.core.errors import RepresentationError
from metastore_plugins.core.records import LayerRecord

_F64 = torch.float64


def single(group: Sequence[LayerRecord]) -> LayerRecord:
    """The one eigenbasis record of a layer's batch (a projected layer has one record per batch)."""
    if len(group) != 1 or group[0].basis is None:
        raise RepresentationError(f"layer '{group[0].layer}' mixes eigenbasis records with others in one batch")
    return group[0]


def head(group: Sequence[LayerRecord]) -> tuple[Tensor, float, int]:
    """``(eigenvalues (k_out, k_in) float64, mean eigenvalue, basis step)`` of a layer's eigenbasis record."""
    record = single(group)
    assert record.basis is not None
    mean = float(record.tensors["mean_eigenvalue"].reshape(-1)[0])
    return record.tensors["eigenvalues"].to(_F64), mean, record.basis


def rotated_block(group: Sequence[LayerRecord], lo: int, hi: int) -> Tensor:
    """``(n, k_out, k_in)`` float64 ``R_i`` of samples ``lo..hi-1``: the record is the rotated gradient (a copy,
    which callers may change in place)."""
    return single(group).tensors["projected"][lo:hi].to(_F64, copy=True)


def check_basis(group: Sequence[LayerRecord], basis: int | None) -> None:
    """Raise unless the layer's records were made on the basis ``basis`` the curvature was fitted on."""
    found = single(group).basis
    if found != basis:
        raise RepresentationError(
            f"layer '{group[0].layer}' is projected on the curvature eigenbasis of step {found} here and of step "
            f"{basis} in the training pass the curvature was fitted on; pair passes of one checkpoint"
        )


def preconditioned(group: Sequence[LayerRecord], values: Tensor) -> LayerRecord:
    """The layer's record with ``projected`` replaced by ``values`` ``(B, k_out, k_in)`` (its basis kept)."""
    record = single(group)
    tensors = dict(record.tensors)
    tensors["projected"] = values.to(record.tensors["projected"].dtype).contiguous()  # (B, k_out, k_in)
    return LayerRecord(record.layer, "projected", record.batch_size, dict(record.params),
                       dict(record.param_shapes), tensors, record.layout)  # fmt: skip
