"""What the ``metastore`` command prints: stored strings escaped for the terminal, results as text or ``--json``."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any


def printable(text: object) -> str:
    """``str(text)`` with every character that is not printable escaped (``\\x1b``, ``\\u202e``, ``\\u200d``):
    C0/C1 controls, DEL, bidirectional overrides, zero-width and other format characters, line and paragraph
    separators, unassigned and private code points (``str.isprintable``; the space stays), so stored strings
    print as data."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c == " " or c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def plain(value: Any) -> Any:
    """Dataclasses and named tuples as dicts (recursively), tuples as lists: ready for JSON and tables."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple) and hasattr(value, "_asdict"):
        return {k: plain(v) for k, v in value._asdict().items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return value.tolist() if hasattr(value, "tolist") else value


def _json_default(value: Any) -> Any:
    """What ``json`` cannot write itself: arrays as lists, anything else as its ``str``."""
    return value.tolist() if hasattr(value, "tolist") else str(value)


def emit(args: argparse.Namespace, data: Any, text: str) -> None:
    """Print ``data`` as JSON under ``--json``, else ``text`` with stored strings escaped (one newline at the end)."""
    text = "\n".join(map(printable, text.split("\n")))  # stored names reach the terminal as data
    print(
        json.dumps(data, indent=1, default=_json_default) if args.json else text,
        end="" if text.endswith("\n") else "\n",
    )
