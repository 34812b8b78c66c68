"""The check of a capture plan as a store records it: ``config["capture_plan"]`` of each rank's manifest.

``verify`` names a plan no planner wrote (:func:`plan_problems`); reading it back as a
:class:`~metastore_plugins.core.policy.plan_record.CapturePlan` is the policy's (the store only checks the
value it keeps: the plan is made and lowered above it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from metastore_plugins.core.records import REPRESENTATIONS
from metastore_plugins.core.store.shards.manifest import in_range, manifest_name, name_problem

#: The largest projection size ``k`` a plan may record (the planner's ladder goes up to 16; a query holds
#: ``k * k`` numbers per sample and layer for it, so a damaged ``k`` of 10^6 would ask for terabytes).
MAX_PLAN_K = 256
#: The manifest config key that holds each rank's plan.
PLAN_KEY = "capture_plan"


def _string(value: Any) -> bool:
    return name_problem(value) is None


def _layer_map(value: Any) -> bool:
    return isinstance(value, dict) and all(_string(k) and v in REPRESENTATIONS for k, v in value.items())


def _change(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and in_range(value.get("step"))
        and all(_string(value.get(key)) for key in ("part", "from", "to"))
    )


#: Each field of a recorded plan: whether a value is one a planner writes (``None``: any budget is optional).
_FIELDS: dict[str, Callable[[Any], bool]] = {
    "policy": _string,
    "budget": lambda v: v is None or in_range(v, 0),
    "budget_source": _string,
    "encoding": _string,
    "k": lambda v: in_range(v, 1, MAX_PLAN_K + 1),
    "train": _layer_map,
    "passes": _layer_map,
    "snapshots": lambda v: in_range(v, -1),
    "planned_passes": lambda v: in_range(v, 0),
    "planned": lambda v: isinstance(v, dict) and all(_string(k) and in_range(n) for k, n in v.items()),
}
_OPTIONAL: dict[str, Callable[[Any], bool]] = {
    "exact_layers": lambda v: isinstance(v, list) and all(map(_string, v)),
    "degraded": lambda v: isinstance(v, list) and all(map(_change, v)),
    "bases": lambda v: isinstance(v, list) and all(in_range(step) for step in v),
    "pass_k": lambda v: in_range(v, 0, MAX_PLAN_K + 1),
}


def plan_problem(plan: Any) -> str | None:
    """Why a recorded plan is not one a planner writes (a field missing, unknown, of the wrong kind or out of
    range: ``k`` and ``pass_k`` within :data:`MAX_PLAN_K`), or ``None``. Reads nothing beyond the parsed value."""
    if not isinstance(plan, dict):
        return f"is not an object (a {type(plan).__name__})"
    unknown = [key for key in plan if key not in _FIELDS and key not in _OPTIONAL]
    if unknown:
        return f"holds the unknown field {ascii(unknown[0])[:80]}"
    for key, good in (*_FIELDS.items(), *_OPTIONAL.items()):
        if key not in plan and key in _FIELDS:
            return f"lacks the field {key!r}"
        if key in plan and not good(plan[key]):
            return f"field {key!r} is not one a planner writes: {ascii(plan[key])[:80]}"
    return None


def plan_problems(manifests: Sequence[dict[str, Any]]) -> list[str]:
    """One line per rank manifest whose recorded plan is damaged (what ``verify`` lists)."""
    lines = []
    for manifest in manifests:
        plan = manifest.get("config", {}).get(PLAN_KEY)
        problem = None if not plan else plan_problem(plan)
        if problem is not None:
            lines.append(
                f"{manifest_name(manifest['rank'])}: config[{PLAN_KEY!r}] {problem}; the reports cannot use it "
                "(the store's shards are unaffected)"
            )
    return lines
