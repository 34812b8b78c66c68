"""SIGKILL in the middle of an index file write, at the two moments test_vector_index_kill.py does not reach.

1. **The write side**: the part builder's process killed while it writes a part or a manifest (its ``n``-th
   index file write gets half its bytes into its temporary, fsynced, then it SIGKILLs itself): the capture
   goes on and lists every shard. And the capturing process killed while its builder works: every shard it
   listed stays listed and readable and a new writer continues the store. Either way ``verify`` names no
   listed shard and the next query answers as the exhaustive scan does.
2. **The FAISS IVF search file** (``ann-*.faiss``): a build killed while writing it, on a fresh index and on a
   kept IVF index being brought up to date (also just after it, while the manifest is written). The index is
   then rebuilt or not used (said in one line), never a silently wrong answer.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_vector_index import TEST, TRAIN, assert_same_top, base, make_model, store, write_pass
from test_vector_index_kill import query, temporaries

from metastore_plugins import CaptureSession, StoreWriter, open_store
from metastore_plugins.cli import main
from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.analysis import vector_index as vi
from metastore_plugins.core.analysis.index_parts import PartBuilder
from metastore_plugins.core.store import vector_files
from metastore_plugins.core.store.file_kinds import temporary_target

__all__ = ["base", "store"]  # the fixtures: a copy of a module-scoped store per test

pytestmark = [pytest.mark.slow, pytest.mark.kill]  # a subprocess per case, killed with SIGKILL

FOLDER = vector_files.FOLDER
TESTS = Path(__file__).parent
TEST_IDS, ALL = torch.arange(360, 400), torch.arange(360)

TORN_WRITE = """
import os, signal, sys
from pathlib import Path
from metastore_plugins.core.store import vector_files
from metastore_plugins.core.store.file_kinds import temporary_target
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
"""

BUILDER = """
from metastore_plugins.core.analysis.index_parts import main

main(sys.argv[1:])
"""

WRITER = f"""
import os, signal, sys
from pathlib import Path
store_dir, kill_at = Path(sys.argv[1]), int(sys.argv[2])
sys.path.insert(0, {str(TESTS)!r})
import torch
from test_vector_index import TEST, TRAIN, make_model
from metastore_plugins.core.analysis.index_parts import PartBuilder
import test_vector_index_kill_write as here

builder = PartBuilder(store_dir)
model, x, y = make_model()
listed = []


def kill_after(name):  # the writer's process killed once it listed kill_at shards, its builder at work
    builder.shard_written(name)
    listed.append(name)
    if len(listed) == kill_at:
        print(builder.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


here.capture(store_dir, kill_after, model, x, y, TEST, torch.arange(360, 400))
here.capture(store_dir, kill_after, model, x, y, TRAIN, torch.arange(360))
sys.exit(3)  # fewer shards were listed than kill_at
"""

ANN = """
from metastore_plugins import CaptureSession, StoreWriter, open_store
from metastore_plugins.core.analysis import vector_index as vi

vi.open_index(open_store(store_dir), sys.argv[3], plan=vi.Plan("ivf", 8, 8))
sys.exit(3)
"""


def capture(
    path: Path,
    on_shard: Callable[[str], object],
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    point: str,
    ids: torch.Tensor,
) -> StoreWriter:
    """:func:`write_pass` with the write side's hook (used by the workers too)."""
    with StoreWriter(path, encoding="fp32", shard_bytes=20_000, on_shard=on_shard) as writer:
        for part in ids.split(40):
            with CaptureSession(model) as session:
                F.cross_entropy(model(x[part]), y[part]).backward()
            writer.write(session.factors(), sample_ids=part, step=int(part[0]), capture_point=point, lr=0.1)
            model.zero_grad()
    return writer


def builder_killed_at(kill_at: int, tmp_path: Path) -> PartBuilder:
    """A builder whose child SIGKILLs itself in its ``kill_at``-th index file write."""
    child = tmp_path / "builder.py"
    child.write_text(TORN_WRITE.replace("int(sys.argv[2])", str(kill_at)) + BUILDER)
    return PartBuilder(tmp_path / "store", command=[sys.executable, str(child)])


def check_answers(path: Path) -> None:
    """Every sample stored; the next queries answer as the exhaustive scan; nothing left for verify."""
    store = open_store(path)
    assert sorted(store.sample_ids(TRAIN).tolist()) == list(range(360))
    exhaustive = store.influence(TRAIN, TEST)
    assert_same_top(query(store, None), exhaustive)  # the kept index, what the kill left of it rebuilt
    assert_same_top(query(open_store(path), True), exhaustive)
    assert temporaries(path) == [] and open_store(path).verify() == []
    opened = vi.open_index(open_store(path), TRAIN, build=False)
    assert opened is not None and opened.rebuilt == [] and len(opened.sample_ids) == 360


def run_and_kill(script: str, store_dir: Path, kill_at: int, tmp_path: Path, *args: str) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(TORN_WRITE + script)
    proc = subprocess.run(
        [sys.executable, str(worker), str(store_dir), str(kill_at), *args], capture_output=True, timeout=300
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-3000:]


@pytest.mark.parametrize("when", [1, 2, 3, 4, 9, 10], ids=lambda n: f"write{n}")
@pytest.mark.parametrize("then", ["query", "repair"])
def test_the_part_builder_killed_mid_write(tmp_path: Path, when: int, then: str) -> None:
    """Odd writes are parts, even ones manifests (writes 1 and 2: the test point's; then the training shards').
    The capture goes on: every shard is listed, the builder says in one line that it ended."""
    path = tmp_path / "store"
    builder = builder_killed_at(when, tmp_path)
    model, x, y = make_model()
    writers = [capture(path, builder.shard_written, model, x, y, p, i) for p, i in ((TEST, TEST_IDS), (TRAIN, ALL))]
    builder.close()
    assert all(w.stats.shards and w.on_shard_error is None for w in writers)
    assert len(builder.problems) == 1 and "ended (exit code -9)" in builder.problems[0]
    assert len(temporaries(path)) == 1  # killed in the middle of writing an index file
    problems = open_store(path).verify()
    assert problems and all(p.startswith(f"{FOLDER}/") and "\n" not in p for p in problems)  # never a shard
    if then == "repair":
        assert main(["verify", str(path), "--repair"]) == 0
        assert open_store(path).verify() == []
    check_answers(path)


@pytest.mark.parametrize("when", [1, 3, 6])
def test_the_writer_killed_while_its_builder_works(tmp_path: Path, when: int) -> None:
    """The capturing process SIGKILLed once it listed ``when`` shards: its builder finishes the part at hand
    and ends (its input closed); a new writer continues the store, and the next query answers right."""
    path = tmp_path / "store"
    worker = tmp_path / "worker.py"
    worker.write_text(WRITER)
    proc = subprocess.run([sys.executable, str(worker), str(path), str(when)], capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-3000:]
    child = Path(f"/proc/{int(proc.stdout.split()[-1])}")
    for _ in range(600):  # the builder ends once it sees its input closed
        if not child.exists():
            break
        time.sleep(0.1)
    killed = open_store(path)
    problems = killed.verify()  # the index's files, or the shard the writer was writing: never a listed shard
    writer_left = "a temporary file left by a stopped writer"
    assert all((p.startswith(f"{FOLDER}/") or writer_left in p) and "\n" not in p for p in problems), problems
    ids = killed.sample_ids(TRAIN).tolist() if TRAIN in killed.capture_points() else []
    assert ids == list(range(len(ids)))  # the shards listed before the kill, in order
    builder = PartBuilder(path)  # a new writer (and builder) continue the store: the kill left no lock
    model, x, y = make_model()
    rest = torch.tensor([i for i in range(360) if i not in set(ids)], dtype=torch.long)
    if len(rest):
        capture(path, builder.shard_written, model, x, y, TRAIN, rest)
    if TEST not in killed.capture_points():
        capture(path, builder.shard_written, model, x, y, TEST, TEST_IDS)
    builder.close()
    assert builder.problems == []
    check_answers(path)


@pytest.mark.parametrize("then", ["query", "repair"])
def test_a_fresh_ivf_build_killed_while_writing_its_search_file(
    store: GradientStore, tmp_path: Path, then: str
) -> None:
    pytest.importorskip("faiss")
    n = len({ref.file.name for ref in store.batch_refs(TRAIN)})
    run_and_kill(ANN, store.path, n + 1, tmp_path, TRAIN)  # the parts, then the search file
    torn = [temporary_target(name) or "" for name in temporaries(store.path)]
    assert len(torn) == 1 and torn[0].startswith("ann-")  # killed in the middle of writing the search file
    exhaustive = store.influence(TRAIN, TEST)
    problems = open_store(store.path).verify()
    assert problems and all(p.startswith(f"{FOLDER}/") and "\n" not in p for p in problems)
    if then == "repair":
        assert main(["verify", str(store.path), "--repair"]) == 0
    assert vi.open_index(open_store(store.path), TRAIN, build=False) is None  # no manifest: `auto` scans
    assert_same_top(query(open_store(store.path), None), exhaustive)
    opened = vi.open_index(open_store(store.path), TRAIN, plan=vi.Plan("ivf", 8, 8))
    assert opened.ann is not None and any(name.startswith("ann-") for name in opened.rebuilt)
    assert_same_top(query(open_store(store.path), None), exhaustive)  # through the IVF index now
    assert temporaries(store.path) == [] and open_store(store.path).verify() == []


@pytest.mark.parametrize("when", ["search file", "manifest"])
@pytest.mark.parametrize("then", ["query", "repair"])
def test_an_ivf_update_killed_while_writing_its_search_file(
    store: GradientStore, tmp_path: Path, when: str, then: str
) -> None:
    """A kept IVF index, the store grown by a shard: the update writes the new part, the search file, the
    manifest. Killed in the search file, the kept one is whole and the kept manifest lists it (over the old
    parts only); killed in the manifest, the new search file does not match the sha256 the kept manifest
    records. Either way it is not used for the grown store: rebuilt."""
    pytest.importorskip("faiss")
    vi.open_index(store, TRAIN, plan=vi.Plan("ivf", 8, 8))
    model, x, y = make_model()
    write_pass(store.path, model, x, y, TRAIN, torch.arange(400, 440))
    grown = open_store(store.path)
    exhaustive = grown.influence(TRAIN, TEST)
    run_and_kill(ANN, store.path, {"search file": 2, "manifest": 3}[when], tmp_path, TRAIN)
    assert len(temporaries(store.path)) == 1
    problems = open_store(store.path).verify()
    assert all(p.startswith(f"{FOLDER}/") and "\n" not in p for p in problems)
    if then == "repair":
        assert main(["verify", str(store.path), "--repair"]) == 0
        assert open_store(store.path).verify() == []
    assert_same_top(query(open_store(store.path), None), exhaustive)
    assert temporaries(store.path) == [] and open_store(store.path).verify() == []
    opened = vi.open_index(open_store(store.path), TRAIN, build=False)
    assert opened is not None and len(opened.sample_ids) == 400 and opened.rebuilt == []
