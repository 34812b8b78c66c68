"""The capture plan: what each layer keeps at training steps and checkpoint passes, under a byte budget.

A plan is made once, from the first captured batch (its exact records measure each layer's bytes
per sample) and the run's shape (planned training batches, checkpoint passes, snapshot size):

1. ``usable = (1 - HEADROOM) budget``; metadata (ids, labels, losses) of every planned sample first;
2. weight snapshots, one per checkpoint pass (the latest ones), while they take at most half of a
   given budget (the default budget counts one per pass);
3. training steps and checkpoint passes take the first rung of :data:`LADDER` whose bytes fit
   what is left: exact, then a projection of ``k x k`` per layer (16, 8, 4), then exact norms
   only, then nothing. A layer whose exact bytes are no more than its projection's stays exact;
4. checkpoint passes are upgraded to exact when their exact bytes fit beside the training steps.

Without a budget (``budget=None``) the default is :func:`default_budget`: the snapshots plus
:data:`AUTO_BYTES_PER_SAMPLE` per planned sample. ``policy="exact"`` keeps every layer exact
(today's behaviour); a budget then only degrades what would overflow it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from torch import nn

from metastore_plugins.core.capture.records import LayerRecord
from metastore_plugins.core.ops.cost import (
    SAMPLE_METADATA_BYTES,
    TENSOR_OVERHEAD_BYTES,
    exact_sample_bytes,
    projected_sample_bytes,
)
from metastore_plugins.core.ops.represent import Representation, by_layer, shared_layers

Policy = Literal["auto", "exact"]
POLICIES: tuple[Policy, ...] = ("auto", "exact")
#: Rungs from richest to cheapest: a representation and its projection size (0: none).
LADDER: tuple[tuple[Representation, int], ...] = (
    ("exact", 0),
    ("projected", 16),
    ("projected", 8),
    ("projected", 4),
    ("norms", 0),
    ("nothing", 0),
)
#: Share of the budget kept free for the index, the manifest, the reports and estimation error.
HEADROOM = 0.05
#: Default bytes per planned sample (training steps and passes) besides snapshots. 20 KiB keeps an 8x8
#: projection (and the exact norm) of each captured layer of MiniLM and of BERT-base: on the MiniLM example
#: the estimates reach Spearman 0.94 with exact influence (docs/benchmarks.md); a 100k-example, 3-epoch
#: BERT-base fine-tune stores about 4 GiB of gradients and 1.2 GiB of snapshots (on paper, same page).
AUTO_BYTES_PER_SAMPLE = 20 * 1024


@dataclass(frozen=True)
class RunShape:
    """What a rank expects of its run: planned training batches and samples, passes, snapshot size."""

    train_batches: int = -1  # -1: unknown
    train_batch_size: int = 0
    passes: int = 0
    pass_samples: int = 0  # training and validation samples of one pass on this rank
    snapshot_bytes: int = 0  # one full fp32 snapshot of the trainable parameters (0: none on this rank)

    @property
    def train_samples(self) -> int:
        return max(0, self.train_batches) * self.train_batch_size

    @property
    def known(self) -> bool:
        """Whether the run's length is known (``train_batches = -1``: training steps of unknown number)."""
        return self.train_batches >= 0 and self.train_samples + self.passes * self.pass_samples > 0

    @classmethod
    def of(
        cls, model: nn.Module, *, train_batches: int, train_batch_size: int, passes: int, pass_samples: int, rank: int
    ) -> RunShape:
        """The shape of a run of ``model``; rank 0 alone takes snapshots (the weights are the same on every rank)."""
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return cls(train_batches, max(0, train_batch_size), passes, pass_samples, 4 * trainable * (rank == 0))


def default_budget(shape: RunShape) -> int:
    """The budget when none is given: one snapshot per pass plus :data:`AUTO_BYTES_PER_SAMPLE` per sample
    (and the :data:`HEADROOM` on top)."""
    samples = shape.train_samples + shape.passes * shape.pass_samples
    return math.ceil((shape.passes * shape.snapshot_bytes + AUTO_BYTES_PER_SAMPLE * max(samples, 1)) / (1 - HEADROOM))


def projected_size(config: dict[str, Any]) -> int | None:
    """The projection size ``k`` of a store's ``"projected"`` layers (from its manifest config), None if none."""
    plan = config.get("capture_plan")
    if not isinstance(plan, dict):
        return None
    kept = {*plan.get("train", {}).values(), *plan.get("passes", {}).values()}
    return int(plan["k"]) if "projected" in kept else None


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


@dataclass
class CapturePlan:
    """The plan of one rank; :meth:`to_json` goes to the manifest's ``config["capture_plan"]``.

    Attributes:
        policy, budget: as given (``budget``: bytes for this rank; ``budget_source``: how it was set).
        k: the projection size ``k_in = k_out`` of ``"projected"`` layers.
        train, passes: layer -> representation at training steps / checkpoint passes.
        snapshots: the last ``snapshots`` checkpoint passes take a weight snapshot (-1: every pass).
        planned: bytes planned per part (metadata, snapshots, train, passes, total).
        exact_layers: layers kept exact whatever the rung (tied parameters, or exact no larger).
        degraded: what was lowered during the run (step, part, from, to), in order.
    """

    policy: Policy
    budget: int | None
    budget_source: str
    encoding: str
    k: int
    train: dict[str, Representation]
    passes: dict[str, Representation]
    snapshots: int
    planned_passes: int
    planned: dict[str, int]
    exact_layers: list[str] = field(default_factory=list)
    degraded: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CapturePlan:
        return cls(**data)

    def part(self, capture_point: str) -> dict[str, Representation]:
        """The layer map of a capture point: ``"train"`` is a training step, anything else a pass."""
        return self.train if capture_point == "train" else self.passes

    def lines(self) -> list[str]:
        """The plan in a few lines of text (printed at the start of training, shown by ``metastore inspect``)."""
        budget = "no budget" if self.budget is None else f"budget {_mb(self.budget)} ({self.budget_source})"
        out = [f"capture plan: policy {self.policy!r}, {budget}, encoding {self.encoding}"]
        for name, part in (("training steps", self.train), ("checkpoint passes", self.passes)):
            out.append(f"  {name}: {summarize(part, self.k)}")
        where = "every checkpoint pass"
        if self.snapshots >= 0:
            where = f"the last {self.snapshots} of {self.planned_passes} planned passes"
        out.append(f"  weight snapshots: at {where}")
        planned = ", ".join(f"{key} {_mb(value)}" for key, value in self.planned.items())
        out.append(f"  planned bytes: {planned}")
        for change in self.degraded:
            out.append(
                f"  degraded at step {change['step']}: {change['part']} from {change['from']} to {change['to']} "
                "(the run outgrew its plan)"
            )
        return out


def summarize(part: dict[str, Representation], k: int) -> str:
    """``"projected 16x16 (35 layers), exact (2 layers)"``: how many layers keep what."""
    counts: dict[str, int] = {}
    for representation in part.values():
        label = f"projected {k}x{k}" if representation == "projected" else str(representation)
        counts[label] = counts.get(label, 0) + 1
    return ", ".join(f"{label} ({n} layer{'s' * (n != 1)})" for label, n in counts.items()) or "no layers"


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def make_plan(
    records: Sequence[LayerRecord],
    shape: RunShape,
    *,
    policy: Policy,
    budget: int | None,
    encoding: str,
) -> CapturePlan:
    """The plan of a run from the exact records of its first batch (see the module docstring)."""
    costs = measure(records, encoding, shape.train_batch_size)
    tied = shared_layers(records)
    source = "given"
    pass_samples = shape.passes * shape.pass_samples
    samples = shape.train_samples + pass_samples
    rate_only = budget is None and policy == "auto" and not shape.known
    if budget is None and policy == "auto" and not rate_only:
        budget, source = default_budget(shape), "default: snapshots + 20 KiB per planned sample"
    usable = math.inf if budget is None else (1 - HEADROOM) * budget
    metadata = SAMPLE_METADATA_BYTES * samples
    snapshots = 0
    if policy == "auto" and shape.snapshot_bytes and shape.passes and usable < math.inf:
        share = 1.0 if source != "given" else 0.5  # the default budget holds one snapshot per pass by construction
        snapshots = min(shape.passes, int(share * (usable - metadata) // shape.snapshot_bytes))
    elif policy == "auto" and shape.snapshot_bytes:
        snapshots = shape.passes
    rest = usable - metadata - snapshots * shape.snapshot_bytes

    def total(rung: tuple[Representation, int], samples: int) -> float:
        rep, k = rung
        return samples * sum(c.bytes("exact" if layer in tied else rep, k, encoding) for layer, c in costs.items())

    if rate_only:  # no cap: the richest rung within AUTO_BYTES_PER_SAMPLE, a snapshot at every pass
        source, rest, samples, pass_samples = (
            "none (run length unknown): 20 KiB per sample",
            AUTO_BYTES_PER_SAMPLE,
            1,
            1,
        )
    ladder = LADDER if policy == "auto" else LADDER[:1]
    rung = next((r for r in ladder if total(r, samples) <= rest), ladder[-1])
    pass_rung = rung
    if total(("exact", 0), pass_samples) + total(rung, samples - pass_samples) <= rest:
        pass_rung = ("exact", 0)
    k = rung[1] or LADDER[1][1]

    def layer_map(chosen: tuple[Representation, int]) -> dict[str, Representation]:
        rep = chosen[0]
        return {layer: "exact" if layer in tied else c.choice(rep, k, encoding) for layer, c in costs.items()}

    train_bytes, pass_bytes = total(rung, shape.train_samples), total(pass_rung, pass_samples)
    planned = {
        "metadata": metadata,
        "snapshots": snapshots * shape.snapshot_bytes,
        "training steps": train_bytes,
        "checkpoint passes": pass_bytes,
    }
    planned["total"] = sum(planned.values())
    train = layer_map(rung)
    return CapturePlan(
        policy=policy,
        budget=None if budget is None else int(budget),
        budget_source=source,
        encoding=encoding,
        k=k,
        train=train,
        passes=layer_map(pass_rung),
        snapshots=-1 if usable == math.inf and snapshots and not shape.known else snapshots,
        planned_passes=shape.passes,
        planned={key: int(value) for key, value in planned.items()},
        exact_layers=sorted(tied | {layer for layer, rep in train.items() if rep == "exact" and rung[0] != "exact"}),
    )
