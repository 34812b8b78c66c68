"""Every name README, docs and examples imported from a module that has since moved still imports, with a warning.

The list is what those files named at the commit before the restructure (issue 30); each old name must
be the very object at its new home, and say where that is in a ``DeprecationWarning``.
"""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path

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
    # issue 48: the capture plan's record went to the policy, the check verify runs to the store's reading room
    ("metastore_plugins.core.store.plan_record", "CapturePlan", "metastore_plugins.core.policy.plan_record"),
    ("metastore_plugins.core.store.plan_record", "in_words", "metastore_plugins.core.policy.plan_record"),
    ("metastore_plugins.core.store.plan_record", "plan_problem", "metastore_plugins.core.store.reading.plan_check"),
    ("metastore_plugins.core.store.plan_record", "plan_problems", "metastore_plugins.core.store.reading.plan_check"),
]

STORE = "metastore_plugins.core.store"
#: core/store/'s flat modules (issue 48) -> their homes in its rooms
STORE_ROOMS = {
    **{name: f"shards.{name}" for name in ("encoding", "shard_header", "shardread", "shardfile", "record_check")},
    **{name: f"shards.{name}" for name in ("shardinfo", "manifest", "journal", "journal_batch", "entries", "index")},
    "index_writer": "shards.index_writer",
    **{name: f"writing.{name}" for name in ("writer", "writer_batches", "writer_life", "run_log")},
    **{name: f"reading.{name}" for name in ("reader", "selection", "batches", "readcache", "runs", "health")},
    "disk_usage": "reading.disk_usage",
    **{name: f"vectors.{name}" for name in ("vector_files", "vector_maps", "vector_check", "sketch_cache")},
    "snapshots": "snapshots.weights",
    "snapshot_check": "snapshots.snapshot_check",
    "snapshot_delta": "snapshots.snapshot_delta",
    "tags": "tags.book",
    "tag_cache": "tags.tag_cache",
    "maintenance": "maintenance.compaction",
    "repair": "maintenance.repair",
}


@pytest.mark.parametrize(("old", "name", "new"), MOVED)
def test_an_old_path_gives_the_object_at_its_new_home_and_says_where(old: str, name: str, new: str) -> None:
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=rf"{old}\.{name} moved to {new}\.{name}; the old path goes in 0\.3"):
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(new), name)


@pytest.mark.parametrize(("old", "new"), sorted(STORE_ROOMS.items()))
def test_a_flat_store_path_gives_every_name_its_room_module_defines(old: str, new: str) -> None:
    module, home = importlib.import_module(f"{STORE}.{old}"), importlib.import_module(f"{STORE}.{new}")
    defined = [
        name
        for name, value in vars(home).items()
        if getattr(value, "__module__", None) == home.__name__ and not isinstance(value, type(importlib))
    ]
    assert defined, home.__name__
    for name in defined:
        with pytest.warns(DeprecationWarning, match=rf"{STORE}\.{old}\.{name} moved to {home.__name__}\.{name};"):
            value = getattr(module, name)
        assert value is getattr(home, name)


def test_the_flat_store_paths_are_every_module_that_moved() -> None:
    flat = {path.stem for path in Path(importlib.import_module(STORE).__file__).parent.glob("*.py")}
    rooms = {path.parent.name for path in Path(importlib.import_module(STORE).__file__).parent.glob("*/__init__.py")}
    kept = {"__init__", "files", "file_kinds", "writable", "plan_record"}
    assert flat | (rooms & set(STORE_ROOMS)) == set(STORE_ROOMS) | kept


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
