"""The nearest-gradient index never answers from bytes it has not checked since they last changed (issue 44).

- A part rewritten in place with its mtime set back: the next query (same process, a fresh ``open_store``) sees
  it (the file's ctime changed), says it in one line and answers as the exhaustive scan does (``k=None``).
- A manifest re-signed (CRC and sha256 recomputed: the write access the journal's cases assume) over scaled
  vectors, permuted sample ids or two parts swapped with their shard binding: refused and rebuilt by the query,
  and (ids, binding) named by ``verify``; the reference is the exhaustive scan, the shards' own sample ids.
- A part cut short and restored in place by this process while another loops ``influence(k=)``: the querying
  process never dies of SIGBUS, and each answer is the exhaustive one.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save
from test_vector_index import TEST, TRAIN, K, assert_same_top, base, store, top_ids
from test_vector_index_repair import rewrite_manifest

from metastore_plugins import open_store
from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.analysis import vector_index as vi
from metastore_plugins.core.analysis import vector_search as vs
from metastore_plugins.core.store.vectors import vector_files

__all__ = ["base", "store"]  # the fixtures: a copy of a module-scoped store per test

FOLDER = vector_files.FOLDER
REDUCED = vs.Plan("reduced", reduced=16, candidates=60)


def parts(path: Path) -> list[Path]:
    return sorted((path / FOLDER).glob("part-*"))


def read_part(victim: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(victim), "pt") as opened:
        return {key: opened.get_tensor(key) for key in opened.keys()}, dict(opened.metadata())


def resign(path: Path, victim: Path, data: bytes) -> None:
    """Write ``data`` as part ``victim`` and re-sign its manifest entry (sha256, then the manifest's CRC)."""
    victim.write_bytes(data)

    def sign(manifest: dict) -> None:
        for entry in manifest["parts"]:
            if entry["file"] == victim.name:
                entry["sha256"] = hashlib.sha256(data).hexdigest()

    rewrite_manifest(path, sign)


def scaled(path: Path) -> None:
    victim = parts(path)[0]
    tensors, meta = read_part(victim)
    resign(path, victim, save({**tensors, "vector": tensors["vector"] * 1e-3}, meta))


def permuted(path: Path) -> None:
    victim = parts(path)[0]
    tensors, meta = read_part(victim)
    ids = tensors["sample_id"]
    resign(path, victim, save({**tensors, "sample_id": ids.flip(0)}, meta))


def swapped(path: Path) -> None:
    """Two parts' contents exchanged, each's metadata naming the shard it now stands for: every check on the
    manifest and the part's own metadata passes."""
    first, second = parts(path)[:2]
    (a, meta_a), (b, meta_b) = read_part(first), read_part(second)
    bound = ("shard", "shard_sha256")
    resign(path, first, save(b, {**meta_b, **{k: meta_a[k] for k in bound}}))
    resign(path, second, save(a, {**meta_a, **{k: meta_b[k] for k in bound}}))


RESIGNED: dict[str, Callable[[Path], None]] = {"scaled": scaled, "permuted ids": permuted, "swapped": swapped}


@pytest.mark.parametrize("how", list(RESIGNED))
def test_a_resigned_manifest_over_other_rows_is_refused_and_rebuilt(store: GradientStore, how: str) -> None:
    store.build_vector_index(TRAIN)
    RESIGNED[how](store.path)
    fresh = open_store(store.path)
    if how != "scaled":  # the ids against the store's own index: verify sees it (a scale needs the shard sketched)
        problems = fresh.verify()
        assert problems and all(p.startswith(f"{FOLDER}/part-") and "\n" not in p for p in problems)
    with pytest.warns(UserWarning, match="rebuilt from") as caught:
        fast = fresh.influence(TRAIN, TEST, k=K, index=True)
    assert all("\n" not in str(w.message) for w in caught)
    assert_same_top(fast, fresh.influence(TRAIN, TEST))
    assert open_store(store.path).verify() == []  # rebuilt and kept


def test_a_part_rewritten_in_place_with_its_mtime_set_back_is_seen_by_the_next_query(store: GradientStore) -> None:
    pytest.importorskip("faiss")
    vi.open_index(store, TRAIN, plan=REDUCED)  # rows read from the parts as candidates are rescored
    exhaustive = store.influence(TRAIN, TEST)
    assert_same_top(store.influence(TRAIN, TEST, k=K), exhaustive)  # opened and kept in this process
    victim = parts(store.path)[0]
    before = victim.stat()
    data = victim.read_bytes()
    size = int.from_bytes(data[:8], "little")
    begin, end = (8 + size + o for o in json.loads(data[8 : 8 + size])["vector"]["data_offsets"])
    with open(victim, "r+b") as handle:  # in place: same inode, same size; its vectors zeroed
        handle.seek(begin)
        handle.write(bytes(end - begin))
    os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.warns(UserWarning, match="sha256") as caught:
        fast = open_store(store.path).influence(TRAIN, TEST, k=K)
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    assert_same_top(fast, exhaustive)


WORKER = """
import sys, warnings
from metastore_plugins import open_store
from metastore_plugins.core.analysis import vector_index as vi
from metastore_plugins.core.analysis import vector_search as vs
warnings.simplefilter("ignore")
store = open_store(sys.argv[1])
vi.open_index(store, "{train}", plan=vs.Plan("reduced", reduced=16, candidates=60))
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "stop":
        break
    fast = open_store(sys.argv[1]).influence("{train}", "{test}", k={k})
    top = [(sorted(i for i, _ in r["proponents"]), sorted(i for i, _ in r["opponents"])) for r in fast.top({k})]
    print(repr(top), flush=True)
"""


def cut_and_restore(path: Path, stop: threading.Event) -> None:
    """Until ``stop``: parts 0 and 1 cut to half their size and written back, in place (opened by path each time:
    a part the worker rebuilt, a new inode, is cut too)."""
    while not stop.is_set():
        for victim in parts(path)[:2]:
            try:
                with open(victim, "r+b") as handle:
                    data = handle.read()
                    handle.truncate(len(data) // 2)
                    handle.seek(0)
                    handle.write(data)
            except FileNotFoundError:  # replaced by the worker's rebuild meanwhile
                continue


@pytest.mark.slow
def test_a_part_cut_short_while_another_process_queries_never_kills_it(store: GradientStore, tmp_path: Path) -> None:
    """The query loop runs in a subprocess (a SIGBUS would kill it); a thread of this process cuts parts to half
    their size and restores them in place all the while."""
    pytest.importorskip("faiss")
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(train=TRAIN, test=TEST, k=K))
    want = repr(top_ids(store.influence(TRAIN, TEST)))
    worker = subprocess.Popen(
        [sys.executable, str(script), str(store.path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert worker.stdin is not None and worker.stdout is not None
    assert worker.stdout.readline().strip() == "ready"
    stop = threading.Event()
    cutter = threading.Thread(target=cut_and_restore, args=(store.path, stop))
    cutter.start()
    answers = []
    try:
        for _ in range(20):
            worker.stdin.write("query\n")
            worker.stdin.flush()
            answers.append(worker.stdout.readline().strip())
        worker.stdin.write("stop\n")
        worker.stdin.close()
    except BrokenPipeError:  # the worker died: its exit status says how
        worker.stdin = None
    finally:
        stop.set()
        cutter.join()
        code = worker.wait(timeout=120)
        worker.stdout.close()
    assert code == 0  # not -SIGBUS
    assert answers == [want] * 20
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what the last cut left is said and rebuilt
        assert_same_top(open_store(store.path).influence(TRAIN, TEST, k=K), store.influence(TRAIN, TEST))
    assert np.all(np.isin(vi.open_index(open_store(store.path), TRAIN).sample_ids, store.sample_ids(TRAIN)))
