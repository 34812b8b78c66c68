"""What the influence report says of its scores: the method and damping that produced them, and how exact they are.

Each influence row carries ``method``, ``damping`` (absolute, or None), ``relative_damping`` (a fraction of
the mean eigenvalue, or None) and, where ``"auto"`` could not precondition the passes, ``method_note``
(why it fell back to TracIn); :func:`influence_caption` turns them and the rows' ``exact`` flags into the
lines under the markdown table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from metastore_plugins.core.analysis.methods import ResolvedMethod, left_out_words
from metastore_plugins.core.analysis.sketches import DEFAULT_REGULARIZATION
from metastore_plugins.core.ops.curvature import CURVATURE_METHODS, DEFAULT_RELATIVE_DAMPING

#: how each method is named in the caption
METHOD_NAMES = {"tracin": "TracIn", "kfac": "K-FAC", "ekfac": "EK-FAC", "trak": "TRAK"}


def method_fields(chosen: ResolvedMethod, damping: float | None, relative_damping: float | None) -> dict[str, Any]:
    """The row fields that say what produced the scores: the damping the method ran with (defaults filled in)."""
    method = chosen.method
    if method in CURVATURE_METHODS:
        relative = None if damping is not None else (relative_damping or DEFAULT_RELATIVE_DAMPING)
        fields: dict[str, Any] = {"method": method, "damping": damping, "relative_damping": relative}
    elif method == "trak":
        fields = {"method": method, "damping": None, "relative_damping": relative_damping or DEFAULT_REGULARIZATION}
    else:
        fields = {"method": method, "damping": None, "relative_damping": None}
    left_out = {"method_layers": left_out_words(chosen.left_out)} if chosen.left_out else {}
    return {**fields, **({"method_note": chosen.fallback} if chosen.fallback else {}), **left_out}


def method_line(row: dict[str, Any]) -> str:
    """``Method: EK-FAC, damping 0.1 x each layer's mean eigenvalue`` (and why ``auto`` fell back, if it did)."""
    method = row.get("method", "tracin")
    words = f"Method: {METHOD_NAMES.get(method, method)}"
    if method in CURVATURE_METHODS:
        words += (
            f", damping {row['damping']:g} (absolute, every layer)"
            if row.get("damping") is not None
            else f", damping {row['relative_damping']:g} x each layer's mean curvature eigenvalue"
        )
    elif method == "trak":
        words += f" (kernel inverse on Kronecker sketches), ridge {row['relative_damping']:g} x its mean eigenvalue"
    else:
        words += " (sum over passes of lr x gradient inner products)"
    note, layers = row.get("method_note"), row.get("method_layers")
    words += f", over {layers}" if layers else ""
    return words + (f"; auto chose it because K-FAC cannot precondition {note}" if note else "") + "."


def exactness_line(rows: Sequence[dict[str, Any]]) -> str:
    """Whether the rows' scores are exact or estimates, in the words of their method."""
    method = rows[0].get("method", "tracin")
    exact = all(row.get("exact", True) for row in rows)
    not_refined = "the exact refinement (recompute) recomputes TracIn and is not applied to them"
    if method == "trak":
        return f"Scores are estimates (random Kronecker sketches); {not_refined}."
    if method in CURVATURE_METHODS:
        if exact:
            return (
                "Scores are exact given the fitted curvature (the passes hold exact factors; K-FAC / EK-FAC "
                "approximate the Fisher, which stands in for the Hessian)."
            )
        return f"Scores are estimates from projected gradients; {not_refined}."
    if exact:
        return "Scores are exact TracIn scores."
    return (
        "Scores are estimates from projected gradients (the capture policy); rows recomputed exactly say so "
        "in influence.json (`exact`)."
    )


def influence_caption(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The lines under the influence table: the method and damping, then whether the scores are exact."""
    return [method_line(rows[0]), exactness_line(rows)] if rows else []
