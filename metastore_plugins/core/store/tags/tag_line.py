"""A tag and its journal line: :class:`Tag`'s fields, the values its attributes hold (:func:`tag_attributes`), and a
decoded line checked into a :class:`Tag` (:func:`tag_of`), which every read of a tags file goes through."""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from metastore_plugins.core.errors import JournalError
from metastore_plugins.core.records import KEEP_CHOICES

#: Attribute values a tag holds: JSON scalars.
Scalar = str | int | float | bool | None


@dataclass(frozen=True)
class Tag:
    """One tag: ``name`` on steps ``first_step..last_step`` (inclusive), of one capture point or all (None)."""

    name: str
    first_step: int
    last_step: int
    keep: str | None = None
    capture_point: str | None = None
    attributes: dict[str, Scalar] = field(default_factory=dict)
    rank: int = 0
    seq: int = 0
    automatic: bool = False

    def covers(self, step: int, capture_point: str) -> bool:
        return self.first_step <= step <= self.last_step and self.capture_point in (None, capture_point)


#: Tag's fields in order: a decoded line's keys, and what a tag's attributes may not be named
FIELDS = tuple(Tag.__dataclass_fields__)
_VALUES = operator.itemgetter(*FIELDS)  # a decoded line's fields in Tag's order


def tag_attributes(values: Mapping[str, Any]) -> dict[str, Scalar]:
    """The JSON-scalar entries of ``values`` (finite floats, ints, strings, bools, None): what a tag can hold."""
    out: dict[str, Scalar] = {}
    for key, value in values.items():
        if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
            value = value.item()  # numpy / torch scalars
        if isinstance(value, float) and not math.isfinite(value):
            continue
        if isinstance(value, (str, int, float, bool)) or value is None:
            out[str(key)] = value
    return out


def tag_of(data: dict[str, Any]) -> Tag:
    """The :class:`Tag` of a decoded line; :class:`JournalError` naming the field that is missing or wrong."""
    try:
        name, first, last, keep, point, attributes, rank, seq, automatic = _VALUES(data)
    except KeyError:
        raise JournalError(f"fields {[key for key in FIELDS if key not in data]} are missing") from None
    if (  # the common case first, in one expression; the field named below only when something is wrong
        type(name) is str
        and type(first) is type(last) is type(rank) is type(seq) is int
        and 0 <= first <= last
        and (keep is None or (type(keep) is str and keep in KEEP_CHOICES))
        and (point is None or type(point) is str)
        and type(attributes) is dict
        and _scalars(attributes.values())
        and type(automatic) is bool
    ):
        tag = object.__new__(Tag)  # Tag's fields set at once (its frozen __init__ sets them one by one, 1 us)
        tag.__dict__.update(zip(FIELDS, (name, first, last, keep, point, attributes, rank, seq, automatic)))
        return tag
    checks = (
        ("name", type(name) is str),
        (
            "first_step/last_step/rank/seq",
            type(first) is type(last) is type(rank) is type(seq) is int and 0 <= first <= last,
        ),
        ("keep", keep is None or (type(keep) is str and keep in KEEP_CHOICES)),
        ("capture_point", point is None or type(point) is str),
        ("attributes", type(attributes) is dict and all(map(_scalar, attributes.values()))),
        ("automatic", type(automatic) is bool),
    )
    raise JournalError(f"field(s) {', '.join(key for key, ok in checks if not ok)} hold values a tag cannot have")


_PLAIN = frozenset({str, int, bool, type(None)})


def _scalars(values: Any) -> bool:
    """Whether every decoded JSON value of ``values`` is one a tag attribute holds (:func:`_scalar`), by type."""
    values = list(values)
    kinds = set(map(type, values))
    if kinds <= _PLAIN:
        return True
    return kinds <= _PLAIN | {float} and all(math.isfinite(v) for v in values if type(v) is float)


def _scalar(value: Any) -> bool:
    """Whether a decoded JSON value is one a tag attribute holds (keys of JSON objects are always strings)."""
    kind = type(value)
    return value is None or kind is str or kind is int or kind is bool or (kind is float and math.isfinite(value))
