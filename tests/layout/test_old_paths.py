"""Every name README, docs and examples imported from a module that has since moved still imports, with a warning.

The list is what those files named at the commit before the restructure (issue 30); each old name must
be the very object at its new home, and say where that is in a ``DeprecationWarning``.
"""

from __future__ import annotations

import importlib
import warnings

import pytest

#: (old module, name, new module)
MOVED = [
    ("metastore_plugins.core.passes", "capture_step", "metastore_plugins.core.training.passes"),
    ("metastore_plugins.core.passes", "checkpoint_pass", "metastore_plugins.core.training.passes"),
    ("metastore_plugins.core.passes", "margins_of", "metastore_plugins.core.model.losses"),
    ("metastore_plugins.core.rng", "preserved_rng", "metastore_plugins.core.model.rng"),
    ("metastore_plugins.core.options", "phase_seconds", "metastore_plugins.core.training.lines"),
    ("metastore_plugins.core.analysis.recompute", "recompute", "metastore_plugins.core.model.recompute"),
    ("metastore_plugins.core.capture.records", "dense_record", "metastore_plugins.core.records"),
    ("metastore_plugins.core.capture.records", "outer_record", "metastore_plugins.core.capture.build"),
    ("metastore_plugins.core.reports.tensorboard", "report_run", "metastore_plugins.core.training.report_pass"),
]


@pytest.mark.parametrize(("old", "name", "new"), MOVED)
def test_an_old_path_gives_the_object_at_its_new_home_and_says_where(old: str, name: str, new: str) -> None:
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=rf"{old}\.{name} moved to {new}\.{name}; the old path goes in 0\.3"):
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(new), name)


def test_from_import_of_an_old_path_works() -> None:
    with pytest.warns(DeprecationWarning, match="moved to metastore_plugins.core.training.passes.capture_step"):
        from metastore_plugins.core.passes import capture_step
    from metastore_plugins.core.training.passes import capture_step as at_home

    assert capture_step is at_home


def test_a_name_no_old_path_had_is_an_attribute_error_without_a_warning() -> None:
    module = importlib.import_module("metastore_plugins.core.rng")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
            module.no_such_name  # noqa: B018
