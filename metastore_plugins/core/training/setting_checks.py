"""The checks of the callbacks' settings, one per kind of value: each takes ``(owner, setting, value)`` and returns
the value to keep (normalised where the check says so), or raises naming ``owner(setting=...)``.

:class:`~metastore_plugins.core.training.settings.CallbackOptions` names one of them beside each setting.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from metastore_plugins.core.errors import ConfigError
from metastore_plugins.core.policy.budget import parse_budget

#: ``check(owner, setting, value) -> the value kept``.
Check = Callable[[str, str, Any], Any]


def refuse(owner: str, setting: str, must: str, value: Any) -> ConfigError:
    """The error of a setting whose value is wrong: ``owner(setting=...) must ...; got value``."""
    return ConfigError(f"{owner}({setting}=...) must {must}; got {value!r}")


def one_of(choices: Sequence[str]) -> Check:
    """A check that the value is one of ``choices``."""

    def check(owner: str, setting: str, value: Any) -> Any:
        if value not in choices:
            raise refuse(owner, setting, f"be one of {', '.join(choices)}", value)
        return value

    return check


def whole(least: int | None) -> Check:
    """A check that the value is an integer ``>= least`` (any integer with ``least`` None), kept as an ``int``."""

    def check(owner: str, setting: str, value: Any) -> int:
        return whole_number(owner, setting, value, least)

    return check


def whole_number(owner: str, setting: str, value: Any, least: int | None) -> int:
    """``value`` as an int, or the error naming ``owner(setting=...)`` when it is no integer ``>= least``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or (least is not None and value < least):
        raise refuse(owner, setting, "be an integer" + (f" >= {least}" if least is not None else ""), value)
    return int(value)


def flag(owner: str, setting: str, value: Any) -> bool:
    """A check that the value is ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise refuse(owner, setting, "be True or False", value)
    return value


def sample_function(owner: str, setting: str, value: Any) -> Any:
    """A check that the value is ``None`` or a function of ``(split, sample id)``."""
    if value is not None and not callable(value):
        raise refuse(owner, setting, "be a function (split, sample id) -> text or image", value)
    return value


def seconds(owner: str, setting: str, value: Any) -> Any:
    """A check that the value is a positive, finite number of seconds, or ``None``."""
    wrong = isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf")
    if value is not None and wrong:
        raise refuse(owner, setting, "be a positive number of seconds, or None to write only full shards", value)
    return value


def module_paths(owner: str, setting: str, value: Any) -> tuple[str, ...] | None:
    """A check that the value is ``None`` or a list of module paths (not one path), kept as a tuple."""
    if isinstance(value, str):
        raise ConfigError(f"{owner}({setting}=...) takes a list of module paths; write [{value!r}]")
    return None if value is None else tuple(value)


def byte_size(owner: str, setting: str, value: Any) -> int | None:
    """A check that the value is ``None`` or a size in bytes (``250_000_000``, ``"250MB"``, ``"4GiB"``), kept as
    an ``int`` (:func:`~metastore_plugins.core.policy.budget.parse_budget`)."""
    return parse_budget(value, owner)


def share(owner: str, setting: str, value: Any) -> float | None:
    """A check that the value is ``None`` or a positive, finite share (``0.25``: a quarter)."""
    wrong = isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf")
    if value is not None and wrong:
        raise refuse(
            owner, setting, "be a positive share of the training (0.25: a quarter), or None for no limit", value
        )
    return None if value is None else float(value)
