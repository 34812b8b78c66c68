"""SIGKILL in the middle of an index file write, at the two moments test_vector_index_kill.py does not reach.

1. **The write side**: a run with ``RunCapture(index=True)`` builds its parts in ``close()``, after its last
   training step and compaction. Killed in the middle of that build (its ``n``-th index file write gets half
   its bytes into its temporary, fsynced, then it SIGKILLs itself), every shard stays listed and readable. Killed
   during its training steps, it has written no index file at all (nothing is built then) and a resumed run
   builds every part at its close. Either way ``verify`` names no listed shard and the next query answers as
   the exhaustive scan does.
2. **The FAISS IVF search file** (``ann-*.faiss``): a build killed while writing it, on a fresh index and on a
   kept IVF index being brought up to date (also just after it, while the manifest is written). The index is
   then rebuilt or not used (said in one line), never a silently wrong answer.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_vector_index import TEST, TRAIN, assert_same_top, base, make_model, store, write_pass
from test_vector_index_kill import query, temporaries

from metastore_plugins import open_store
from metastore_plugins.cli import main
from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.analysis import vector_index as vi
from metastore_plugins.core.analysis import vector_search as vs
from metastore_plugins.core.store.file_kinds import temporary_target
from metastore_plugins.core.store.vectors import vector_files
from metastore_plugins.core.training.run import RunCapture

__all__ = ["base", "store"]  # the fixtures: a copy of a module-scoped store per test

pytestmark = [pytest.mark.slow, pytest.mark.kill]  # a subprocess per case, killed with SIGKILL

FOLDER = vector_files.FOLDER
TESTS = Path(__file__).parent
TEST_IDS, ALL = torch.arange(360, 400), torch.arange(360)

TORN_WRITE = """
import os, signal, sys
from pathlib import Path
from metastore_plugins.core.store.vectors import vector_files
from metastore_plugins.core.store.file_kinds import temporary_target
from metastore_plugins.core.store.files import StoreDir

store_dir, kill_at, calls = Path(sys.argv[1]), int(sys.argv[2]), []
original = vector_files.write


def write(path, name, data):
    calls.append(name)
    if kill_at < 0 or len(calls) < kill_at:  # kill_at < 0: no torn write
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

RUN = f"""
sys.path.insert(0, {str(TESTS)!r})
import torch
import test_vector_index_kill_write as here
from metastore_plugins.core.training.run import RunCapture

run = here.index_run(store_dir)
listed = []


def kill_after(name):  # kill_at < 0: killed once -kill_at shards are listed, during the training steps
    listed.append(name)
    if len(listed) == -kill_at:
        os.kill(os.getpid(), signal.SIGKILL)


run.writer.on_shard = kill_after
here.steps(run, here.TEST, here.TEST_IDS)
here.steps(run, here.TRAIN, here.ALL)
run.close()  # kill_at > 0: killed in the kill_at-th index file write of the close-time build
sys.exit(3)  # it wrote fewer index files (or listed fewer shards) than kill_at
"""

ANN = """
from metastore_plugins import CaptureSession, StoreWriter, open_store
from metastore_plugins.core.analysis import vector_index as vi
from metastore_plugins.core.analysis import vector_search as vs

vi.open_index(open_store(store_dir), sys.argv[3], plan=vs.Plan("ivf", 8, 8))
sys.exit(3)
"""


def index_run(path: Path) -> RunCapture:
    """A run that builds its index parts at close, about two steps a shard (used by the worker too)."""
    run = RunCapture(path, encoding="fp32", flush_seconds=None, index=True)
    run.writer.shard_bytes = 20_000
    return run


def steps(run: RunCapture, point: str, ids: torch.Tensor) -> None:
    """Steps of the test model at capture point ``point`` over ``ids``, 40 samples a step."""
    model, x, y = make_model()
    for part in ids.split(40):
        run.begin_step(model, capture_point=point)
        F.cross_entropy(model(x[part]), y[part]).backward()
        run.end_backward()
        run.finish_step((x[part], y[part]), part, step=int(part[0]), capture_point=point, lr=0.1)
        model.zero_grad()


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
def test_the_close_time_build_killed_mid_write(tmp_path: Path, when: int, then: str) -> None:
    """Odd writes are parts, even ones manifests. Every shard the run wrote stays listed and readable."""
    path = tmp_path / "store"
    run_and_kill(RUN, path, when, tmp_path)
    assert sorted(open_store(path).sample_ids(TRAIN).tolist()) == list(range(360))
    assert len(temporaries(path)) == 1  # killed in the middle of writing an index file
    problems = open_store(path).verify()
    assert problems and all(p.startswith(f"{FOLDER}/") and "\n" not in p for p in problems)  # never a shard
    if then == "repair":
        assert main(["verify", str(path), "--repair"]) == 0
        assert open_store(path).verify() == []
    check_answers(path)


@pytest.mark.parametrize("when", [1, 3, 4])
def test_a_run_killed_during_its_steps_has_no_index_file_and_a_resumed_run_builds_them(
    tmp_path: Path, when: int
) -> None:
    """SIGKILLed once it listed ``when`` shards: no index file exists (none is built during the steps); a
    resumed run continues the store and its close builds the parts of every shard of the rank."""
    path = tmp_path / "store"
    run_and_kill(RUN, path, -when, tmp_path)
    assert not (path / FOLDER).exists()
    killed = open_store(path)
    problems = killed.verify()  # the shard the writer was writing, at most: never a listed shard
    assert all("a temporary file left by a stopped writer" in p and "\n" not in p for p in problems), problems
    ids = killed.sample_ids(TRAIN).tolist() if TRAIN in killed.capture_points() else []
    assert ids == list(range(len(ids)))  # the shards listed before the kill, in order
    run = index_run(path)  # a resumed run continues the store: the kill left no lock
    if TEST not in killed.capture_points():
        steps(run, TEST, TEST_IDS)
    steps(run, TRAIN, torch.tensor([i for i in range(360) if i not in set(ids)], dtype=torch.long))
    run.close()
    assert run.index_parts is not None and run.index_parts.problems == []
    built = {name.split("-", 2)[2] for name in run.index_parts.written}  # part-<key>-<shard>
    assert built == {ref.file.name for ref in open_store(path).batch_refs()}  # the killed run's shards too
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
    opened = vi.open_index(open_store(store.path), TRAIN, plan=vs.Plan("ivf", 8, 8))
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
    vi.open_index(store, TRAIN, plan=vs.Plan("ivf", 8, 8))
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
