"""The write side of the nearest-gradient index: each shard's part built while the writer runs.

References: the parts a query-time build writes into a copy of the same store with no index (their
bytes), and the exhaustive query (``k=None``: every training row scored) for the top-k. A part the
writer side leaves damaged or stale is never trusted; a failing part never stops or delays a shard.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from test_vector_index import TEST, TRAIN, K, assert_same_top, damage, make_model

from metastore_plugins import CaptureSession, StoreWriter, open_store
from metastore_plugins.core.analysis import vector_index as vi
from metastore_plugins.core.analysis.index_parts import PartBuilder
from metastore_plugins.core.store import vector_files
from metastore_plugins.core.store.maintenance import compact
from metastore_plugins.core.training.run import RunCapture

FOLDER = vector_files.FOLDER


def write_with_parts(path: Path, builder: PartBuilder | None, point: str, ids: torch.Tensor) -> StoreWriter:
    """One pass of the test model over ``ids``, 40 samples a batch, about two batches a shard (fp32)."""
    model, x, y = make_model()
    hook = None if builder is None else builder.shard_written
    with StoreWriter(path, encoding="fp32", shard_bytes=20_000, on_shard=hook) as writer:
        for part in ids.split(40):
            with CaptureSession(model) as session:
                F.cross_entropy(model(x[part]), y[part]).backward()
            writer.write(session.factors(), sample_ids=part, step=int(part[0]), capture_point=point, lr=0.1)
            model.zero_grad()
    return writer


def written_store(path: Path) -> PartBuilder:
    builder = PartBuilder(path)
    write_with_parts(path, builder, TRAIN, torch.arange(360))
    write_with_parts(path, builder, TEST, torch.arange(360, 400))
    return builder


def part_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((path / FOLDER).glob("part-*"))}


def query_time_parts(path: Path, tmp_path: Path) -> dict[str, bytes]:
    """The parts a query-time build writes into a copy of the store without its index."""
    copy = tmp_path / "query-time"
    shutil.copytree(path, copy)
    shutil.rmtree(copy / FOLDER)
    store = open_store(copy)
    for point in (TRAIN, TEST):
        vi.open_index(store, point)
    return part_bytes(copy)


def test_write_side_parts_are_the_query_time_parts_and_the_top_k_the_exhaustive_one(tmp_path: Path) -> None:
    path = tmp_path / "store"
    builder = written_store(path)
    builder.close()
    assert builder.problems == []
    store = open_store(path)
    shards = {ref.file.name for point in (TRAIN, TEST) for ref in store.batch_refs(point)}
    assert len(shards) >= 6 and len(builder.written) == len(shards)  # one part per shard (one point each)
    assert part_bytes(path) == query_time_parts(path, tmp_path)  # bit for bit
    opened = vi.open_index(store, TRAIN, build=False)  # `auto` finds it: nothing left to build
    assert opened is not None and opened.rebuilt == []
    assert_same_top(store.influence(TRAIN, TEST, k=K), store.influence(TRAIN, TEST))
    assert store.verify() == []


def test_after_compaction_merged_shards_get_their_members_parts(tmp_path: Path) -> None:
    path = tmp_path / "store"
    builder = written_store(path)
    builder.drain()  # as RunCapture.close does: every shard's part built before compaction merges the shards
    report = compact(path, target_bytes=60_000)
    assert report.groups and all(len(members) > 1 for _, members in report.groups)
    builder.close(report.groups)
    assert builder.problems == []
    store = open_store(path)
    shards = {(point, ref.file.name) for point in (TRAIN, TEST) for ref in store.batch_refs(point)}
    expected = query_time_parts(path, tmp_path)
    assert len(expected) == len(shards) and part_bytes(path) == expected  # members' parts removed, merged ones equal
    opened = vi.open_index(store, TRAIN, build=False)
    assert opened is not None and opened.rebuilt == []
    assert_same_top(store.influence(TRAIN, TEST, k=K), store.influence(TRAIN, TEST))
    assert store.verify() == []


def test_a_damaged_or_stale_write_side_part_is_never_trusted(tmp_path: Path) -> None:
    path = tmp_path / "store"
    written_store(path).close()
    victim = sorted((path / FOLDER).glob("part-*"))[1]
    damage(victim)
    store = open_store(path)
    exhaustive = store.influence(TRAIN, TEST)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast = store.influence(TRAIN, TEST, k=K)
    assert len(caught) <= 1 and all("\n" not in str(w.message) for w in caught)  # said once, when it is a TRAIN part
    assert_same_top(fast, exhaustive)
    model, x, y = make_model()  # the store grows without a builder: its new shard's part is the query's to build
    write_with_parts(path, None, TRAIN, torch.arange(400, 440))
    grown = open_store(path)
    again = vi.open_index(grown, TRAIN)
    assert again is not None and len(again.rebuilt) == 1 and len(again.sample_ids) == 400
    assert_same_top(grown.influence(TRAIN, TEST, k=K), grown.influence(TRAIN, TEST))
    assert grown.verify() == []


def test_write_side_parts_of_compacted_shards_are_stale_and_rebuilt(tmp_path: Path) -> None:
    """Compaction without the builder's merge: every part names a shard that is gone, none is used."""
    path = tmp_path / "store"
    builder = written_store(path)
    builder.close()
    assert compact(path, target_bytes=60_000).groups
    store = open_store(path)
    opened = vi.open_index(store, TRAIN)
    shards = {ref.file.name for ref in store.batch_refs(TRAIN)}
    assert opened is not None and len([n for n in opened.rebuilt if n.startswith("part-")]) == len(shards)
    assert_same_top(store.influence(TRAIN, TEST, k=K), store.influence(TRAIN, TEST))
    assert store.verify() == []


def test_a_failing_part_never_stops_nor_loses_a_shard(tmp_path: Path) -> None:
    path = tmp_path / "store"
    path.mkdir()
    (path / FOLDER).write_text("not a folder")  # every part write fails
    builder = PartBuilder(path)
    writer = write_with_parts(path, builder, TRAIN, torch.arange(200))
    builder.close()
    assert writer.on_shard_error is None and writer.stats.shards >= 3
    assert len(builder.problems) == writer.stats.shards and builder.written == []
    assert all("\n" not in line and "left to the next query" in line for line in builder.problems)
    assert open_store(path).sample_ids(TRAIN).tolist() == list(range(200))

    def boom(name: str) -> None:
        raise OSError("listener failed")

    again = tmp_path / "again"
    model, x, y = make_model()
    with StoreWriter(again, encoding="fp32", shard_bytes=20_000, on_shard=boom) as writer:
        for part in torch.arange(200).split(40):
            with CaptureSession(model) as session:
                F.cross_entropy(model(x[part]), y[part]).backward()
            writer.write(session.factors(), sample_ids=part, step=int(part[0]), capture_point=TRAIN)
            model.zero_grad()
    assert isinstance(writer.on_shard_error, OSError) and writer.stopped is None
    assert open_store(again).sample_ids(TRAIN).tolist() == list(range(200))


def test_run_capture_builds_the_parts_as_the_run_goes(tmp_path: Path) -> None:
    model, x, y = make_model()
    path = tmp_path / "store"
    run = RunCapture(path, encoding="fp32", flush_seconds=None, index=True)
    run.writer.shard_bytes = 20_000
    for step, part in enumerate(torch.arange(240).split(40)):
        run.begin_step(model)
        F.cross_entropy(model(x[part]), y[part]).backward()
        run.end_backward()
        run.finish_step((x[part], y[part]), part, step=step)
        model.zero_grad()
    run.close()
    assert run.index_parts is not None and run.index_parts.problems == []
    store = open_store(path)
    point = store.capture_points()[0]
    opened = vi.open_index(store, point, build=False)
    assert opened is not None and opened.rebuilt == [] and len(opened.sample_ids) == 240
    copy = tmp_path / "query-time"
    shutil.copytree(path, copy)
    shutil.rmtree(copy / FOLDER)
    vi.open_index(open_store(copy), point)
    assert part_bytes(path) == part_bytes(copy)


def test_run_capture_writes_no_part_by_default(tmp_path: Path) -> None:
    model, x, y = make_model()
    run = RunCapture(tmp_path / "store", encoding="fp32", flush_seconds=None)
    run.begin_step(model)
    F.cross_entropy(model(x[:40]), y[:40]).backward()
    run.end_backward()
    run.finish_step((x[:40], y[:40]), torch.arange(40), step=0)
    run.close()
    assert run.index_parts is None and not (tmp_path / "store" / FOLDER).exists()


ADDER = """
import sys
from pathlib import Path
from metastore_plugins.core.store import vector_files as vf

path, rank = Path(sys.argv[1]), sys.argv[2]
head = {"format": vf.FORMAT, "version": vf.VERSION, "capture_point": "cp", "dim": 2, "seed": 0, "layers": ["a"]}
for i in range(40):
    shard = f"rank{rank}-{i:06d}.safetensors"
    entry = {"file": vf.part_name("0" * 16, shard), "shard": shard, "shard_sha256": "0" * 64, "rows": 1, "sha256": ""}
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
