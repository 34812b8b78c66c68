"""Hostile index manifests and search files, re-signed (CRC and sha256 recomputed), parsed within bounds (issue 44).

Each case ends in one line naming the file: a ``verify`` problem, a ``--repair`` removal, a query's warning (the
answer then the exhaustive scan's, ``k=None``), never a traceback, a MemoryError or a large allocation.
"""

from __future__ import annotations

import hashlib
import tracemalloc
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
from test_vector_index import TEST, TRAIN, K, assert_same_top, base, store
from test_vector_index_repair import manifest_path, rewrite_manifest

from metastore_plugins import open_store
from metastore_plugins.cli import main
from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.analysis import vector_index as vi
from metastore_plugins.core.analysis import vector_search as vs
from metastore_plugins.core.store.vectors import vector_files

__all__ = ["base", "store"]  # the fixtures: a copy of a module-scoped store per test

FOLDER = vector_files.FOLDER
REDUCED = vs.Plan("reduced", reduced=16, candidates=60)


def ann_file(path: Path) -> Path:
    return sorted((path / FOLDER).glob("ann-*"))[0]


def resigned_ann(data: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def change(path: Path) -> None:
        victim = ann_file(path)
        new = data(victim.read_bytes())
        victim.write_bytes(new)

        def sign(manifest: dict) -> None:
            manifest["ann"]["sha256"] = hashlib.sha256(new).hexdigest()

        rewrite_manifest(path, sign)

    return change


def field(change: Callable[[dict], None]) -> Callable[[Path], None]:
    return lambda path: rewrite_manifest(path, change)


def many_objects(path: Path) -> None:
    rewrite_manifest(path, lambda m: m.update(parts=[{}] * 3_000_000))  # 9 MB of "{}": gigabytes if parsed at 300 MB


CASES: dict[str, Callable[[Path], None]] = {
    "3 million {}": many_objects,
    "candidates 2**40": field(lambda m: m["ann"].update(candidates=2**40)),
    "a string row count": field(lambda m: m["parts"][0].update(rows="40")),
    "layers = 7": field(lambda m: m.update(layers=7)),
    "ivf kind on a reduced file": field(lambda m: m["ann"].update(kind="ivf", nlist=8, nprobe=8)),
    "truncated FAISS file": resigned_ann(lambda data: data[: len(data) // 2]),
    "random FAISS file": resigned_ann(lambda data: bytes(len(data))),
    "random FAISS header": resigned_ann(lambda data: b"IxPT" + (2**62).to_bytes(12, "little") + data[16:]),
}


@pytest.mark.parametrize("how", list(CASES))
def test_a_hostile_index_file_is_one_line_and_the_answer_the_exhaustive_one(
    store: GradientStore, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("faiss")
    vi.open_index(store, TRAIN, plan=REDUCED)
    CASES[how](store.path)
    named = ann_file(store.path).name if "FAISS" in how or "ivf" in how else manifest_path(store.path).name
    tracemalloc.start()
    try:
        problems = open_store(store.path).verify()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20
    assert len(problems) == 1 and problems[0].startswith(f"{FOLDER}/{named}: ") and "\n" not in problems[0]
    fresh = open_store(store.path)
    with warnings.catch_warnings(record=True) as caught:  # said once, or (a kind its entry contradicts) rebuilt
        warnings.simplefilter("always")
        fast = fresh.influence(TRAIN, TEST, k=K, index=True)
    assert len(caught) <= 1 and all("\n" not in str(w.message) and named in str(w.message) for w in caught)
    assert_same_top(fast, fresh.influence(TRAIN, TEST))


@pytest.mark.parametrize("how", ["3 million {}", "candidates 2**40", "random FAISS file"])
def test_repair_removes_a_hostile_index_file(
    store: GradientStore, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("faiss")
    vi.open_index(store, TRAIN, plan=REDUCED)
    CASES[how](store.path)
    assert main(["verify", str(store.path), "--repair"]) == 0
    out = capsys.readouterr().out
    assert "repaired: vector_index/" in out and out.rstrip().endswith("problems: none")
    assert open_store(store.path).verify() == []
