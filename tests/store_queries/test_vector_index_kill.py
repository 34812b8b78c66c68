"""A process building the nearest-gradient index, killed with SIGKILL in the middle of writing one of its files.

The worker (a subprocess) builds the index with ``vector_files.write`` wrapped: the ``n``-th file it writes
gets half its bytes into the build's temporary, fsynced, and then the process SIGKILLs itself: a
deterministic point in the middle of a build (a part, or the manifest after every part). Afterwards
``verify`` names only index files (never a shard), the next query answers as the exhaustive scan does
(``k=None``: every training row scored) and says anything damaged in one line, and nothing is left that
``verify`` would flag. ``verify --repair`` instead of the query leaves the same.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from test_vector_index import TEST, TRAIN, K, assert_same_top, base, damage, make_model, store, write_pass

from metastore_plugins import open_store
from metastore_plugins.cli import main
from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.analysis import vector_index as vi
from metastore_plugins.core.store.file_kinds import temporary_target
from metastore_plugins.core.store.vectors import vector_files

__all__ = ["base", "store"]  # the fixtures: a copy of a module-scoped store per test

pytestmark = [pytest.mark.slow, pytest.mark.kill]  # one build in a subprocess per case, killed with SIGKILL

FOLDER = vector_files.FOLDER

WORKER = """
import os, signal, sys
from pathlib import Path
from metastore_plugins import open_store
from metastore_plugins.core.store.vectors import vector_files
from metastore_plugins.core.store.files import StoreDir

store_dir, kill_at, calls = Path(sys.argv[1]), int(sys.argv[2]), []
original = vector_files.write


def write(path, name, data):
    calls.append(name)
    if len(calls) < kill_at:
        return original(path, name, data)

    def torn(handle):
        handle.write(data[: len(data) // 2])
        handle.flush()
        os.fsync(handle.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    with StoreDir(path) as store, store.subdir(vector_files.FOLDER, create=True) as folder:
        folder.atomic_write(name, torn)


vector_files.write = write
open_store(store_dir).build_vector_index(sys.argv[3])
sys.exit(3)  # the build wrote fewer files than kill_at
"""


def build_and_kill(store_dir: Path, kill_at: int, tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    proc = subprocess.run(
        [sys.executable, str(worker), str(store_dir), str(kill_at), TRAIN], capture_output=True, timeout=300
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-3000:]


def temporaries(store_dir: Path) -> list[str]:
    folder = store_dir / FOLDER
    return [p.name for p in folder.iterdir() if temporary_target(p.name) is not None] if folder.is_dir() else []


def query(store: GradientStore, index: bool | None) -> object:
    """``influence(k=K)``: what it says must be one line each (a rebuilt file), never an error."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scores = store.influence(TRAIN, TEST, k=K, index=index)
    assert all(issubclass(w.category, UserWarning) and "\n" not in str(w.message) for w in caught), caught
    return scores


def parts(store: GradientStore) -> int:
    return len({ref.file.name for ref in store.batch_refs(TRAIN)})


@pytest.mark.parametrize("when", ["first part", "middle part", "manifest"])
@pytest.mark.parametrize("then", ["query", "repair"])
def test_a_fresh_build_killed_mid_write(store: GradientStore, tmp_path: Path, when: str, then: str) -> None:
    """No index before: the kill leaves a torn temporary (and the parts written before it, listed by no
    manifest); ``auto`` then scans every row, ``build`` builds the index whole."""
    n = parts(store)
    assert n >= 3
    build_and_kill(store.path, {"first part": 1, "middle part": n // 2 + 1, "manifest": n + 1}[when], tmp_path)
    assert len(temporaries(store.path)) == 1  # killed in the middle of writing a file
    exhaustive = store.influence(TRAIN, TEST)
    problems = open_store(store.path).verify()
    assert problems and all(p.startswith(f"{FOLDER}/") and "\n" not in p for p in problems)  # never a shard
    if then == "repair":
        assert main(["verify", str(store.path), "--repair"]) == 0
    assert vi.open_index(open_store(store.path), TRAIN, build=False) is None  # no manifest: `auto` scans every row
    assert_same_top(query(open_store(store.path), None), exhaustive)
    assert_same_top(query(open_store(store.path), True), exhaustive)
    assert temporaries(store.path) == [] and open_store(store.path).verify() == []
    kept = vi.open_index(open_store(store.path), TRAIN, build=False)
    assert kept is not None and kept.rebuilt == [] and len(kept.sample_ids) == 360
    assert_same_top(query(open_store(store.path), None), exhaustive)  # now through the kept index


@pytest.mark.parametrize("when", ["first write", "manifest"])
@pytest.mark.parametrize("then", ["query", "repair"])
def test_an_update_killed_mid_write(store: GradientStore, tmp_path: Path, when: str, then: str) -> None:
    """A kept index, one of its parts damaged, the store grown by a shard: the build that rewrites the damaged
    part, writes the new one and then the manifest is killed; the kept (old) manifest must never give the
    top-k of the rows it lists while a new shard's rows or a torn part are left out."""
    store.build_vector_index(TRAIN)
    damage(sorted((store.path / FOLDER).glob("part-*"))[1])
    model, x, y = make_model()
    write_pass(store.path, model, x, y, TRAIN, torch.arange(400, 440))
    grown = open_store(store.path)
    build_and_kill(store.path, {"first write": 1, "manifest": 3}[when], tmp_path)
    assert len(temporaries(store.path)) == 1
    exhaustive = grown.influence(TRAIN, TEST)
    problems = open_store(store.path).verify()
    assert problems and all(p.startswith(f"{FOLDER}/") and "\n" not in p for p in problems)
    if then == "repair":
        assert main(["verify", str(store.path), "--repair"]) == 0
        assert open_store(store.path).verify() == []
    assert len(list((store.path / FOLDER).glob("manifest-*.json"))) == 1  # the kept (old) manifest
    assert_same_top(query(open_store(store.path), None), exhaustive)  # its missing, torn or new parts rebuilt
    assert temporaries(store.path) == [] and open_store(store.path).verify() == []
    again = open_store(store.path)
    opened = again.build_vector_index(TRAIN)
    assert opened.rebuilt == [] and len(opened.sample_ids) == 400
    np.testing.assert_array_equal(opened.sample_ids, again.sample_ids(TRAIN))
    assert_same_top(query(again, True), exhaustive)
