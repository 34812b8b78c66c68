"""``CapturePolicy``: applies the capture plan to each batch, keeps the run within its budget, honours tags.

It sits between capture and the writer (``RunCapture.finish_step``). The first batch makes the
plan (:func:`~metastore_plugins.core.policy.plan.make_plan`); every batch is then turned into the
plan's representations (:func:`~metastore_plugins.core.ops.represent.represent`), and its bytes
counted (shards and their index lines; snapshots once written; the other files are reserved from the
budget: :func:`~metastore_plugins.core.policy.plan.files_bytes`). A batch that would take the run past
its budget is lowered rung by rung (projection 16 -> 8 -> 4, exact norms, metadata only, then not
stored) for the rest of its part (training steps or passes): said once per change with a warning, and
recorded in the plan (``degraded``). The last planned checkpoint pass is the most informative: its
planned bytes stay reserved until it runs, so the training steps and the earlier passes degrade
first. A tag with ``keep=`` sets the representation of the steps it covers, within the budget like
everything else.

A checkpoint pass is stored whole or not at all: when it starts, the metadata of all its samples (ids,
labels, losses) must fit, or the pass is dropped entirely (no tag, no snapshot, no records: said and
recorded as ``"dropped"``); once started, that metadata stays reserved, so its batches may be lowered down
to metadata only but are never cut off part way.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

from metastore_plugins.core.errors import ConfigError
from metastore_plugins.core.ops.cost import BATCH_METADATA_BYTES, SAMPLE_METADATA_BYTES, TENSOR_OVERHEAD_BYTES
from metastore_plugins.core.ops.eigenbasis import EigenBasis, represent_on_bases
from metastore_plugins.core.ops.represent import represent
from metastore_plugins.core.ops.sketch import Projections
from metastore_plugins.core.policy.budget import POLICIES, Budget, RunShape, usable_bytes
from metastore_plugins.core.policy.plan import LADDER, factor_sample_bytes, make_plan
from metastore_plugins.core.policy.plan_record import CapturePlan, in_words
from metastore_plugins.core.records import REPRESENTATIONS, LayerRecord, Representation
from metastore_plugins.core.store.shards.encoding import Encoding, encoded_nbytes

#: ``(step, capture_point) -> keep`` of a tag covering that step, or None.
KeepFor = Callable[[int, str], str | None]


#: A plan under the default budget: ``"auto"``, no bytes given.
DEFAULT_BUDGET = Budget("auto")


class CapturePolicy:
    """The capture plan of one rank in action.

    Args:
        budget: this rank's :class:`~.budget.Budget`, the object the settings made (kept as it is, and passed to
            :func:`~.plan.make_plan`): its ``policy``, ``"auto"`` (plan under the budget) or ``"exact"``
            (every layer exact; a budget then only degrades what would overflow it), and ``given``, the bytes
            this rank may write into the store directory (every file; ``None``: the plan's default
            (``"auto"``) or no limit (``"exact"``)).
        encoding: the store's encoding (bytes per value).
        owner: who runs the capture, for messages.
        on_change: called with the plan after it is made or changed (the manifest keeps it).
        keep_for: what a tag says the step keeps (:meth:`~metastore_plugins.core.store.tags.book.TagBook.keep_for`);
            default: no tags.
    """

    def __init__(
        self,
        budget: Budget = DEFAULT_BUDGET,
        *,
        encoding: Encoding = "fp16",
        owner: str = "RunCapture",
        on_change: Callable[[CapturePlan], None] | None = None,
        keep_for: KeepFor | None = None,
    ) -> None:
        if budget.policy not in POLICIES:
            raise ConfigError(f"{owner}(policy=...) must be one of {', '.join(POLICIES)}; got {budget.policy!r}")
        self.policy, self.encoding, self.owner = budget.policy, encoding, owner
        self.budget = budget
        self.shape = RunShape()
        self.plan: CapturePlan | None = None
        self.spent = 0  # bytes queued for shards and written as snapshots
        self.keep_for: KeepFor = keep_for or (lambda step, capture_point: None)
        self.on_change = on_change
        self._rungs: dict[str, int] = {}  # part -> index in LADDER it was lowered to
        self._projections = Projections()
        self.bases: dict[str, EigenBasis] = {}  # the curvature eigenbasis the passes project on (set_bases)
        self.step_bases: dict[str, EigenBasis] = {}  # its top k x k blocks, which the training steps project on
        self._passes_seen = 0
        self.pass_dropped = False  # the pass started last keeps nothing (start_pass)
        self._pass_metadata = 0.0  # metadata bytes of the pass in progress, reserved and not yet spent
        self._said: set[str] = set()
        #: exact factor bytes a captured sample held in the batch the plan was made from (0: no plan yet)
        self.factor_sample_bytes = 0.0

    def expect(self, shape: RunShape) -> None:
        """What the run will be (before its first batch; a later call before the plan replaces it).

        Raises:
            ValueError: the budget is below what the run's metadata and files alone take, with the figure
                and the ways out (:meth:`~metastore_plugins.core.policy.budget.Budget.check`).
        """
        self.budget.check(shape, self.owner)
        self.shape = shape

    @property
    def limit(self) -> float:
        """Bytes this rank may spend on shards and snapshots: the budget less the headroom and the other files."""
        return usable_bytes(self.plan.budget if self.plan is not None else self.budget.given, self.shape)

    def _reserved(self, part: str) -> float:
        """Bytes kept for the last planned checkpoint pass (and its snapshot) until it runs."""
        plan = self.plan
        if part == "last" or plan is None or plan.planned_passes <= 0 or self._passes_seen >= plan.planned_passes:
            return 0.0
        snapshot = self.shape.snapshot_bytes if plan.snapshots != 0 else 0
        metadata = SAMPLE_METADATA_BYTES * self.shape.pass_samples + BATCH_METADATA_BYTES * self.shape.pass_batches
        return plan.planned.get("checkpoint passes", 0) / plan.planned_passes + metadata + snapshot

    def plan_for(self, records: Sequence[LayerRecord]) -> CapturePlan:
        """The plan, made from ``records`` (a batch's exact records) when none is made yet."""
        if self.plan is None:
            self.plan = make_plan(records, self.shape, budget=self.budget, encoding=self.encoding)
            self.factor_sample_bytes = factor_sample_bytes(records)
            self._changed()
        return self.plan

    def apply(self, records: Sequence[LayerRecord], *, capture_point: str, step: int) -> list[LayerRecord] | None:
        """The batch's records as the plan (and any tag) says, lowered if they would exceed the budget.

        None when not even the batch's metadata fits: the batch is not stored (and no later one of its part).
        """
        plan = self.plan_for(records)
        part = self._part(capture_point)
        if part != "train" and self.pass_dropped:
            return None  # said once when the pass started
        planned = plan.part(capture_point)
        planned_k = plan.k if part == "train" else plan.passes_k
        held = 0.0 if part == "train" else max(0.0, self._pass_metadata - self._metadata_nbytes(records))
        limit = self.limit - self._reserved(part) - held  # the rest of the pass's metadata stays reserved
        keep = self.keep_for(step, capture_point)
        if keep in REPRESENTATIONS:
            kept, size = self._kept(records, {layer: keep for layer in planned}, planned_k, part)
            if self.spent + size <= limit:
                return self._spend(kept, size, held, part)
            self._say_once(
                f"{self.owner}: a tag asks to keep step {step} ({capture_point}) as {keep!r}, which does not fit the "
                f"budget ({plan.budget:,} bytes); those steps are kept as planned"
            )
        while True:
            rung = self._rungs.get(part)
            if rung is None:
                chosen, k = planned, planned_k
            else:
                floor, k = LADDER[rung]
                chosen = {layer: _no_richer(rep, floor) for layer, rep in planned.items()}
                k = k or planned_k
            kept, size = self._kept(records, chosen, k, part)
            if self.spent + size <= limit:
                return self._spend(kept, size, held, part)
            if (rung if rung is not None else _rung_of(planned, planned_k)) == len(LADDER) - 1:
                if part != "train":  # a started pass keeps its metadata (reserved when it started)
                    return self._spend(kept, size, held, part)
                self._degrade(part, step, stop=True)  # metadata only does not fit either
                return None
            self._degrade(part, step)

    def at_last_pass(self) -> bool:
        """Whether the pass started last (:meth:`start_pass`) is the last planned one (or beyond the plan)."""
        return self._part("pass") == "last"

    def _part(self, capture_point: str) -> str:
        """``"train"``, ``"passes"``, or ``"last"``: the last planned pass, which starts again from its planned
        rung on the bytes kept for it (and any pass beyond the plan)."""
        if capture_point == "train":
            return "train"
        planned = self.plan.planned_passes if self.plan is not None else self.shape.passes
        return "last" if 0 < planned <= self._passes_seen else "passes"

    def _spend(self, kept: list[LayerRecord], size: int, held: float, part: str) -> list[LayerRecord]:
        self.spent += size
        if part != "train":
            self._pass_metadata = held
        return kept

    def _metadata_nbytes(self, records: Sequence[LayerRecord]) -> int:
        return BATCH_METADATA_BYTES + SAMPLE_METADATA_BYTES * (records[0].batch_size if records else 0)

    def projects_passes(self) -> bool:
        """Whether the checkpoint passes keep some layer projected (as planned, or lowered to it): they then
        project on a curvature eigenbasis once :meth:`set_bases` gave one."""
        if self.plan is None:
            return False
        rung = self._rungs.get("passes", self._rungs.get("last"))
        lowered = rung is not None and LADDER[rung][0] == "projected"
        return lowered or "projected" in self.plan.passes.values()

    def projects_steps(self) -> bool:
        """Whether the training steps keep some layer projected (they then go on the latest eigenbasis)."""
        rung = self._rungs.get("train")
        lowered = rung is not None and LADDER[rung][0] == "projected"
        return self.plan is not None and (lowered or "projected" in self.plan.train.values())

    def pass_k(self) -> int:
        """The projection size the checkpoint passes keep now: the plan's, or that of the rung they were lowered to."""
        assert self.plan is not None
        rung = self._rungs.get("passes", self._rungs.get("last"))
        lowered = LADDER[rung][1] if rung is not None else 0
        return lowered or self.plan.passes_k

    def set_bases(self, bases: dict[str, EigenBasis], step: int) -> None:
        """Project the checkpoint passes from now on onto ``bases`` (fitted at ``step``), and the training steps
        from now on onto their top ``k x k`` blocks (the steps' size); recorded in the plan."""
        self.bases = bases
        self.step_bases = {layer: basis.truncated(self.plan.k) for layer, basis in bases.items()} if self.plan else {}
        if self.plan is not None and bases and step not in self.plan.bases:
            self.plan.bases.append(step)
            self._changed()

    def summarized(self, capture_point: str) -> frozenset[str]:
        """Layers the plan keeps projected or as norms at ``capture_point`` (none before the plan is made)."""
        if self.plan is None:
            return frozenset()
        return frozenset(layer for layer, rep in self.plan.part(capture_point).items() if rep in ("projected", "norms"))

    def _kept(
        self, records: Sequence[LayerRecord], chosen: dict[str, Representation], k: int, part: str
    ) -> tuple[list[LayerRecord], int]:
        bases = self.bases if part != "train" else self.step_bases
        if bases:
            kept = represent_on_bases(records, chosen, k, self._projections, bases)
        else:
            kept = represent(records, chosen, k, k, self._projections)
        return kept, self._nbytes(kept, records[0].batch_size if records else 0)

    def _say_once(self, message: str) -> None:
        if message.split(" step ")[0] not in self._said:
            self._said.add(message.split(" step ")[0])
            warnings.warn(message, stacklevel=4)

    def start_pass(self, step: int = -1) -> bool:
        """Count a checkpoint pass (at ``step``) as started, once per pass before :meth:`snapshot_due` is asked of
        it, and reserve the metadata of all its samples; False (and :attr:`pass_dropped`) when that does not fit:
        the whole pass is then not stored, which is said once and recorded in the plan (``"dropped"``)."""
        self._passes_seen += 1
        part = self._part("pass")
        need = SAMPLE_METADATA_BYTES * self.shape.pass_samples + BATCH_METADATA_BYTES * self.shape.pass_batches
        self.pass_dropped = self.spent + need > self.limit - self._reserved(part)
        self._pass_metadata = 0.0 if self.pass_dropped else float(need)
        if self.pass_dropped and self.plan is not None:
            name = {"passes": "checkpoint passes", "last": "the last checkpoint pass"}[part]
            before = _label(LADDER[self._rungs.get(part, _rung_of(self.plan.passes, self.plan.passes_k))])
            self.plan.degraded.append({"step": step, "part": name, "from": before, "to": "dropped"})
            self._say_once(
                f"{self.owner}: the run outgrew its capture plan (budget {self.plan.budget:,} bytes, {self.spent:,} "
                f"spent): the checkpoint pass at step {step} is not stored, not even its sample ids and losses (a "
                "pass is kept whole or not at all)"
            )
            self._changed()
        return not self.pass_dropped

    def snapshot_due(self) -> bool | None:
        """Whether the pass started last takes a weight snapshot: True, False (none planned for it), or None (one
        is planned but no longer fits the budget: :meth:`skip_snapshot` records that). Changes nothing.

        Before the plan is made (the first pass of a run that captures no training steps), the snapshots
        the plan will have are known from the run's shape and budget alone.
        """
        snapshots = self.plan.snapshots if self.plan is not None else self.budget.snapshots(self.shape)
        if not snapshots or (snapshots > 0 and self._passes_seen < self.shape.passes - snapshots + 1):
            return False  # none planned, or the plan snapshots only the last passes
        room = self.limit - self._reserved("passes") - self._pass_metadata  # the pass's metadata comes first
        return True if self.spent + self.shape.snapshot_bytes <= room else None

    def skip_snapshot(self, step: int) -> None:
        """Record that the planned snapshot of the pass at ``step`` is skipped (it no longer fits): said once, and
        in the plan (before the plan is made there is nothing to record)."""
        if self.plan is None:
            return
        self.plan.degraded.append({"step": step, "part": "weight snapshots", "from": "snapshot", "to": "skipped"})
        self._say_once(
            f"{self.owner}: the run outgrew its capture plan (budget {self.plan.budget:,} bytes, {self.spent:,} "
            f"spent): the weight snapshot of the checkpoint pass at step {step} is skipped"
        )
        self._changed()

    def should_snapshot(self, step: int = -1) -> bool:
        """:meth:`start_pass`, :meth:`snapshot_due` and, for a planned snapshot that no longer fits,
        :meth:`skip_snapshot`: what the start of a checkpoint pass at ``step`` runs (once per pass)."""
        if not self.start_pass(step):
            return False
        due = self.snapshot_due()
        if due is None:
            self.skip_snapshot(step)
        return bool(due)

    def spend(self, nbytes: int) -> None:
        """Count bytes written outside the shards (a snapshot)."""
        self.spent += nbytes

    def _degrade(self, part: str, step: int, stop: bool = False) -> None:
        assert self.plan is not None
        plan = self.plan
        current = self._rungs.get(part, _rung_of(plan.part(part), plan.k if part == "train" else plan.passes_k))
        self._rungs[part] = lowered = min(current + 1, len(LADDER) - 1)
        name = {"train": "training steps", "passes": "checkpoint passes", "last": "the last checkpoint pass"}[part]
        if stop and any(c["part"] == name and c["to"] == "not stored" for c in self.plan.degraded):
            return  # said once
        before, after = _label(LADDER[current]), "not stored" if stop else _label(LADDER[lowered])
        self.plan.degraded.append({"step": step, "part": name, "from": before, "to": after})
        budget, verb = f"budget {self.plan.budget:,} bytes, {self.spent:,} spent", "is" if part == "last" else "are"
        if stop:
            message = f"{name} {verb} no longer stored from step {step} on, not even their sample ids and losses"
        else:
            message = f"{name} {verb} kept as {in_words(after)} instead of {in_words(before)} from step {step} on"
        warnings.warn(f"{self.owner}: the run outgrew its capture plan ({budget}): {message}", stacklevel=4)
        self._changed()

    def _nbytes(self, records: Sequence[LayerRecord], batch: int) -> int:
        """Bytes a batch will take in a shard: encoded tensors, their header entries, and per-sample metadata."""
        tensors = [t for record in records for t in record.tensors.values()]
        size = sum(encoded_nbytes(t, self.encoding) for t in tensors)
        return size + TENSOR_OVERHEAD_BYTES * len(tensors) + BATCH_METADATA_BYTES + SAMPLE_METADATA_BYTES * batch

    def _changed(self) -> None:
        if self.on_change is not None and self.plan is not None:
            self.on_change(self.plan)

    def manifest_entry(self) -> dict[str, Any]:
        """``config["capture_plan"]`` of the manifest."""
        return {} if self.plan is None else self.plan.to_json()


def _rung_of(part: dict[str, Representation], k: int) -> int:
    """The ladder rung a part was planned at (its cheapest layer decides; exact layers are no larger)."""
    order = list(REPRESENTATIONS)
    cheapest = max(part.values(), key=order.index, default="exact")
    return LADDER.index((cheapest, k if cheapest == "projected" else 0))


def _no_richer(representation: Representation, floor: Representation) -> Representation:
    """``representation``, or ``floor`` where it is richer (exact layers follow a projection down)."""
    order = list(REPRESENTATIONS)
    return floor if order.index(representation) < order.index(floor) else representation


def _label(rung: tuple[Representation, int]) -> str:
    rep, k = rung
    return f"projected {k}x{k}" if rep == "projected" else rep
