"""The nearest-gradient index (``store.influence/similar(k=...)``) against the exhaustive scan.

References: the exhaustive scan of the same vectors (candidates, recall@10) and the exhaustive
exact query (``k=None``: every training row scored) for the final top-k. Damaged, stale or linked
index files are rebuilt or left unused, never followed, and the answers stay the exhaustive ones.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from metastore_plugins import CaptureSession, StoreWriter, open_store
from metastore_plugins.cli import main
from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.analysis import vector_index as vi
from metastore_plugins.core.analysis import vector_search as vs
from metastore_plugins.core.records import LayerRecord
from metastore_plugins.core.store.vectors import vector_files

TRAIN, TEST, K = "final/train", "final/test", 5


def write_pass(path: Path, model: nn.Module, x: torch.Tensor, y: torch.Tensor, point: str, ids: torch.Tensor) -> None:
    with StoreWriter(path, encoding="fp32", shard_bytes=20_000) as writer:
        for part in ids.split(40):
            with CaptureSession(model) as session:
                F.cross_entropy(model(x[part]), y[part]).backward()
            writer.write(session.factors(), sample_ids=part, step=int(part[0]), capture_point=point, lr=0.1)
            model.zero_grad()


def make_model() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 4))
    return model, torch.randn(440, 10), torch.randint(0, 4, (440,))


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An exact (fp32) store: 360 training samples over several shards, 40 test samples."""
    path = tmp_path_factory.mktemp("vector-index") / "store"
    model, x, y = make_model()
    write_pass(path, model, x, y, TRAIN, torch.arange(360))
    write_pass(path, model, x, y, TEST, torch.arange(360, 400))
    return path


@pytest.fixture
def store(base: Path, tmp_path: Path) -> GradientStore:
    shutil.copytree(base, tmp_path / "store")
    return open_store(tmp_path / "store")


def top_ids(scores: object, k: int = K) -> list[tuple[list[int], list[int]]]:
    """Per test sample, the ids of its top-k proponents and opponents, each as a sorted list (no order among ties)."""
    return [(sorted(i for i, _ in r["proponents"]), sorted(i for i, _ in r["opponents"])) for r in scores.top(k)]  # type: ignore[attr-defined]


def assert_same_top(fast: object, exhaustive: object) -> None:
    assert top_ids(fast) == top_ids(exhaustive)
    for a, b in zip(fast.top(K), exhaustive.top(K)):  # type: ignore[attr-defined]
        got = sorted(s for _, s in a["proponents"] + a["opponents"])
        want = sorted(s for _, s in b["proponents"] + b["opponents"])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def clustered(rows: int, width: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((64, width)).astype(np.float32)
    points = centers[rng.integers(0, 64, rows)] + 0.7 * rng.standard_normal((rows, width)).astype(np.float32)
    return points * rng.lognormal(0.0, 0.5, (rows, 1)).astype(np.float32)


def test_ivf_candidates_recall_at_10_against_the_exhaustive_scan() -> None:
    pytest.importorskip("faiss")
    rows, width = 20_000, 64
    vectors, queries = clustered(rows, width, 0), clustered(40, width, 1)
    flat = vs.VectorIndex("cp", 8, np.arange(rows), np.ones(rows), vectors, vs.Plan())
    plan = vs.choose_plan(rows, width, True)
    assert plan == vs.Plan()  # 20,000 x 64 numbers: flat ...
    plan = vs.Plan("ivf", 256, 64)  # ... so IVF is asked for, with choose_plan's nprobe = nlist / 4
    ann = vs.build_ivf(vectors, plan, vs.load_faiss())
    ivf = vs.VectorIndex("cp", 8, np.arange(rows), np.ones(rows), vectors, plan, ann)
    exact = [set(np.argsort(-(vectors @ q), kind="stable")[:10].tolist()) for q in queries]
    assert [set(r.tolist()) for r in flat.search(queries, 10)] == exact  # the flat scan is the exhaustive one
    recall = np.mean([len(e & set(r.tolist())) / 10 for e, r in zip(exact, ivf.search(queries, 10))])
    assert recall >= 0.95
    assert vs.choose_plan(1_000_000, 64, True) == vs.Plan("ivf", 4096, 1024)
    assert vs.choose_plan(1_000_000, 64, False) == vs.Plan()


@pytest.mark.parametrize("plan", [None, vs.Plan("ivf", 8, 8)], ids=["flat", "ivf"])
def test_top_k_after_rescoring_equals_the_exhaustive_top_k(store: GradientStore, plan: vs.Plan | None) -> None:
    if plan is not None:
        pytest.importorskip("faiss")
        vi.open_index(store, TRAIN, plan=plan)  # kept: the query below reuses it
    assert_same_top(store.influence(TRAIN, TEST, k=K, index=True), store.influence(TRAIN, TEST))  # all 40
    few = [361, 377]
    fast = store.influence(TRAIN, TEST, k=K, index=True, test_ids=few)
    assert len(fast.row_ids) <= 2 * 2 * 50 < 360  # only their candidates were scored
    assert_same_top(fast, store.influence(TRAIN, TEST, test_ids=few))
    assert store.verify() == []
    similar = store.similar(TEST, TRAIN, query_ids=[365, 370], k=K, index=True)
    assert len(similar.row_ids) < 360
    assert_same_top(similar, store.similar(TEST, TRAIN, query_ids=[365, 370]))


def test_kept_index_is_used_and_only_new_shards_get_new_parts(store: GradientStore) -> None:
    assert vi.open_index(store, TRAIN, build=False) is None  # none kept: index=None scans every row
    assert len(store.influence(TRAIN, TEST, k=K).row_ids) == 360
    built = store.build_vector_index(TRAIN)
    parts = [name for name in built.rebuilt if name.startswith("part-")]
    assert len(parts) == len({ref.file.name for ref in store.batch_refs(TRAIN)}) > 1
    assert vi.open_index(store, TRAIN).rebuilt == []  # all current and sound
    model, x, y = make_model()  # the store grows: one more shard of training samples
    write_pass(store.path, model, x, y, TRAIN, torch.arange(400, 440))
    grown = open_store(store.path)
    again = vi.open_index(grown, TRAIN)
    assert len(again.rebuilt) == 1 and len(again.sample_ids) == 400
    np.testing.assert_array_equal(again.sample_ids, grown.sample_ids(TRAIN))
    assert_same_top(grown.influence(TRAIN, TEST, k=K), grown.influence(TRAIN, TEST))


def damage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("which", ["part", "manifest", "ann"])
def test_damaged_index_file_is_reported_then_rebuilt(store: GradientStore, which: str) -> None:
    if which == "ann":
        pytest.importorskip("faiss")
    vi.open_index(store, TRAIN, plan=vs.Plan("ivf", 8, 8) if which == "ann" else None)
    folder = store.path / vector_files.FOLDER
    victim = sorted(folder.glob({"part": "part-*", "manifest": "manifest-*", "ann": "ann-*"}[which]))[0]
    damage(victim)
    problems = store.verify()
    assert len(problems) == 1 and victim.name in problems[0] and "\n" not in problems[0]
    with pytest.warns(UserWarning) as caught:
        fast = store.influence(TRAIN, TEST, k=K, index=True)
    assert all("\n" not in str(w.message) for w in caught)
    assert_same_top(fast, store.influence(TRAIN, TEST))
    assert store.verify() == []  # rebuilt and kept


def test_link_at_the_index_path_is_never_followed(store: GradientStore, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, store.path / vector_files.FOLDER)
    with pytest.warns(UserWarning, match="symbolic link"):
        fast = store.influence(TRAIN, TEST, k=K, index=True)  # built in memory, nothing written through the link
    assert list(outside.iterdir()) == []
    assert_same_top(fast, store.influence(TRAIN, TEST))
    assert any("symbolic link" in p for p in store.verify())


def test_link_at_a_part_is_not_read_and_is_replaced(store: GradientStore, tmp_path: Path) -> None:
    vi.open_index(store, TRAIN)
    part = sorted((store.path / vector_files.FOLDER).glob("part-*"))[0]
    outside = tmp_path / "outside-part"
    shutil.copy(part, outside)
    before = outside.read_bytes()
    part.unlink()
    os.symlink(outside, part)
    assert any(part.name in p and "symbolic link" in p for p in store.verify())
    with pytest.warns(UserWarning, match="symbolic link"):
        rebuilt = vi.open_index(store, TRAIN)
    assert rebuilt is not None and rebuilt.rebuilt == [part.name]
    assert not part.is_symlink() and outside.read_bytes() == before  # the link replaced, never written through
    assert store.verify() == []


def test_without_faiss_every_index_is_flat_with_the_same_answers(
    store: GradientStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    with_faiss = store.influence(TRAIN, TEST, k=K, index=True)
    monkeypatch.setitem(sys.modules, "faiss", None)  # import faiss raises ImportError
    assert vs.load_faiss() is None
    assert vs.choose_plan(10**8, 64, vs.load_faiss() is not None) == vs.Plan()
    opened = vi.open_index(store, TRAIN, plan=vs.Plan("ivf", 8, 2))
    assert opened is not None and opened.plan == vs.Plan() and opened.ann is None
    without = store.influence(TRAIN, TEST, k=K, index=True)
    assert_same_top(without, with_faiss)
    assert_same_top(without, store.influence(TRAIN, TEST))


def test_cli_inspect_states_the_index_and_influence_uses_it(
    store: GradientStore, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(store.path)]) == 0
    assert "vector index: none" in capsys.readouterr().out
    args = ["influence", str(store.path), "--train", TRAIN, "--capture-point", TEST, "--test", "361", "-k", "3"]
    args += ["--method", "tracin"]  # every method goes through the index now: test_vector_index_methods.py
    assert main([*args, "--index", "off"]) == 0
    exhaustive = capsys.readouterr().out
    assert "Method: TracIn" in exhaustive
    main([*args, "--index", "build"])
    assert capsys.readouterr().out == exhaustive
    similar = ["similar", str(store.path), "--sample", "365", "--capture-point", TEST, "--candidates", TRAIN, "-k", "3"]
    main([*similar, "--index", "off"])
    exhaustive = capsys.readouterr().out
    main([*similar, "--index", "build"])
    assert capsys.readouterr().out == exhaustive
    assert main(["inspect", str(store.path)]) == 0
    out = capsys.readouterr().out
    assert f"{TRAIN:<20} 360 rows of 2 layers x 16^2, flat" in out


def projected_records(vectors: np.ndarray) -> list[LayerRecord]:
    """``(B, 2, 16)`` -> two ``projected`` 4x4 records (what a capture policy under a budget keeps)."""
    b = len(vectors)
    return [
        LayerRecord(
            f"layer{i}",
            "projected",
            b,
            {"weight": f"layer{i}.weight"},
            {"weight": (24, 24)},
            {
                "projected": torch.from_numpy(vectors[:, i].reshape(b, 4, 4).copy()),
                "sq_norm": torch.from_numpy((vectors[:, i] ** 2).sum(1)),
            },
        )
        for i in range(2)
    ]


def test_projected_store_scores_candidates_from_the_index_vectors(tmp_path: Path) -> None:
    """Kept projected, the stored projections are the index's vectors: candidates are scored from them, with the
    estimates ``influence`` gives; the top-k equals the exhaustive one (occurrences at two steps summed)."""
    train, test = clustered(600, 32, 0).reshape(600, 2, 16), clustered(6, 32, 1).reshape(6, 2, 16)
    with StoreWriter(tmp_path / "store", encoding="fp32", shard_bytes=8_000) as writer:
        for step, first in enumerate(range(0, 600, 20)):  # ids 0..299 twice, at different learning rates
            ids = np.arange(first, first + 20) % 300
            writer.write(projected_records(train[first : first + 20]), sample_ids=ids, step=step, lr=0.1 + step / 100)
        writer.write(projected_records(test), sample_ids=np.arange(300, 306), step=30, capture_point="test")
    store = open_store(tmp_path / "store")
    assert vi.projected_only(store, store.layers())
    fast = store.influence("train", "test", k=K, index=True)
    assert len(fast.row_ids) < 300
    exhaustive = store.influence("train", "test")
    assert_same_top(fast, exhaustive)
    rows = np.flatnonzero(np.isin(exhaustive.row_ids, fast.row_ids))
    order = np.argsort(exhaustive.row_ids[rows])
    np.testing.assert_allclose(
        fast.scores[np.argsort(fast.row_ids)], exhaustive.scores[rows][order], rtol=1e-5, atol=1e-6
    )


def test_a_build_killed_mid_write_leaves_a_usable_index(store: GradientStore) -> None:
    """Every file is replaced through a temporary, parts before the manifest: a build killed mid-write leaves
    the previous files and a temporary (or an unlisted part), which the next build removes (or overwrites)."""
    vi.open_index(store, TRAIN)
    folder = store.path / vector_files.FOLDER
    manifest = sorted(folder.glob("manifest-*"))[0]
    part = sorted(folder.glob("part-*"))[0]
    (folder / f"{manifest.name}.0123456789abcdef.tmp").write_bytes(b"torn")  # killed writing the manifest
    (folder / f"{part.name}.fedcba9876543210.tmp").write_bytes(part.read_bytes()[:100])  # ... or a part
    model, x, y = make_model()
    write_pass(store.path, model, x, y, TRAIN, torch.arange(400, 440))  # a new shard: the next open builds
    grown = open_store(store.path)
    assert_same_top(grown.influence(TRAIN, TEST, k=K, index=True), grown.influence(TRAIN, TEST))
    assert not list(folder.glob("*.tmp")) and grown.verify() == []
