"""The text of the settings both callbacks take, put into each callback's docstring.

:data:`SETTINGS_DOC` is derived from :data:`~metastore_plugins.core.training.settings.SETTINGS` (each setting's
``doc``); :func:`with_settings_doc` puts it where a callback's docstring says ``{settings}``.
"""

from __future__ import annotations

import textwrap

from metastore_plugins.core.training.settings import SETTINGS

#: The ``Args:`` text of the settings, which each callback's docstring includes at ``{settings}``.
SETTINGS_DOC = "\n".join(
    textwrap.fill(f"{row.name}: {row.doc}", width=100, subsequent_indent="    ", break_on_hyphens=False)
    for row in SETTINGS
)


def with_settings_doc(cls: type) -> type:
    """Put :data:`SETTINGS_DOC` into ``cls.__doc__`` where it says ``{settings}`` (indented to match)."""
    doc = cls.__doc__ or ""
    line = next(line for line in doc.splitlines() if "{settings}" in line)
    indent = line[: len(line) - len(line.lstrip())]
    cls.__doc__ = doc.replace(line, "\n".join(indent + row if row else row for row in SETTINGS_DOC.splitlines()))
    return cls
