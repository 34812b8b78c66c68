"""The capture plan: what each layer keeps at training steps and checkpoint passes, under a byte budget.

The budget covers every byte the run writes under the store directory (:func:`files_bytes` says
how the files besides shards and snapshots are reserved). A plan is made once, from the first
captured batch (its exact records measure each layer's bytes per sample) and the run's shape
(planned training batches, checkpoint passes, snapshot size):

1. ``usable = (1 - HEADROOM) budget - files``; the metadata of every planned sample first (a budget
   below that and the files is refused at the start: :func:`check_budget`);
2. weight snapshots, one per checkpoint pass (the latest ones), while they take at most half of a
   given budget (the default budget counts one per pass);
3. training steps and checkpoint passes take the first rung of :data:`LADDER` whose bytes fit
   what is left: exact, then a projection of ``k x k`` per layer (16, 8, 4), then exact norms
   only, then nothing. A layer whose exact bytes are no more than its projection's stays exact;
4. checkpoint passes are upgraded to the richest rung whose bytes fit beside the training steps.

Without a budget (``budget=None``) the default is :func:`default_budget`: the snapshots plus
:data:`AUTO_BYTES_PER_SAMPLE` per planned sample. ``policy="exact"`` keeps every layer exact
(today's behaviour); a budget then only degrades what would overflow it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from torch import nn

from metastore_plugins.core.ops.cost import (
    BATCH_METADATA_BYTES,
    SAMPLE_METADATA_BYTES,
    TENSOR_OVERHEAD_BYTES,
    exact_sample_bytes,
    projected_sample_bytes,
)
from metastore_plugins.core.ops.represent import Representation, by_layer, shared_layers
from metastore_plugins.core.records import LayerRecord

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
#: Share of the budget kept free for estimation error (small shards' headers and index lines, timer flushes).
HEADROOM = 0.05
#: Bytes reserved from the budget for the files besides shards and snapshots (:func:`files_bytes`): the
#: manifest (config and plan: 0.9 kB for a 2-layer MLP), each layer's share of it (its table entry and its
#: name in the plan and the index lines), per checkpoint pass a tag line (0.25 kB) and a shard's header and
#: index line, and the end-of-training reports (tables 25 kB and a 47 kB scatter figure on a 2-layer MLP).
MANIFEST_BYTES = 4 * 1024
LAYER_BYTES = 1024
PASS_BYTES = 2 * 1024
REPORT_BYTES = 96 * 1024
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
    layers: int = 0  # modules with trainable parameters of their own (the manifest's layer table)
    reports: bool = False  # this rank writes the end-of-training reports into the store

    @property
    def train_samples(self) -> int:
        return max(0, self.train_batches) * self.train_batch_size

    @property
    def samples(self) -> int:
        """Planned samples of this rank: training steps' and every pass's."""
        return self.train_samples + self.passes * self.pass_samples

    @property
    def pass_batches(self) -> int:
        """Batches of one pass (its splits batched like training; a batch size of 32 when unknown), at most."""
        return -(-self.pass_samples // (self.train_batch_size or 32)) + 1 if self.pass_samples else 0

    @property
    def metadata_bytes(self) -> int:
        """Bytes of the metadata of every planned sample and batch (shards and index lines)."""
        batches = max(0, self.train_batches) + self.passes * self.pass_batches
        return SAMPLE_METADATA_BYTES * self.samples + BATCH_METADATA_BYTES * batches

    @property
    def known(self) -> bool:
        """Whether the run's length is known (``train_batches = -1``: training steps of unknown number)."""
        return self.train_batches >= 0 and self.train_samples + self.passes * self.pass_samples > 0

    @classmethod
    def of(
        cls,
        model: nn.Module,
        *,
        train_batches: int,
        train_batch_size: int,
        passes: int,
        pass_samples: int,
        rank: int,
        reports: bool = False,
    ) -> RunShape:
        """The shape of a run of ``model``; rank 0 alone takes snapshots (the weights are the same on every rank)
        and writes the reports (``reports``: they are on)."""
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        layers = sum(any(p.requires_grad for p in m.parameters(recurse=False)) for m in model.modules())
        zero = rank == 0
        return cls(
            train_batches,
            max(0, train_batch_size),
            passes,
            pass_samples,
            4 * trainable * zero,
            layers,
            reports and zero,
        )


def files_bytes(shape: RunShape) -> int:
    """Bytes reserved for the store's files besides shards and snapshots: manifest, tags, shard headers and index
    lines of the passes, and the reports (:data:`MANIFEST_BYTES` and the constants after it)."""
    return MANIFEST_BYTES + LAYER_BYTES * shape.layers + PASS_BYTES * shape.passes + REPORT_BYTES * shape.reports


def minimum_budget(shape: RunShape) -> int:
    """The least budget a run of this shape can keep to: its metadata and files, with the :data:`HEADROOM`."""
    return math.ceil((shape.metadata_bytes + files_bytes(shape)) / (1 - HEADROOM))


def check_budget(budget: int | None, shape: RunShape, owner: str) -> None:
    """Refuse, at the start, a budget below :func:`minimum_budget` (the figures and the ways out in the message)."""
    if budget is None or not shape.known or budget >= (least := minimum_budget(shape)):
        return
    passes = f" and {shape.passes} checkpoint passes of {shape.pass_samples:,} samples" if shape.passes else ""
    raise ValueError(
        f"{owner}(budget={budget:,} bytes) is below what this run needs before any gradient: {least:,} bytes "
        f"({size_text(least)}). Its metadata alone (sample ids, labels, losses, predictions, margins, in the shards "
        f"and the index) takes {shape.metadata_bytes:,} bytes for {shape.train_samples:,} training samples{passes}; "
        f"the manifest, tags{', reports' * shape.reports} and the {HEADROOM:.0%} headroom take the rest. Give "
        f"budget={least:,} or more, or store fewer samples (capture_train_steps=False, checkpoint_train_samples=, "
        "checkpoint_val_samples=, fewer checkpoint passes, reports=False)"
    )


def default_budget(shape: RunShape) -> int:
    """The budget when none is given: one snapshot per pass plus :data:`AUTO_BYTES_PER_SAMPLE` per sample, the
    files (:func:`files_bytes`), and the :data:`HEADROOM` on top."""
    per_sample = AUTO_BYTES_PER_SAMPLE * max(shape.samples, 1)
    return math.ceil((shape.passes * shape.snapshot_bytes + per_sample + files_bytes(shape)) / (1 - HEADROOM))


def budget_of(shape: RunShape, policy: Policy, budget: int | None) -> tuple[int | None, str]:
    """The budget a plan works to and where it comes from: given, the default (``"auto"`` and a known length),
    or none (``"exact"`` without a budget; ``"auto"`` on a run of unknown length)."""
    if budget is not None:
        return budget, "given"
    if policy == "auto" and shape.known:
        return default_budget(shape), "default: snapshots + 20 KiB per planned sample"
    if policy == "auto":
        return None, "none (run length unknown): 20 KiB per sample"
    return None, "none"


def planned_snapshots(shape: RunShape, policy: Policy, budget: int | None) -> int:
    """How many of the last planned passes take a weight snapshot (-1: every pass, the run's length unknown).

    It depends on the run's shape and budget alone, so a pass that runs before the plan is made (the
    first one, when training steps are not captured) knows whether it takes one.
    """
    if policy != "auto" or not shape.snapshot_bytes or not shape.passes:
        return 0
    cap, source = budget_of(shape, policy, budget)
    if cap is None:
        return -1
    share = 0.5 if source == "given" else 1.0  # the default budget holds one snapshot per pass by construction
    left = (1 - HEADROOM) * cap - files_bytes(shape) - shape.metadata_bytes
    return max(0, min(shape.passes, int(share * left // shape.snapshot_bytes)))


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
        budget = "no budget" if self.budget is None else f"budget {size_text(self.budget)} ({self.budget_source})"
        out = [f"capture plan: policy {self.policy!r}, {budget}, encoding {self.encoding}"]
        out.append(f"  training steps: {summarize(self.train, self.k)}")
        passes = summarize(self.passes, self.k) if self.planned_passes else "none planned"
        out.append(f"  checkpoint passes: {passes}")
        if not self.planned_passes and self.snapshots >= 0:
            where = "none (no checkpoint passes planned)"
        elif self.snapshots < 0:
            where = "at every checkpoint pass (the run's length is unknown)"
        elif self.snapshots == 0:
            where = "none (the budget leaves no room for one)" if self.policy == "auto" else "none (policy 'exact')"
        else:
            last = "the last" if self.snapshots == 1 else f"the last {self.snapshots}"
            where = f"at {last} of {self.planned_passes} planned checkpoint passes"
        out.append(f"  weight snapshots: {where}")
        planned = ", ".join(f"{key} {size_text(value)}" for key, value in self.planned.items())
        out.append(f"  planned bytes: {planned}")
        for change in self.degraded:
            if change["to"] == "skipped":
                out.append(
                    f"  skipped at step {change['step']}: the weight snapshot of that checkpoint pass (the budget "
                    "was spent)"
                )
            elif change["to"] == "not stored":
                out.append(
                    f"  stopped at step {change['step']}: {change['part']} no longer stored, not even their metadata "
                    "(the budget was spent)"
                )
            else:
                out.append(
                    f"  degraded at step {change['step']}: {change['part']} from {in_words(change['from'])} to "
                    f"{in_words(change['to'])} "
                    "(the run outgrew its plan)"
                )
        return out


def summarize(part: dict[str, Representation], k: int) -> str:
    """``"projected 16x16 (35 layers), exact (2 layers)"``: how many layers keep what."""
    if part and set(part.values()) == {"nothing"}:
        return "metadata only (sample ids, labels, losses, predictions, margins; no gradients)"
    counts: dict[str, int] = {}
    for representation in part.values():
        label = f"projected {k}x{k}" if representation == "projected" else str(representation)
        counts[label] = counts.get(label, 0) + 1
    return ", ".join(f"{label} ({n} layer{'s' * (n != 1)})" for label, n in counts.items()) or "no layers"


def in_words(label: str) -> str:
    """A rung's label as the plan's lines say it (``"nothing"`` keeps the metadata: ``"metadata only"``)."""
    return "metadata only" if label == "nothing" else label


def size_text(nbytes: float) -> str:
    """``"48.8 KiB"``, ``"5.7 MiB"``, ``"1.2 GiB"``: a byte count people can read (bytes below 1 KiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{int(nbytes)} bytes"


def make_plan(
    records: Sequence[LayerRecord],
    shape: RunShape,
    *,
    policy: Policy,
    budget: int | None,
    encoding: str,
) -> CapturePlan:
    """The plan of a run from the exact records of its first batch (see the module docstring)."""
    if shape.train_batches > 0 and not shape.train_batch_size and records:  # a loader that did not say its batch
        shape = replace(shape, train_batch_size=records[0].batch_size)
    costs = measure(records, encoding, shape.train_batch_size)
    tied = shared_layers(records)
    rate_only = budget is None and policy == "auto" and not shape.known
    snapshots = planned_snapshots(shape, policy, budget)  # the budget as given: a default one holds one per pass
    budget, source = budget_of(shape, policy, budget)
    pass_samples = shape.passes * shape.pass_samples
    samples = shape.train_samples + pass_samples
    files = files_bytes(shape)
    usable = math.inf if budget is None else (1 - HEADROOM) * budget - files
    metadata = shape.metadata_bytes
    rest = usable - metadata - max(0, snapshots) * shape.snapshot_bytes

    def total(rung: tuple[Representation, int], samples: int) -> float:
        rep, k = rung
        return samples * sum(c.bytes("exact" if layer in tied else rep, k, encoding) for layer, c in costs.items())

    if rate_only:  # no cap: the richest rung within AUTO_BYTES_PER_SAMPLE, a snapshot at every pass
        rest, samples, pass_samples = AUTO_BYTES_PER_SAMPLE, 1, 1
    ladder = LADDER if policy == "auto" else LADDER[:1]
    rung = next((r for r in ladder if total(r, samples) <= rest), ladder[-1])
    train_bytes = total(rung, samples - pass_samples)
    # one projection size per store: a projected pass takes the training steps' k when they are projected too
    same_k = [r for r in ladder if not (r[0] == rung[0] == "projected" and r[1] != rung[1])]
    pass_rung = next((r for r in same_k if total(r, pass_samples) + train_bytes <= rest), rung)
    k = rung[1] or pass_rung[1] or LADDER[1][1]

    def layer_map(chosen: tuple[Representation, int]) -> dict[str, Representation]:
        rep = chosen[0]
        return {layer: "exact" if layer in tied else c.choice(rep, k, encoding) for layer, c in costs.items()}

    planned = {
        "metadata": metadata,
        "files": files,
        "snapshots": max(0, snapshots) * shape.snapshot_bytes,
        "training steps": total(rung, shape.train_samples),
        "checkpoint passes": total(pass_rung, shape.passes * shape.pass_samples),
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
        snapshots=snapshots,
        planned_passes=shape.passes,
        planned={key: int(value) for key, value in planned.items()},
        exact_layers=sorted(tied | {layer for layer, rep in train.items() if rep == "exact" and rung[0] != "exact"}),
    )
