"""The write side of the nearest-gradient index: a rank's parts built when its run closes, never during its steps.

References: the parts a query-time build writes into a copy of the same store with no index (their
bytes), and the exhaustive query (``k=None``: every training row scored) for the top-k. A part the
write side leaves damaged or stale is never trusted; a failing part never stops a run nor loses a shard.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_vector_index import TEST, TRAIN, K, assert_same_top, damage, make_model, write_pass

from metastore_plugins import CaptureSession, StoreWriter, open_store
from metastore_plugins.core.analysis import vector_index as vi
from metastore_plugins.core.analysis.index_parts import build_rank_parts
from metastore_plugins.core.store.maintenance.compaction import compact
from metastore_plugins.core.store.vectors import vector_files
from metastore_plugins.core.training.run import RunCapture

FOLDER = vector_files.FOLDER


def written_store(path: Path) -> None:
    """360 training and 40 test samples, 40 a batch, about two batches a shard (fp32), no index."""
    model, x, y = make_model()
    write_pass(path, model, x, y, TRAIN, torch.arange(360))
    write_pass(path, model, x, y, TEST, torch.arange(360, 400))


def part_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((path / FOLDER).glob("part-*"))}


def query_time_parts(path: Path, tmp_path: Path, points: tuple[str, ...] = (TRAIN, TEST)) -> dict[str, bytes]:
    """The parts a query-time build writes into a copy of the store without its index."""
    copy = tmp_path / "query-time"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(path, copy)
    shutil.rmtree(copy / FOLDER, ignore_errors=True)
    store = open_store(copy)
    for point in points:
        vi.open_index(store, point)
    return part_bytes(copy)


def shards_of(path: Path) -> set[tuple[str, str]]:
    """``(capture point, shard)`` of each part a default index has: a merged shard may hold two points."""
    store = open_store(path)
    return {(point, ref.file.name) for point in store.capture_points() for ref in store.batch_refs(point)}


def test_close_time_parts_are_the_query_time_parts_and_the_top_k_the_exhaustive_one(tmp_path: Path) -> None:
    path = tmp_path / "store"
    written_store(path)
    built = build_rank_parts(path, 0)
    assert built.problems == [] and built.seconds > 0
    store = open_store(path)
    assert len(shards_of(path)) >= 6 and len(built.written) == len(shards_of(path))  # one part a shard and point
    assert part_bytes(path) == query_time_parts(path, tmp_path)  # bit for bit
    opened = vi.open_index(store, TRAIN, build=False)  # `auto` finds it: nothing left to build
    assert opened is not None and opened.rebuilt == []
    assert_same_top(store.influence(TRAIN, TEST, k=K), store.influence(TRAIN, TEST))
    assert store.verify() == []
    assert build_rank_parts(path, 0).written == [] and build_rank_parts(path, 1).written == []  # current; no rank 1


def test_parts_built_after_compaction_are_the_merged_shards_parts(tmp_path: Path) -> None:
    path = tmp_path / "store"
    written_store(path)
    report = compact(path, target_bytes=60_000)
    assert report.groups and all(len(members) > 1 for _, members in report.groups)
    built = build_rank_parts(path, 0)
    assert built.problems == [] and len(built.written) == len(shards_of(path))
    assert part_bytes(path) == query_time_parts(path, tmp_path)
    store = open_store(path)
    opened = vi.open_index(store, TRAIN, build=False)
    assert opened is not None and opened.rebuilt == []
    assert_same_top(store.influence(TRAIN, TEST, k=K), store.influence(TRAIN, TEST))
    assert store.verify() == []


def test_a_damaged_or_stale_close_time_part_is_never_trusted(tmp_path: Path) -> None:
    path = tmp_path / "store"
    written_store(path)
    build_rank_parts(path, 0)
    victim = sorted((path / FOLDER).glob("part-*"))[1]
    damage(victim)
    store = open_store(path)
    exhaustive = store.influence(TRAIN, TEST)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast = store.influence(TRAIN, TEST, k=K)
    assert len(caught) <= 1 and all("\n" not in str(w.message) for w in caught)  # said once, when it is a TRAIN part
    assert_same_top(fast, exhaustive)
    model, x, y = make_model()  # the store grows without a build: its new shard's part is the query's to build
    write_pass(path, model, x, y, TRAIN, torch.arange(400, 440))
    grown = open_store(path)
    again = vi.open_index(grown, TRAIN)
    assert again is not None and len(again.rebuilt) == 1 and len(again.sample_ids) == 400
    assert_same_top(grown.influence(TRAIN, TEST, k=K), grown.influence(TRAIN, TEST))
    assert grown.verify() == []


def test_parts_of_shards_compacted_later_are_stale_and_rebuilt(tmp_path: Path) -> None:
    """Compaction after the build (``metastore compact``): every part names a shard that is gone, none is used."""
    path = tmp_path / "store"
    written_store(path)
    build_rank_parts(path, 0)
    assert compact(path, target_bytes=60_000).groups
    store = open_store(path)
    opened = vi.open_index(store, TRAIN)
    shards = {ref.file.name for ref in store.batch_refs(TRAIN)}
    assert opened is not None and len([n for n in opened.rebuilt if n.startswith("part-")]) == len(shards)
    assert_same_top(store.influence(TRAIN, TEST, k=K), store.influence(TRAIN, TEST))
    assert store.verify() == []


def test_a_failing_part_is_said_once_and_loses_nothing(tmp_path: Path) -> None:
    path = tmp_path / "store"
    path.mkdir()
    (path / FOLDER).write_text("not a folder")  # every part write fails
    model, x, y = make_model()
    write_pass(path, model, x, y, TRAIN, torch.arange(200))
    shards = shards_of(path)
    with pytest.warns(UserWarning, match=f"left to the next query .*and {len(shards) - 1} more") as caught:
        built = build_rank_parts(path, 0)
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    assert len(shards) >= 3 and len(built.problems) == len(shards) and built.written == []
    assert all("\n" not in line and "left to the next query" in line for line in built.problems)
    assert open_store(path).sample_ids(TRAIN).tolist() == list(range(200))

    def boom(name: str) -> None:
        raise OSError("listener failed")

    again = tmp_path / "again"
    with StoreWriter(again, encoding="fp32", shard_bytes=20_000, on_shard=boom) as writer:
        for part in torch.arange(200).split(40):
            with CaptureSession(model) as session:
                F.cross_entropy(model(x[part]), y[part]).backward()
            writer.write(session.factors(), sample_ids=part, step=int(part[0]), capture_point=TRAIN)
            model.zero_grad()
    assert isinstance(writer.on_shard_error, OSError) and writer.stopped is None
    assert open_store(again).sample_ids(TRAIN).tolist() == list(range(200))


def run_steps(run: RunCapture, ids: torch.Tensor, first_step: int = 0, point: str = "train") -> None:
    """Training steps of the test model through ``run``, 40 samples a step."""
    model, x, y = make_model()
    for step, part in enumerate(ids.split(40), start=first_step):
        run.begin_step(model, capture_point=point)
        F.cross_entropy(model(x[part]), y[part]).backward()
        run.end_backward()
        run.finish_step((x[part], y[part]), part, step=step, capture_point=point, lr=0.1)
        model.zero_grad()


def test_run_capture_builds_the_parts_at_close_and_none_during_its_steps(tmp_path: Path) -> None:
    path = tmp_path / "store"
    run = RunCapture(path, encoding="fp32", flush_seconds=None, index=True)
    run.writer.shard_bytes = 20_000
    run_steps(run, torch.arange(240))
    run.writer.flush()
    assert run.writer.stats.shards >= 3 and not (path / FOLDER).exists()  # shards written, no part yet
    run.close()
    assert run.index_parts is not None and run.index_parts.problems == []
    assert run.seconds["index"] > 0 and run.compaction is not None  # built after compaction: its shards
    assert len(run.index_parts.written) == len(shards_of(path))
    store = open_store(path)
    opened = vi.open_index(store, "train", build=False)
    assert opened is not None and opened.rebuilt == [] and len(opened.sample_ids) == 240
    assert part_bytes(path) == query_time_parts(path, tmp_path, ("train",))
    run.close()  # safe twice: nothing rebuilt
    before = shards_of(path)
    resumed = RunCapture(path, encoding="fp32", flush_seconds=None, index=True)  # a resumed run: only its shards
    resumed.writer.shard_bytes = 20_000
    run_steps(resumed, torch.arange(240, 320), first_step=6)
    resumed.close()
    assert resumed.index_parts is not None and resumed.index_parts.problems == []
    new = shards_of(path) - before
    assert new and len(resumed.index_parts.written) == len(new) < len(shards_of(path))
    assert part_bytes(path) == query_time_parts(path, tmp_path, ("train",))


def test_run_capture_writes_no_part_by_default_nor_when_closed_by_an_exception(tmp_path: Path) -> None:
    run = RunCapture(tmp_path / "store", encoding="fp32", flush_seconds=None)
    run_steps(run, torch.arange(40))
    run.close()
    assert run.index_parts is None and not (tmp_path / "store" / FOLDER).exists()
    failed = RunCapture(tmp_path / "failed", encoding="fp32", flush_seconds=None, index=True)
    run_steps(failed, torch.arange(40))
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        failed.close()  # as Lightning's on_exception does: the index is left to the first query
    assert failed.index_parts is None and not (tmp_path / "failed" / FOLDER).exists()
    assert open_store(tmp_path / "failed").sample_ids("train").tolist() == list(range(40))


ADDER = """
import sys
from pathlib import Path
from metastore_plugins.core.store.vectors import vector_files as vf

path, rank = Path(sys.argv[1]), sys.argv[2]
head = {"format": vf.FORMAT, "version": vf.VERSION, "capture_point": "cp", "dim": 2, "seed": 0, "layers": ["a"]}
for i in range(40):
    shard = f"rank{rank}-{i:06d}.safetensors"
    entry = {"file": vf.part_name("0" * 16, shard), "shard": shard, "shard_sha256": "0" * 64, "rows": 1}
    entry["sha256"] = "0" * 64
    vf.add_parts(path, "0" * 16, head, [entry])
"""


def test_the_builders_of_two_ranks_never_drop_each_others_entries(tmp_path: Path) -> None:
    """Two processes add 40 parts each to one manifest at once: under its lock, all 80 are listed."""
    import subprocess
    import sys

    script = tmp_path / "adder.py"
    script.write_text(ADDER)
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path), str(rank)]) for rank in (0, 1)]
    assert [proc.wait(timeout=120) for proc in procs] == [0, 0]
    manifest = vector_files.read_manifest(tmp_path, "0" * 16)
    assert manifest is not None and len(manifest["parts"]) == 80
