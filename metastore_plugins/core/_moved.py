"""Old module paths kept for one release: each name is looked up in its new home, with a ``DeprecationWarning``."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Sequence

from metastore_plugins.core.errors import UnknownNameError

#: The release that drops the old paths (CHANGELOG.md lists them).
REMOVAL = "0.3"


def moved_module(old: str, homes: Sequence[str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for the old path ``old`` whose names now live in ``homes`` (searched in order)."""

    def __getattr__(name: str) -> object:
        for home in homes:
            module = importlib.import_module(home)
            if hasattr(module, name):
                warnings.warn(
                    f"{old}.{name} moved to {home}.{name}; the old path goes in {REMOVAL}",
                    DeprecationWarning,
                    stacklevel=2,
                )
                return getattr(module, name)
        raise UnknownNameError(f"module {old!r} has no attribute {name!r}")

    return __getattr__
