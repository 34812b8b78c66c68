"""Why something the user asked for is not in the store: errors that name the capture point or flag to pass."""

from __future__ import annotations

from collections.abc import Sequence

from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.analysis.signals import TRAINING_STEPS
from metastore_plugins.core.errors import StoreError
from metastore_plugins.core.reports import checkpoint_points


def train_points(store: GradientStore, given: Sequence[str] | None) -> list[str]:
    """``given``, else the store's ``epoch-*/train`` checkpoint passes; an error naming the damage when none is."""
    points = list(given or checkpoint_points(store, "train"))
    if not points:
        raise StoreError(
            f"the store has no checkpoint passes 'epoch-*/train'{_and(store_damage(store))}; pass --capture-point NAME "
            f"(it has {', '.join(store.capture_points()) or 'no capture point'})"
        )
    return points


def store_damage(store: GradientStore) -> str:
    """``""``, or the damage the store's opening found (journal lines it ignored): why something may be missing."""
    problems = store.open_problems
    if not problems:
        return ""
    return (
        f"the store's index is damaged: {problems[0]}"
        + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
        + f"; run `metastore verify {store.path}` to see the damage"
    )


def _and(clause: str) -> str:
    return f", and {clause}" if clause else ""


def _holders(store: GradientStore, sample_id: int) -> list[str]:
    """The capture points that hold ``sample_id``."""
    return [cp for cp in store.capture_points() if sample_id in set(store.sample_ids(cp).tolist())]


def not_stored(store: GradientStore, sample_ids: Sequence[int], where: Sequence[str], what: str) -> StoreError:
    """The error for samples missing from ``where`` (``what``: "sample 3 is"), naming the capture points that hold
    them and the ``--capture-point`` to pass."""
    holders = {cp for sid in sample_ids for cp in _holders(store, sid)}
    found = sorted(holders)
    suggested = TRAINING_STEPS if TRAINING_STEPS in holders else found[-1] if found else ""
    hint = (
        f"; stored in {', '.join(repr(cp) for cp in found)}: pass --capture-point {suggested}"
        if found
        else f"; no capture point holds it{_and(store_damage(store))}"
    )
    return StoreError(f"{what} not stored in {', '.join(map(repr, where))}{hint}")
