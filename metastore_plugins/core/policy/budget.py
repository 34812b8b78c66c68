"""The byte budget of one rank's run: the shape it is planned for, what it reserves, and where it comes from.

The budget covers every byte the run writes under the store directory. Of a budget ``b`` the plan may
use ``(1 - HEADROOM) b - files`` (:meth:`Budget.usable`): :data:`HEADROOM` is kept free for estimation
error, and :func:`files_bytes` reserves the files besides shards and snapshots. The metadata of every
planned sample comes first: a budget below that and the files is refused at the start
(:meth:`Budget.check`). Without a budget the default is :func:`default_budget`: a weight snapshot per
planned checkpoint pass plus :data:`AUTO_BYTES_PER_SAMPLE` per planned sample.

:class:`Budget` carries the figure from the settings to the plan and the policy that keeps to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from torch import nn

from metastore_plugins.core.errors import ConfigError
from metastore_plugins.core.ops.cost import BATCH_METADATA_BYTES, SAMPLE_METADATA_BYTES
from metastore_plugins.core.policy.plan_record import size_text

Policy = Literal["auto", "exact"]
POLICIES: tuple[Policy, ...] = ("auto", "exact")
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
    snapshot_bytes: int = 0  # one full fp32 snapshot of the trainable parameters (0: no snapshots in this run)
    layers: int = 0  # modules with trainable parameters of their own (the manifest's layer table)
    reports: bool = False  # this rank writes the end-of-training reports into the store
    passes_on_basis: bool = False  # projected passes go on each checkpoint's curvature eigenbasis (a basis fit)
    takes_snapshots: bool = True  # this rank writes the snapshots (rank 0); every rank plans around their bytes
    start_samples: int = 0  # validation samples of the pass before the first step (0: none), not one of `passes`

    @property
    def train_samples(self) -> int:
        return max(0, self.train_batches) * self.train_batch_size

    @property
    def all_pass_samples(self) -> int:
        """Planned samples of every pass of this rank, the start pass's included."""
        return self.passes * self.pass_samples + self.start_samples

    @property
    def start_batches(self) -> int:
        """Batches of the start pass (batched like training), at most."""
        return -(-self.start_samples // (self.train_batch_size or 32)) + 1 if self.start_samples else 0

    @property
    def samples(self) -> int:
        """Planned samples of this rank: training steps' and every pass's."""
        return self.train_samples + self.all_pass_samples

    @property
    def pass_batches(self) -> int:
        """Batches of one pass (its splits batched like training; a batch size of 32 when unknown), at most."""
        return -(-self.pass_samples // (self.train_batch_size or 32)) + 1 if self.pass_samples else 0

    @property
    def metadata_bytes(self) -> int:
        """Bytes of the metadata of every planned sample and batch (shards and index lines)."""
        batches = max(0, self.train_batches) + self.passes * self.pass_batches + self.start_batches
        return SAMPLE_METADATA_BYTES * self.samples + BATCH_METADATA_BYTES * batches

    @property
    def known(self) -> bool:
        """Whether the run's length is known (``train_batches = -1``: training steps of unknown number)."""
        return self.train_batches >= 0 and self.samples > 0

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
        passes_on_basis: bool = False,
        start_samples: int = 0,
    ) -> RunShape:
        """The shape of a run of ``model``; rank 0 alone takes snapshots (the weights are the same on every rank)
        and writes the reports (``reports``: they are on); ``passes_on_basis``: see the field. Every rank knows
        the snapshots' size, so that a given budget leaves every rank the same room for its records
        (:meth:`Budget.reserved`): a query pairs one rank's records with another's."""
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        layers = sum(any(p.requires_grad for p in m.parameters(recurse=False)) for m in model.modules())
        zero = rank == 0
        return cls(
            train_batches,
            max(0, train_batch_size),
            passes,
            pass_samples,
            4 * trainable,
            layers,
            reports and zero,
            passes_on_basis,
            zero,
            start_samples,
        )


def files_bytes(shape: RunShape) -> int:
    """Bytes reserved for the store's files besides shards and snapshots: manifest, tags, shard headers and index
    lines of the passes, and the reports (:data:`MANIFEST_BYTES` and the constants after it)."""
    passes = shape.passes + bool(shape.start_samples)
    return MANIFEST_BYTES + LAYER_BYTES * shape.layers + PASS_BYTES * passes + REPORT_BYTES * shape.reports


def usable_bytes(budget: int | None, shape: RunShape) -> float:
    """Bytes of ``budget`` the shards and snapshots may take: ``(1 - HEADROOM) budget - files`` (no budget: inf)."""
    return math.inf if budget is None else (1 - HEADROOM) * budget - files_bytes(shape)


def with_headroom(nbytes: float) -> int:
    """The least budget whose usable share holds ``nbytes`` besides nothing else: ``ceil(nbytes / (1 - HEADROOM))``."""
    return math.ceil(nbytes / (1 - HEADROOM))


def minimum_budget(shape: RunShape) -> int:
    """The least budget a run of this shape can keep to: its metadata and files, with the :data:`HEADROOM`."""
    return with_headroom(shape.metadata_bytes + files_bytes(shape))


def default_budget(shape: RunShape) -> int:
    """The budget when none is given: one snapshot per pass plus :data:`AUTO_BYTES_PER_SAMPLE` per sample, the
    files (:func:`files_bytes`), and the :data:`HEADROOM` on top."""
    per_sample = AUTO_BYTES_PER_SAMPLE * max(shape.samples, 1)
    snapshots = shape.passes * shape.snapshot_bytes if shape.takes_snapshots else 0
    return with_headroom(snapshots + per_sample + files_bytes(shape))


@dataclass(frozen=True)
class Budget:
    """The byte budget of one rank: ``given`` bytes (None: none given) under ``policy`` (``"auto"`` or ``"exact"``).

    The one object the figure travels in, from the settings (split between ranks: :meth:`per_rank`) through the
    capture policy to the plan; each question asked of it is answered here.
    """

    policy: Policy = "exact"
    given: int | None = None

    def per_rank(self, world_size: int) -> Budget:
        """This budget split evenly between ``world_size`` ranks (each rank writes its own shards); itself in one."""
        return self if self.given is None or world_size <= 1 else Budget(self.policy, self.given // world_size)

    def check(self, shape: RunShape, owner: str) -> None:
        """Refuse, at the start, a budget below :func:`minimum_budget` (the figures and the ways out in the message)."""
        budget = self.given
        if budget is None or not shape.known or budget >= (least := minimum_budget(shape)):
            return
        passes = f" and {shape.passes} checkpoint passes of {shape.pass_samples:,} samples" if shape.passes else ""
        raise ConfigError(
            f"{owner}(budget={budget:,} bytes) is below what this run needs before any gradient: {least:,} bytes "
            f"({size_text(least)}). Its metadata alone (sample ids, labels, losses, predictions, margins, in the "
            f"shards and the index) takes {shape.metadata_bytes:,} bytes for {shape.train_samples:,} training "
            f"samples{passes}; the manifest, tags{', reports' * shape.reports} and the {HEADROOM:.0%} headroom take "
            f"the rest. Give budget={least:,} or more, or store fewer samples (capture_train_steps=False, "
            "checkpoint_train_samples=, checkpoint_val_samples=, fewer checkpoint passes, reports=False)"
        )

    def resolved(self, shape: RunShape) -> tuple[int | None, str]:
        """The budget a plan works to and where it comes from: given, the default (``"auto"`` and a known length),
        or none (``"exact"`` without a budget; ``"auto"`` on a run of unknown length)."""
        if self.given is not None:
            return self.given, "given"
        if self.policy == "auto" and shape.known:
            return default_budget(shape), "default: snapshots + 20 KiB per planned sample"
        if self.policy == "auto":
            return None, "none (run length unknown): 20 KiB per sample"
        return None, "none"

    def snapshots(self, shape: RunShape) -> int:
        """How many of the last planned passes take a weight snapshot (-1: every pass, the run's length unknown).

        It depends on the run's shape and budget alone, so a pass that runs before the plan is made (the
        first one, when training steps are not captured) knows whether it takes one. Under a given budget
        every rank counts rank 0's snapshots (:meth:`reserved`); a rank that takes none has none.
        """
        if not shape.takes_snapshots:
            return 0
        return self._snapshots(shape)

    def reserved(self, shape: RunShape) -> int:
        """Bytes kept for weight snapshots by the plan of a rank of this shape: rank 0's snapshots on every rank
        under a given budget (the same room left for records on every rank), else those the rank takes (the
        default budget adds them to rank 0's alone)."""
        if self.given is None and not shape.takes_snapshots:
            return 0
        return max(0, self._snapshots(shape)) * shape.snapshot_bytes

    def _snapshots(self, shape: RunShape) -> int:
        """:meth:`snapshots` of the rank that takes them."""
        if self.policy != "auto" or not shape.snapshot_bytes or not shape.passes:
            return 0
        cap, source = self.resolved(shape)
        if cap is None:
            return -1
        share = 0.5 if source == "given" else 1.0  # the default budget holds one snapshot per pass by construction
        left = usable_bytes(cap, shape) - shape.metadata_bytes
        return max(0, min(shape.passes, int(share * left // shape.snapshot_bytes)))


def parse_budget(budget: int | float | str | None, owner: str) -> int | None:
    """Bytes of a budget given as a number of bytes or a string such as ``"250MB"`` / ``"4 GiB"``."""
    if budget is None:
        return None
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20}
    units |= {"gib": 2**30, "tib": 2**40}
    value: float | None = None
    if isinstance(budget, str):
        text = budget.strip().lower().replace(" ", "")
        number = text.rstrip("kmgtib")
        try:
            value = float(number) * units[text[len(number) :]]
        except (ValueError, KeyError):
            value = None
    elif isinstance(budget, (int, float)) and not isinstance(budget, bool):
        value = float(budget)
    if value is None or not 0 < value < float("inf"):
        raise ConfigError(
            f"{owner}(budget=...) must be a positive number of bytes or a size such as '250MB' or '4GiB'; "
            f"got {budget!r}"
        )
    return int(value)
