"""Cheaper representations of one step's exact records: a projected gradient with exact norms, or norms only.

For the records of one layer in one batch (several when the module ran more than once; the
per-sample gradient is their sum ``g_i = sum_k g_i^(k)``):

- ``"projected"``: ``P_out g_i P_in^T = sum_k P_out g_i^(k) P_in^T`` (projection is linear, so the
  sketches of the calls add up; :func:`~metastore_plugins.core.ops.sketch` on the factors,
  ``O(R (d_in k_in + d_out k_out) + B T k)``), with ``sq_norm`` = ``||g_i||^2`` exact;
- ``"norms"``: ``sq_norm`` only, ``||sum_k g_i^(k)||^2`` with the cross terms of the calls
  (:func:`~metastore_plugins.core.ops.total_sq_norms`).

Both keep the layer's parameter table, so a reader knows what the numbers are of. A layer that
shares a parameter with another layer (tied weights) cannot be split this way (each layer's
projection is drawn from its own name): :func:`represent` leaves such layers exact and says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from metastore_plugins.core.capture.build import packed
from metastore_plugins.core.ops.influence import total_sq_norms
from metastore_plugins.core.ops.sketch import Projections, sketch
from metastore_plugins.core.records import EXACT_KINDS, PROJECTION_SEED, LayerRecord, Representation


def by_layer(records: Sequence[LayerRecord]) -> dict[str, list[LayerRecord]]:
    """The records of each layer, in order of first appearance."""
    grouped: dict[str, list[LayerRecord]] = {}
    for record in records:
        grouped.setdefault(record.layer, []).append(record)
    return grouped


def shared_layers(records: Sequence[LayerRecord]) -> set[str]:
    """Layers holding a parameter that another layer holds too (tied weights): kept exact."""
    owners: dict[str, set[str]] = {}
    for record in records:
        for name in record.params.values():
            owners.setdefault(name, set()).add(record.layer)
    return {layer for layers in owners.values() if len(layers) > 1 for layer in layers}


def summary_record(group: Sequence[LayerRecord], kind: Literal["projected", "norms"], tensors: dict) -> LayerRecord:
    """A summary record of one layer's records of one batch: their parameter table, ``tensors``."""
    first = group[0]
    params, shapes = {}, {}
    for record in group:
        params.update(record.params)
        shapes.update(record.param_shapes)
    return LayerRecord(first.layer, kind, first.batch_size, params, shapes, tensors, first.layout)


def norms_record(group: Sequence[LayerRecord]) -> LayerRecord:
    """The ``"norms"`` record of one layer's exact records of one batch: ``sq_norm (B,)``, exact."""
    return summary_record(group, "norms", {"sq_norm": total_sq_norms(list(group)).float()})


def projected_record(
    group: Sequence[LayerRecord], k_in: int, k_out: int, projections: Projections | None = None
) -> LayerRecord:
    """The ``"projected"`` record of one layer's exact records of one batch.

    ``projected (B, k_out, k_in)`` is the sum of the calls' sketches (seed :data:`PROJECTION_SEED`);
    ``sq_norm (B,)`` the exact squared norm of the summed gradient.
    """
    batch = group[0].batch_size
    projected = torch.zeros(batch, k_out * k_in, device=next(iter(group[0].tensors.values())).device)  # (B, k)
    for record in group:
        projected += sketch(record, k_in, k_out, PROJECTION_SEED, projections=projections)  # (B, k)
    tensors = {"projected": projected.view(batch, k_out, k_in), "sq_norm": total_sq_norms(list(group)).float()}
    return summary_record(group, "projected", tensors)


def represent(
    records: Sequence[LayerRecord],
    choose: dict[str, Representation],
    k_in: int,
    k_out: int,
    projections: Projections | None = None,
) -> list[LayerRecord]:
    """One batch's records with each layer turned into its chosen representation.

    Args:
        records: exact records of one batch (scaled to per-sample losses).
        choose: layer -> representation; layers not named stay exact.
        k_in, k_out: the projection's size for ``"projected"`` layers.
        projections: the drawn matrices, kept across steps.

    Layers that share a parameter with another layer stay exact whatever ``choose`` says.
    """
    tied = shared_layers(records)
    out: list[LayerRecord] = []
    for layer, group in by_layer(records).items():
        wanted = "exact" if layer in tied else choose.get(layer, "exact")
        if wanted == "exact" or any(r.kind not in EXACT_KINDS for r in group):
            out.extend(packed(record) for record in group)  # rows captured unpacked for a summary
        elif wanted == "projected":
            out.append(projected_record(group, k_in, k_out, projections))
        elif wanted == "norms":
            out.append(norms_record(group))
    return out
