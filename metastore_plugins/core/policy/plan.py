"""The capture plan: what each layer keeps at training steps and checkpoint passes, under a byte budget.

The budget covers every byte the run writes under the store directory (:func:`~.budget.files_bytes` says
how the files besides shards and snapshots are reserved). A plan is made once, from the first
captured batch (its exact records measure each layer's bytes per sample) and the run's shape
(planned training batches, checkpoint passes, snapshot size):

1. ``usable = (1 - HEADROOM) budget - files`` (:func:`~.budget.usable_bytes`); the metadata of every planned
   sample first (a budget below that and the files is refused at the start: :meth:`~.budget.Budget.check`);
2. weight snapshots, one per checkpoint pass (the latest ones), while they take at most half of a
   given budget (the default budget counts one per pass);
3. training steps and checkpoint passes take the first rung of :data:`LADDER` whose bytes fit
   what is left: exact, then a projection of ``k x k`` per layer (16, 8, 4), then exact norms
   only, then nothing. A layer whose exact bytes are no more than its projection's stays exact;
4. checkpoint passes are upgraded to the richest rung whose bytes fit beside the training steps: of the
   steps' projection size where both keep seeded projections (in-run influence pairs them), of any size
   where the passes go on the curvature eigenbasis (``RunShape.passes_on_basis``; the plan's ``pass_k``).

Without a budget (``budget=None``) the default is :func:`~.budget.default_budget`: the snapshots plus
:data:`AUTO_BYTES_PER_SAMPLE` per planned sample. ``policy="exact"`` keeps every layer exact
(today's behaviour); a budget then only degrades what would overflow it. The plan made is a
:class:`~metastore_plugins.core.policy.plan_record.CapturePlan`, the record the store keeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from metastore_plugins.core.ops.cost import (
    TENSOR_OVERHEAD_BYTES,
    exact_sample_bytes,
    pass_batch_size,
    projected_sample_bytes,
)
from metastore_plugins.core.ops.eigenbasis import basis_batch_bytes
from metastore_plugins.core.ops.represent import by_layer, shared_layers
from metastore_plugins.core.policy.budget import (
    AUTO_BYTES_PER_SAMPLE,
    Budget,
    RunShape,
    files_bytes,
    usable_bytes,
)
from metastore_plugins.core.policy.plan_record import CapturePlan
from metastore_plugins.core.records import LayerRecord, Representation

#: Rungs from richest to cheapest: a representation and its projection size (0: none).
LADDER: tuple[tuple[Representation, int], ...] = (
    ("exact", 0),
    ("projected", 16),
    ("projected", 8),
    ("projected", 4),
    ("norms", 0),
    ("nothing", 0),
)


@dataclass(frozen=True)
class LayerCosts:
    """Measured bytes per sample of one layer in each representation (``k``: projection size)."""

    exact: float
    batch_size: int

    def bytes(self, representation: Representation, k: int, encoding: str) -> float:
        overhead = TENSOR_OVERHEAD_BYTES / max(1, self.batch_size)
        if representation == "exact":
            return self.exact
        if representation == "projected":
            return min(self.exact, projected_sample_bytes(k, k, encoding) + 3 * overhead)
        if representation == "norms":
            return 4.0 + overhead
        return 0.0

    def choice(self, representation: Representation, k: int, encoding: str) -> Representation:
        """``representation``, or exact where exact takes no more bytes than the projection."""
        if representation == "projected" and self.exact <= projected_sample_bytes(k, k, encoding):
            return "exact"
        return representation


def measure(records: Sequence[LayerRecord], encoding: str, batch_size: int = 0) -> dict[str, LayerCosts]:
    """Each layer's :class:`LayerCosts`, from the exact records of one batch.

    ``batch_size``: the run's batch, over which each tensor's header entry is shared (the measured
    batch's own by default; a smaller one, e.g. a last partial batch, would overstate small records).
    """
    return {
        layer: LayerCosts(exact_sample_bytes(group, encoding), max(batch_size, group[0].batch_size))
        for layer, group in by_layer(records).items()
    }


def factor_sample_bytes(records: Sequence[LayerRecord]) -> float:
    """Exact factor bytes a captured sample holds in memory (the batch's records over its samples; 0: none)."""
    return sum(r.nbytes for r in records) / max(1, records[0].batch_size) if records else 0.0


def pass_batches(shape: RunShape, sample_bytes: float) -> int:
    """Batches of the planned passes, at most: batched like training (32 when unknown), cut where a batch's exact
    factors would exceed :data:`~metastore_plugins.core.ops.cost.PASS_BATCH_BYTES`, a partial batch per
    split (training and validation)."""
    size = pass_batch_size(shape.train_batch_size or 32, sample_bytes)
    start = -(-shape.start_samples // size) + 1 if shape.start_samples else 0  # one split
    return shape.passes * (-(-shape.pass_samples // size) + 2) + start


def make_plan(
    records: Sequence[LayerRecord],
    shape: RunShape,
    *,
    budget: Budget,
    encoding: str,
) -> CapturePlan:
    """The plan of a run from the exact records of its first batch (see the module docstring), under ``budget``
    (the run's :class:`~.budget.Budget`: its policy and the bytes given, as the settings made it)."""
    if shape.train_batches > 0 and not shape.train_batch_size and records:  # a loader that did not say its batch
        shape = replace(shape, train_batch_size=records[0].batch_size)
    costs = measure(records, encoding, shape.train_batch_size)
    tied = shared_layers(records)
    policy = budget.policy
    rate_only = budget.given is None and policy == "auto" and not shape.known
    snapshots, reserved = budget.snapshots(shape), budget.reserved(shape)  # as given: a default holds one per pass
    cap, source = budget.resolved(shape)
    pass_samples = shape.all_pass_samples
    files = files_bytes(shape)
    usable = usable_bytes(cap, shape)
    metadata = shape.metadata_bytes
    rest = usable - metadata - reserved  # the same on every rank

    def total(rung: tuple[Representation, int], samples: int) -> float:
        rep, k = rung
        return samples * sum(c.bytes("exact" if layer in tied else rep, k, encoding) for layer, c in costs.items())

    def on_basis(rung: tuple[Representation, int], batches: int | None = None) -> float:
        """What the records on the eigenbasis carry per batch and projected layer besides their samples: the
        passes' (``batches`` None), or the training steps' (``batches`` of them: they go on the latest basis)."""
        rep, k = rung
        if not shape.passes_on_basis or rep != "projected" or rate_only:
            return 0.0
        projected = sum(layer not in tied and c.choice(rep, k, encoding) == "projected" for layer, c in costs.items())
        batches = pass_batches(shape, factor_sample_bytes(records)) if batches is None else max(0, batches)
        return batches * projected * basis_batch_bytes(k)

    def steps(rung: tuple[Representation, int]) -> float:
        """The training steps' bytes at ``rung``."""
        after_first = (  # before the first basis: none (a start pass fits one before the first step)
            shape.train_batches
            if shape.start_samples
            else shape.train_batches * max(0, shape.passes - 1) // max(1, shape.passes)
        )
        return total(rung, shape.train_samples) + on_basis(rung, after_first)

    if rate_only:  # no cap: the richest rung within AUTO_BYTES_PER_SAMPLE, a snapshot at every pass
        rest, pass_samples = AUTO_BYTES_PER_SAMPLE, 1
    ladder = LADDER if policy == "auto" else LADDER[:1]
    rung = next((r for r in ladder if total(r, pass_samples) + on_basis(r) + steps(r) <= rest), ladder[-1])
    train_bytes = steps(rung)
    # seeded projections pair steps with passes only at one size: a pass then takes the steps' k; passes on the
    # curvature eigenbasis never pair with the steps' seeded projections, so they take the richest rung that fits
    same_k = [r for r in ladder if shape.passes_on_basis or not (r[0] == rung[0] == "projected" and r[1] != rung[1])]
    pass_rung = next((r for r in same_k if total(r, pass_samples) + on_basis(r) + train_bytes <= rest), rung)
    k = rung[1] or pass_rung[1] or LADDER[1][1]
    pass_k = pass_rung[1] or k

    def layer_map(chosen: tuple[Representation, int], size: int) -> dict[str, Representation]:
        rep = chosen[0]
        return {layer: "exact" if layer in tied else c.choice(rep, size, encoding) for layer, c in costs.items()}

    planned = {
        "metadata": metadata,
        "files": files,
        "snapshots": max(0, snapshots) * shape.snapshot_bytes,
        "training steps": steps(rung),
        "checkpoint passes": total(pass_rung, shape.all_pass_samples) + on_basis(pass_rung),
    }
    planned["total"] = sum(planned.values())
    train = layer_map(rung, k)
    return CapturePlan(
        policy=policy,
        budget=None if cap is None else int(cap),
        budget_source=source,
        encoding=encoding,
        k=k,
        train=train,
        passes=layer_map(pass_rung, pass_k),
        snapshots=snapshots,
        planned_passes=shape.passes,
        planned={key: int(value) for key, value in planned.items()},
        pass_k=0 if pass_k == k else pass_k,
        exact_layers=sorted(tied | {layer for layer, rep in train.items() if rep == "exact" and rung[0] != "exact"}),
    )
