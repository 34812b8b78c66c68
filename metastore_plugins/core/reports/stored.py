"""What a store holds to report on, and what its byte budget dropped.

Under a small budget the capture plan keeps some capture points as metadata only (ids, labels,
losses, predictions, margins: no gradient records), some as exact norms only (self-influence, no
inner products), and may stop storing a part altogether. The reports use what was stored: AUM and
losses need the metadata alone, self-influence any gradient record, influence and sketches inner
products. :func:`budget_notes` says, in words, what the budget took away.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.analysis.signals import TRAINING_STEPS
from metastore_plugins.core.errors import QueryError
from metastore_plugins.core.policy.plan_record import CapturePlan, in_words, readable_plan
from metastore_plugins.core.reports.tables import Scores, has_margins, self_influence_of
from metastore_plugins.core.store.reading.disk_usage import disk_usage

#: Record kinds that give inner products between samples (``"norms"`` records hold a squared norm alone).
INNER_PRODUCT_KINDS = frozenset({"outer", "embedding", "dense", "projected"})


def stored_kinds(store: GradientStore, capture_point: str) -> set[str]:
    """The record kinds the batches of ``capture_point`` hold (empty: metadata only, or an unknown point)."""
    if capture_point not in store.capture_points():
        return set()
    return {record["kind"] for ref in store.batch_refs(capture_point) for record in ref.info["records"]}


def default_test_points(store: GradientStore, points: Sequence[str]) -> list[str]:
    """The test side of the default answer: ``points`` with inner products, in step order, where the training steps
    hold inner products too; none otherwise (the passes' table then)."""
    if TRAINING_STEPS not in store.capture_points() or not with_gradients(store, [TRAINING_STEPS], inner=True):
        return []
    return sorted(with_gradients(store, points, inner=True), key=lambda point: store.steps(point)[0])


def with_gradients(store: GradientStore, points: Sequence[str], *, inner: bool = False) -> list[str]:
    """The capture points of ``points`` that hold per-sample gradient records (their norms at least);
    ``inner``: records with inner products between samples in every stored layer (influence, sketches)."""
    found = []
    for point in points:
        kinds = stored_kinds(store, point)
        if kinds and inner:  # every batch with records (none kept as metadata only), each with inner products
            kinds = kinds if all(ref.info["records"] for ref in store.batch_refs(point)) else set()
        if kinds and (not inner or kinds <= INNER_PRODUCT_KINDS):
            found.append(point)
    return found


def paired_passes(store: GradientStore, train: Sequence[str], test_split: str) -> list[tuple[str, str]]:
    """``(train point, test point)`` of the checkpoint passes of ``train`` whose ``test_split`` side is stored too,
    both with inner products (:func:`with_gradients`): a pass the budget dropped or lowered is left out."""
    pairs = [(a, f"{a.split('/')[0]}/{test_split}") for a in train]
    return [(a, b) for a, b in pairs if len(with_gradients(store, (a, b), inner=True)) == 2]


def stored_self_influence(store: GradientStore, points: Sequence[str]) -> Scores:
    """``(sample ids, TracIn self-influence)`` over the points of ``points`` that hold gradients (both empty
    when none does)."""
    held = with_gradients(store, points)
    if not held:
        return np.zeros(0, np.int64), np.zeros(0)
    return self_influence_of(store, held)


def outlier_ranking(store: GradientStore, points: Sequence[str], rank_by: str) -> str:
    """``rank_by``, or what ``"auto"`` falls back to where ``points`` hold no gradients: AUM where the training
    steps hold margins, else the loss. ``"self_influence"`` there raises, saying why (the budget, if it was)."""
    if with_gradients(store, points):
        return rank_by
    if rank_by == "self_influence":
        why = dropped_message(store) or "they hold metadata only"
        raise QueryError(f"self-influence needs gradients of the checkpoint passes and the store holds none: {why}")
    return ("aum" if has_margins(store) else "loss") if rank_by == "auto" else rank_by


def budget_notes(store: GradientStore) -> list[str]:
    """What the store's capture plan left out or dropped (from ``config["capture_plan"]``), in words; empty
    when the plan kept gradients of every part it planned and nothing was degraded, or when the plan cannot
    be read (``metastore inspect`` names that damage)."""
    plan = readable_plan(store.path, store.manifests)
    return [] if plan is None else _notes(plan)


def _notes(plan: CapturePlan) -> list[str]:
    budget = "no budget" if plan.budget is None else f"the budget of {plan.budget:,} bytes"
    notes = []
    for part, layers in (("training steps", plan.train), ("checkpoint passes", plan.passes)):
        kept = set(layers.values())
        if kept == {"nothing"}:
            notes.append(f"{budget} kept the {part} as metadata only (no gradients)")
        elif kept == {"norms"}:
            notes.append(f"{budget} kept the {part} as exact norms only (no inner products between samples)")
    for change in plan.degraded:
        part, step = str(change["part"]), int(change["step"])
        verb = "was" if part.startswith("the last") else "were"
        if change["to"] == "skipped":
            notes.append(f"the weight snapshot of the checkpoint pass at step {step} was skipped ({budget} was spent)")
        elif change["to"] == "dropped":
            notes.append(f"the checkpoint pass at step {step} was not stored at all ({budget} was spent)")
        elif change["to"] == "not stored":
            notes.append(f"{part} {verb} no longer stored from step {step} on ({budget} was spent)")
        else:
            notes.append(
                f"{part} {verb} kept as {in_words(str(change['to']))} from step {step} on ({budget} was outgrown)"
            )
    return notes


def budget_caption(store: GradientStore, caption: Sequence[str], self_influence: int) -> list[str]:
    """An outlier table's caption with what the budget dropped: its self-influence line says it is blank when
    no self-influence was computed (``self_influence``: how many samples have one), and a ``Budget:`` line per
    :func:`budget_notes`."""
    blank = "self_influence: blank: the checkpoint passes hold no gradients"
    lines = [blank if not self_influence and line.startswith("self_influence:") else line for line in caption]
    return [*lines, *(f"Budget: {note}." for note in budget_notes(store))]


def dropped_message(store: GradientStore) -> str:
    """:func:`budget_notes` in one clause with the way out, or ``""`` when the budget dropped nothing."""
    notes = budget_notes(store)
    if not notes:
        return ""
    return f"{'; '.join(notes)} (give the run a larger budget=; `metastore inspect` shows the plan)"


def keep_within_budget(store: GradientStore, files: Sequence[str]) -> list[str]:
    """``files`` (the reports just written) less the figures (PNG) removed, largest first, while the store
    directory is larger than its budget (each rank's plan budget times the world size; none: nothing removed).

    The tables are never removed: the plan reserves room for them (``files``); figures can outgrow that reserve
    (a data map, thumbnail grids of image samples), and the budget covers every file of the store. A warning
    names what was left out (TensorBoard, where the trainer logs to it, has every figure).
    """
    plan = readable_plan(store.path, store.manifests)  # a damaged plan: no budget (verify names the damage)
    budget = None if plan is None else plan.budget
    world = store.config.get("world_size", 1)
    if budget is None or not isinstance(world, int) or isinstance(world, bool) or world < 1:
        return list(files)
    limit, size = budget * world, sum(disk_usage(Path(store.path), ()).values())
    figures = sorted(
        (p for p in map(Path, files) if p.suffix == ".png" and p.exists()), key=lambda p: -p.stat().st_size
    )
    dropped: list[Path] = []
    for figure in figures:
        if size <= limit:
            break
        size -= figure.stat().st_size
        figure.unlink()
        dropped.append(figure)
    if dropped:
        names = ", ".join(p.name for p in dropped)
        warnings.warn(
            f"the report figure(s) {names} are not kept in the store {store.path}: its budget of {limit:,} bytes "
            "leaves no room for them (TensorBoard has them where the trainer logs to it); give a larger budget= "
            "to keep them",
            stacklevel=2,
        )
    gone = {str(p) for p in dropped}
    return [f for f in files if f not in gone]
