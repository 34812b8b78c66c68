"""The capture plan as a store records it: ``config["capture_plan"]`` of each rank's manifest, and its text.

The plan is made by :func:`~metastore_plugins.core.policy.plan.make_plan` at the start of a run
and lowered by :class:`~metastore_plugins.core.policy.runtime.CapturePolicy` as the run goes; the
store keeps it (:meth:`CapturePlan.to_json`) and checks it
(:mod:`~metastore_plugins.core.store.reading.plan_check`, what ``verify`` names); whoever reads a store
(``metastore inspect``, the reports) reads it back here, without the planning code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.records import Representation
from metastore_plugins.core.store.reading.plan_check import PLAN_KEY, plan_problem
from metastore_plugins.core.store.shards.manifest import manifest_name


def recorded_plan(directory: Path, manifests: Sequence[dict[str, Any]]) -> CapturePlan | None:
    """The plan a store's merged config holds (the lowest rank's that records one), ``None`` when none is recorded.

    Raises:
        StoreError: naming the manifest when its plan is damaged (:func:`plan_problem`).
    """
    for manifest in sorted(manifests, key=lambda m: int(m["rank"])):
        plan = manifest.get("config", {}).get(PLAN_KEY)
        if plan:
            problem = plan_problem(plan)
            if problem is not None:
                raise StoreError(f"{directory / manifest_name(manifest['rank'])}: config[{PLAN_KEY!r}] {problem}")
            return CapturePlan.from_json(plan)
    return None


def readable_plan(directory: Path, manifests: Sequence[dict[str, Any]]) -> CapturePlan | None:
    """:func:`recorded_plan`, ``None`` where it is damaged too (``verify`` and ``metastore inspect`` name that)."""
    try:
        return recorded_plan(directory, manifests)
    except StoreError:
        return None


def projected_size(directory: Path, manifests: Sequence[dict[str, Any]]) -> int | None:
    """The projection size ``k`` of a store's ``"projected"`` layers (from its recorded plan), None if none: the
    checkpoint passes' where they keep some layer projected, else the training steps'.

    Raises:
        StoreError: naming the manifest when its plan is damaged.
    """
    plan = recorded_plan(directory, manifests)
    if plan is None:
        return None
    if "projected" in plan.passes.values():
        return plan.passes_k
    return plan.k if "projected" in plan.train.values() else None


@dataclass
class CapturePlan:
    """The plan of one rank; :meth:`to_json` goes to the manifest's ``config["capture_plan"]``.

    Attributes:
        policy, budget: as given (``"auto"`` or ``"exact"``; ``budget``: bytes for this rank; ``budget_source``:
            how it was set).
        k: the projection size ``k_in = k_out`` of ``"projected"`` layers at training steps (and at checkpoint
            passes unless ``pass_k`` says otherwise).
        train, passes: layer -> representation at training steps / checkpoint passes.
        snapshots: the last ``snapshots`` checkpoint passes take a weight snapshot (-1: every pass).
        planned: bytes planned per part (metadata, snapshots, train, passes, total).
        exact_layers: layers kept exact whatever the rung (tied parameters, or exact no larger).
        degraded: what was lowered during the run (step, part, from, to), in order.
        bases: checkpoint steps whose passes' projected layers went on a curvature eigenbasis fitted there.
        pass_k: the projection size at checkpoint passes where it differs from ``k`` (0: ``k``; passes projected on
            the curvature eigenbasis may keep a larger block than the steps' seeded projections).
    """

    policy: str
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
    bases: list[int] = field(default_factory=list)
    pass_k: int = 0

    @property
    def passes_k(self) -> int:
        """The projection size of the checkpoint passes' ``"projected"`` layers."""
        return self.pass_k or self.k

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
        passes = summarize(self.passes, self.passes_k) if self.planned_passes else "none planned"
        out.append(f"  checkpoint passes: {passes}")
        if self.planned_passes and "projected" in self.passes.values():
            where = f"fitted at steps {', '.join(map(str, self.bases))}" if self.bases else "none fitted yet"
            out.append(
                "  passes' projections: the top of each layer's K-FAC eigenbasis, fitted at each checkpoint on its "
                f"first training samples (seeded where none is fitted yet; {where})"
            )
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
            elif change["to"] == "dropped":
                out.append(
                    f"  dropped at step {change['step']}: the checkpoint pass at that step, whole (not even its "
                    "metadata fitted the budget left)"
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
