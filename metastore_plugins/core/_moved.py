"""Old module paths and names kept for one release: each is looked up in its new home, with a ``DeprecationWarning``."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping, Sequence

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


def renamed(module: str, old_names: Mapping[str, tuple[object, str]]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``module`` whose old names (``old_names``: each one's ``(object, why)``) give
    their object with a ``DeprecationWarning``: ``why``, then the release that drops the old name."""

    def __getattr__(name: str) -> object:
        if name not in old_names:
            raise UnknownNameError(f"module {module!r} has no attribute {name!r}")
        found, why = old_names[name]
        warnings.warn(f"{module}.{name} {why}; the old name goes in {REMOVAL}", DeprecationWarning, stacklevel=2)
        return found

    return __getattr__
