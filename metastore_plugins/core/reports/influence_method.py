"""What the influence report says of its scores: the method and damping that produced them, and how exact they are.

Each influence row carries ``method``, ``damping`` (absolute, or None), ``relative_damping`` (a fraction of
the mean eigenvalue, or None) and, where ``"auto"`` could not precondition the passes, ``method_note``
(why it fell back to TracIn); :func:`influence_caption` turns them and the rows' ``exact`` flags into the
lines under the markdown table, in the words of the method's entry (:class:`~.method_table.MethodWords`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from metastore_plugins.core.analysis.method_table import TRACIN, Method
from metastore_plugins.core.analysis.methods import METHODS, ResolvedMethod, left_out_words


def method_label(name: str) -> str:
    """How the reports name method ``name`` (``"EK-FAC"``): its entry's label, else the name itself."""
    entry = METHODS.get(name)
    return name if entry is None else entry.label


def method_fields(chosen: ResolvedMethod, damping: float | None, relative_damping: float | None) -> dict[str, Any]:
    """The row fields that say what produced the scores: the damping the method ran with (defaults filled in)."""
    ran_with, relative = chosen.entry.ran_with(damping, relative_damping)
    fields: dict[str, Any] = {"method": chosen.method, "damping": ran_with, "relative_damping": relative}
    left_out = {"method_layers": left_out_words(chosen.left_out)} if chosen.left_out else {}
    return {**fields, **({"method_note": chosen.fallback} if chosen.fallback else {}), **left_out}


def method_line(row: dict[str, Any]) -> str:
    """``Method: EK-FAC, damping 0.1 x each layer's mean eigenvalue`` (and why ``auto`` fell back, if it did)."""
    method = row.get("method", TRACIN)
    entry: Method | None = METHODS.get(method)
    words = f"Method: {method_label(method)}{'' if entry is None else entry.words.formula}"
    if row.get("damping") is not None:
        words += f", damping {row['damping']:g} (absolute, every layer)"
    elif row.get("relative_damping") is not None and entry is not None:
        words += entry.words.ridge.format(row["relative_damping"])
    note, layers = row.get("method_note"), row.get("method_layers")
    words += f", over {layers}" if layers else ""
    return words + (f"; auto chose it because K-FAC cannot precondition {note}" if note else "") + "."


def exactness_line(rows: Sequence[dict[str, Any]]) -> str:
    """Whether the rows' scores are exact or estimates, in the words of their method."""
    entry = METHODS.get(rows[0].get("method", TRACIN), METHODS[TRACIN])
    return entry.exactness(all(row.get("exact", True) for row in rows))


def influence_caption(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The lines under the influence table: the method and damping, whether the scores are exact, and (the default
    answer) where the training samples came from."""
    if not rows:
        return []
    side = rows[0].get("train_side")
    where = [f"Training samples: every one the {side} hold (in-run influence of each step)."] if side else []
    return [method_line(rows[0]), exactness_line(rows), *where]
