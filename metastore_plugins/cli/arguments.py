"""The argument types of the ``metastore`` subcommands: each turns a bad value into one argparse error line."""

from __future__ import annotations

import argparse


def int64(text: str) -> int:
    """A sample id or step: a whole number from 0 to 2^63-1 (what the store's int64 columns hold)."""
    value = whole(text, 0)
    if value >= 2**63:
        raise argparse.ArgumentTypeError(f"expected a whole number from 0 to 2^63-1, got {text!r}")
    return value


def sample_ids(text: str) -> list[int]:
    """``3,17,42`` as ``[3, 17, 42]`` (``--test``)."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated sample ids such as 3,17,42; got {text!r}") from None


def layer_names(text: str) -> list[str]:
    """``bert.encoder.layer.0.output.dense,classifier`` as a list of layer names (``--layers``)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated layer names (metastore inspect lists them); got {text!r}"
        )
    return names


def whole(text: str, least: int) -> int:
    """A whole number ``>= least``; anything else is an argparse error."""
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {least}, got {text!r}")
    return value


def positive(text: str) -> int:
    """A whole number ``>= 1`` (``-k``, ``--target-mb``)."""
    return whole(text, 1)


def positive_float(text: str) -> float:
    """A finite number ``> 0`` (``--damping``, ``--relative-damping``)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def non_negative(text: str) -> int:
    """A whole number ``>= 0`` (``--before``)."""
    return whole(text, 0)


def step_range(text: str) -> int | tuple[int, int]:
    """``N`` or ``LO:HI`` (inclusive), as ``--steps`` takes them; anything else is an argparse error."""
    parts = text.split(":")
    try:
        values = [int(part) for part in parts]
    except ValueError:
        values = []
    if len(values) == 1:
        return values[0]
    if len(values) == 2 and values[0] <= values[1]:
        return values[0], values[1]
    raise argparse.ArgumentTypeError(f"expected a step N or an inclusive range LO:HI with LO <= HI, got {text!r}")
