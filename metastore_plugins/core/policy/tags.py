"""Tags: named moments of a run (steps, step ranges, snapshots) with attributes and what to keep of them.

DataStates-style: user code (or the callbacks themselves) tags the current step or a range,
``tag("lr-drop", steps=(a, b), keep="exact", reason="plateau")``. ``keep`` raises or lowers the
representation of those steps within the budget (``"exact"``, ``"projected"``, ``"norms"``,
``"nothing"``) or asks for a weight snapshot (``"snapshot"``). Checkpoint passes are tagged
automatically (``automatic=True``) with their epoch, step, learning rate and logged metrics.

Each rank appends its tags to ``tags-rank{r}.jsonl``, one checksummed journal line each
(:func:`~metastore_plugins.core.store.journal.encode_line`), fsynced: a crash tears at most the
last line, which readers skip; a damaged line before it is an error naming the file and line.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from metastore_plugins.core.store.journal import JournalError, decode_line, encode_line
from metastore_plugins.core.store.manifest import StoreError

#: What a tag may ask to keep of its steps (``"snapshot"``: a weight snapshot).
KEEP_CHOICES = ("exact", "projected", "norms", "nothing", "snapshot")
#: Attribute values a tag holds: JSON scalars.
Scalar = str | int | float | bool | None
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_TAGS_FILE = re.compile(r"tags-rank(\d+)\.jsonl")


@dataclass(frozen=True)
class Tag:
    """One tag: ``name`` on steps ``first_step..last_step`` (inclusive), of one capture point or all."""

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


_FIELDS = {f for f in Tag.__dataclass_fields__}


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


class TagBook:
    """The tags of one rank of a store: added while training runs, appended to ``tags-rank{r}.jsonl``."""

    def __init__(self, store_dir: str | os.PathLike[str], rank: int = 0) -> None:
        self.path = Path(store_dir) / f"tags-rank{rank}.jsonl"
        self.rank = rank
        self._tags = [tag for tag in read_tags(store_dir) if tag.rank == rank]
        if self.path.exists():  # cut a line torn by a crash, so that the next one starts clean
            data = self.path.read_bytes()
            if data and not data.endswith(b"\n"):
                os.truncate(self.path, data.rfind(b"\n") + 1)

    @property
    def tags(self) -> list[Tag]:
        return list(self._tags)

    def add(
        self,
        name: str,
        *,
        steps: int | tuple[int, int] | None = None,
        keep: str | None = None,
        capture_point: str | None = None,
        current_step: int | None = None,
        automatic: bool = False,
        attributes: Mapping[str, Any] | None = None,
        **more: Any,
    ) -> Tag:
        """Tag ``steps`` (a step, an inclusive ``(first, last)`` range; default ``current_step``) and write it.

        Attributes come as keywords (``reason="plateau"``) or as an ``attributes`` mapping.

        Raises:
            ValueError: naming the argument, for a bad name, range, ``keep`` or attribute.
        """
        if not isinstance(name, str) or not name.strip() or _CONTROL.search(name):
            raise ValueError(f"tag(name=...) must be a non-empty string without control characters; got {name!r}")
        first, last = _steps(steps if steps is not None else current_step)
        if keep is not None and keep not in KEEP_CHOICES:
            raise ValueError(f"tag(keep=...) must be one of {', '.join(KEEP_CHOICES)} or None; got {keep!r}")
        attributes = {**(attributes or {}), **more}
        clash = sorted(set(attributes) & _FIELDS)
        if clash:
            raise ValueError(f"tag attributes {clash} clash with the tag's own fields; rename them")
        bad = sorted(key for key, value in attributes.items() if key not in tag_attributes({key: value}))
        if bad:
            raise ValueError(f"tag attributes {bad} must be JSON scalars (str, int, finite float, bool, None)")
        values = tag_attributes(attributes)
        tag = Tag(name, first, last, keep, capture_point, values, self.rank, len(self._tags), automatic)
        with open(self.path, "ab") as handle:
            handle.write(encode_line(asdict(tag)))
            handle.flush()
            os.fsync(handle.fileno())
        self._tags.append(tag)
        return tag

    def keep_for(self, step: int, capture_point: str) -> str | None:
        """The ``keep`` of the latest tag with one that covers ``step`` at ``capture_point``, else None."""
        for tag in reversed(self._tags):
            if tag.keep is not None and tag.keep != "snapshot" and tag.covers(step, capture_point):
                return tag.keep
        return None


def _steps(steps: Any) -> tuple[int, int]:
    if isinstance(steps, tuple) and len(steps) == 2:
        first, last = steps
    else:
        first = last = steps
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in (first, last)):
        raise ValueError(f"tag(steps=...) must be a step or a (first, last) pair of steps; got {steps!r}")
    if first < 0 or last < first:
        raise ValueError(f"tag(steps=...) must satisfy 0 <= first <= last; got {steps!r}")
    return first, last


def read_tags(store_dir: str | os.PathLike[str]) -> list[Tag]:
    """Every rank's tags, by rank then order written. A torn last line is skipped; a damaged earlier one raises."""
    directory = Path(store_dir)
    try:
        names = sorted((int(m.group(1)), m.group(0)) for n in os.listdir(directory) if (m := _TAGS_FILE.fullmatch(n)))
    except OSError:
        return []
    tags: list[Tag] = []
    for _, name in names:
        lines = (directory / name).read_bytes().split(b"\n")
        complete = lines[:-1]  # the part after the last newline is a torn line (or empty)
        for number, line in enumerate(complete, 1):
            try:
                data = decode_line(line + b"\n")
                tags.append(Tag(**{key: data[key] for key in _FIELDS}))
            except (JournalError, KeyError, TypeError, ValueError) as exc:
                raise StoreError(
                    f"{directory / name}: line {number} is damaged ({exc}); remove it to read the rest"
                ) from exc
    return tags


def find_tags(tags: list[Tag], tag: str | None = None, **attributes: Any) -> list[Tag]:
    """The tags named ``tag`` (any name when None) whose attributes include ``attributes``."""
    return [
        t
        for t in tags
        if (tag is None or t.name == tag)
        and all(key in t.attributes and t.attributes[key] == value for key, value in attributes.items())
    ]
