"""Top-k by K-FAC, EK-FAC and TRAK through the nearest-gradient index against their exhaustive queries.

Reference: the exhaustive query of the same method (``k=None``: every training row scored), whose scores are
tested against dense ``(F + delta I)^-1`` references in ``test_kfac_influence.py`` and friends. With ``k=``, only
each test sample's candidates are scored (fewer rows than the store holds); where the candidates hold a test
sample's exhaustive top-k, its top lists (ids as sets: no order among equal scores) and scores must be the
exhaustive ones. On exact factors over two paired passes (the curvature fitted per pass, the passes summed at
their rates) and on passes projected on each pass's K-FAC eigenbasis (the index's vectors are the records).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from metastore_plugins import CaptureSession, StoreWriter, open_store
from metastore_plugins.cli import main
from metastore_plugins.core.analysis import GradientStore, index_factors, index_methods, index_preconditioned
from metastore_plugins.core.ops import DEFAULT_MAX_BYTES
from metastore_plugins.core.ops.curvature import DEFAULT_RELATIVE_DAMPING, CurvatureSums
from metastore_plugins.core.ops.eigenbasis import fit_bases, represent_on_bases

TRAIN_N, TEST_N, K = 600, 12, 5
TRAIN, TEST = ["epoch-0/train", "epoch-1/train"], ["epoch-0/val", "epoch-1/val"]


def write_passes(path: Path, kept: str) -> None:
    """Two epochs of checkpoint passes (600 train samples, 12 val, 50 a batch, rates 0.1 and 0.05); ``kept``:
    ``"exact"`` factors or ``"eigenbasis"`` 8 x 8 on each pass's K-FAC basis (fitted on its first batch)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 24), nn.Tanh(), nn.Linear(24, 4))
    x, y = torch.randn(TRAIN_N + TEST_N, 10), torch.randint(0, 4, (TRAIN_N + TEST_N,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with StoreWriter(path, encoding="fp32", shard_bytes=100_000) as writer:
        for epoch, lr in enumerate((0.1, 0.05)):
            bases = None
            for split, ids in (("train", torch.arange(TRAIN_N)), ("val", torch.arange(TRAIN_N, TRAIN_N + TEST_N))):
                for part in ids.split(50):
                    with CaptureSession(model, loss_reduction="sum") as session:
                        F.cross_entropy(model(x[part]), y[part], reduction="sum").backward()
                    records = session.factors()
                    if kept == "eigenbasis":
                        if bases is None:
                            sums = CurvatureSums()
                            sums.add(records)
                            bases = fit_bases(sums, 8, epoch)
                        records = represent_on_bases(records, dict.fromkeys(("0", "2"), "projected"), 8, None, bases)
                    point = f"epoch-{epoch}/{split}"
                    writer.write(records, sample_ids=part, step=epoch, capture_point=point, labels=y[part], lr=lr)
                    model.zero_grad()
            optimizer.zero_grad()  # the weights move between the epochs' passes
            F.cross_entropy(model(x[:TRAIN_N]), y[:TRAIN_N]).backward()
            optimizer.step()


_STORES: dict[str, GradientStore] = {}


def kept_store(kept: str, tmp_path_factory: pytest.TempPathFactory) -> GradientStore:
    """The store of :func:`write_passes` kept ``kept`` (written once per test session)."""
    if kept not in _STORES:
        path = tmp_path_factory.mktemp(f"index-methods-{kept}") / "store"
        write_passes(path, kept)
        _STORES[kept] = open_store(path)
    return _STORES[kept]


@pytest.fixture(params=["exact", "eigenbasis"])
def store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> GradientStore:
    return kept_store(request.param, tmp_path_factory)


@pytest.fixture
def eigenbasis_store(tmp_path_factory: pytest.TempPathFactory) -> GradientStore:
    return kept_store("eigenbasis", tmp_path_factory)


def tops(scores: Any, k: int = K) -> dict[int, tuple[set[int], set[int]]]:
    return {r["sample_id"]: ({i for i, _ in r["proponents"]}, {i for i, _ in r["opponents"]}) for r in scores.top(k)}


def assert_same_where_held(fast: Any, full: Any) -> int:
    """The fast top-k equals the exhaustive one for each test sample whose exhaustive top-k the candidates hold;
    returns how many test samples that was."""
    held = set(fast.row_ids.tolist())
    want, got = tops(full), tops(fast)
    full_top = {r["sample_id"]: r for r in full.top(K)}
    fast_top = {r["sample_id"]: r for r in fast.top(K)}
    compared = 0
    for sid, (pro, opp) in want.items():
        if pro | opp <= held:
            compared += 1
            assert got[sid] == (pro, opp)
            a = sorted(s for _, s in fast_top[sid]["proponents"] + fast_top[sid]["opponents"])
            b = sorted(s for _, s in full_top[sid]["proponents"] + full_top[sid]["opponents"])
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9 * max(abs(x) for x in b))
    return compared


@pytest.mark.parametrize(
    ("kept", "method"),
    [("exact", "kfac"), ("exact", "ekfac"), ("exact", "trak"), ("eigenbasis", "kfac"), ("eigenbasis", "ekfac")],
)  # TRAK's kernel lives on its own sketches: how the index keeps the rows does not change it (one store suffices)
def test_indexed_top_k_equals_the_exhaustive_query_of_the_method(
    tmp_path_factory: pytest.TempPathFactory, kept: str, method: str
) -> None:
    store = kept_store(kept, tmp_path_factory)
    full = store.influence(TRAIN, TEST, method=method)
    fast = store.influence(TRAIN, TEST, method=method, k=K, candidates=50, index=True)
    assert len(fast.row_ids) < TRAIN_N  # only candidates were scored
    assert list(fast.col_ids) == list(full.col_ids)
    assert assert_same_where_held(fast, full) >= 1


def test_auto_top_k_is_ekfac_through_the_index(store: GradientStore) -> None:
    full = store.influence(TRAIN, TEST, method="ekfac")
    fast = store.influence(TRAIN, TEST, method="auto", k=K, index=True, candidates=50)  # the default: 1,600, all rows
    assert len(fast.row_ids) < TRAIN_N
    assert assert_same_where_held(fast, full) >= 1


def test_a_pass_too_large_for_the_preconditioned_index_scores_every_row(
    store: GradientStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(index_preconditioned, "MAX_INDEX_BYTES", 1)
    monkeypatch.setattr(index_preconditioned, "_INDEXES", {})  # none kept: one kept is used, whatever its size
    full = store.influence(TRAIN, TEST, method="ekfac")
    fast = store.influence(TRAIN, TEST, method="ekfac", k=K, candidates=50, index=True)
    assert sorted(fast.row_ids.tolist()) == sorted(full.row_ids.tolist())  # every row, not candidates
    assert tops(fast) == tops(full)


def test_recompute_stays_tracin_only(store: GradientStore) -> None:
    with pytest.raises(ValueError, match="recompute="):
        store.influence(TRAIN, TEST, method="ekfac", k=K, recompute=lambda *a: None)


def test_cli_influence_k_through_the_index_prints_the_exhaustive_table(
    eigenbasis_store: GradientStore, capsys: pytest.CaptureFixture[str]
) -> None:
    """``metastore influence --method ekfac --index build`` against ``--index off`` (every row scored), on the passes
    kept on the eigenbasis (on exact factors the candidates miss some top lists: the recall test measures it)."""
    store = eigenbasis_store
    tables = []  # --json: the rows the markdown table is printed from
    for option in ("off", "build"):
        args = ["influence", str(store.path), "-k", "3", "--method", "ekfac", "--index", option, "--json"]
        assert main(args) == 0
        tables.append(capsys.readouterr().out)
    off, built = (json.loads(t) for t in tables)
    assert [r["test_id"] for r in off] == [r["test_id"] for r in built]
    for a, b in zip(off, built):
        assert {p["sample_id"] for p in a["proponents"]} == {p["sample_id"] for p in b["proponents"]}
        assert {p["sample_id"] for p in a["opponents"]} == {p["sample_id"] for p in b["opponents"]}


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_exact_records_are_scored_from_the_kept_rotated_factors_without_a_shard(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """Single-row Kronecker records (``Linear`` layers): the index keeps their rotated factors, whose scores of every
    row are the exhaustive query's, and the candidates are scored from them (the shards' scoring is never called)."""
    store = kept_store("exact", tmp_path_factory)
    full = store.influence(TRAIN, TEST, method=method)
    with monkeypatch.context() as patched:
        patched.setattr(index_methods.curvature, "preconditioned_scores", None)  # a call would raise
        fast = store.influence(TRAIN, TEST, method=method, k=K, candidates=50, index=True)
    assert assert_same_where_held(fast, full) >= 1
    order = store.layers()
    options = {"damping": None, "relative_damping": DEFAULT_RELATIVE_DAMPING, "layers": None}
    fitted = index_preconditioned.fitted_curvature(store, TRAIN[0], method, None)
    key = index_preconditioned.index_key(store, TRAIN[0], method, options, order, DEFAULT_MAX_BYTES)
    opened = index_preconditioned.kept_index(key)
    assert opened is not None and opened.factors is not None
    tested = index_preconditioned.query_side(store, TEST[0], None, fitted, options, order, opened)
    assert tested.blocks is not None
    rows = np.arange(len(opened.sample_ids))
    monkeypatch.setattr(index_factors, "GATHER_ROWS", 7)  # the rows gathered in blocks, the last one short
    got = opened.factors.scores(rows, opened.lr, tested.blocks)  # (N, M) every row of the first pass
    want = store.influence(TRAIN[0], TEST[0], method=method)
    assert list(want.row_ids) == list(opened.sample_ids) and list(want.col_ids) == list(tested.ids)
    np.testing.assert_allclose(got, want.scores, rtol=1e-4, atol=1e-6 * np.abs(want.scores).max())


def test_a_product_quantized_index_gives_the_exhaustive_top_k(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above ``COMPRESS_ABOVE`` (here every pass) the whitened sketches are kept as FAISS PQ codes: the candidates
    from their scan, scored exactly, give the exhaustive top-k where they hold it."""
    pytest.importorskip("faiss")
    monkeypatch.setattr(index_preconditioned, "COMPRESS_ABOVE", 0)
    monkeypatch.setattr(index_preconditioned, "_INDEXES", {})  # not the flat indexes other tests kept
    store = kept_store("exact", tmp_path_factory)
    full = store.influence(TRAIN, TEST, method="ekfac")
    fast = store.influence(TRAIN, TEST, method="ekfac", k=K, candidates=50, index=True)
    kept = list(index_preconditioned._INDEXES.values())
    assert len(kept) == 2 and all(i.codes is not None and i.flat is None for i in kept)
    assert len(fast.row_ids) < TRAIN_N
    assert assert_same_where_held(fast, full) >= 1


def test_rows_of_finds_every_row_of_the_asked_samples() -> None:
    """``WhitenedIndex.rows_of`` (a binary search in the kept sorted ids) against ``np.isin`` over every row, with
    samples held twice and ids not held."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        held = rng.integers(0, 40, int(rng.integers(1, 60)))  # (N,) repeats allowed
        index = index_preconditioned.WhitenedIndex("p", 4, held, np.ones(len(held)), None)
        asked = sorted(set(rng.integers(0, 50, int(rng.integers(0, 20))).tolist()))
        np.testing.assert_array_equal(index.rows_of(asked), np.flatnonzero(np.isin(held, asked)))


def test_the_rank_r_estimates_rank_the_candidates_and_are_exact_at_full_rank(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``KeptFactors.estimates`` with the test blocks' full SVD (rank 24 here) against the exhaustive EK-FAC scores;
    the default rank-4 estimates pick each test sample's candidates (``_refined``: at most ``2 keep`` of the 300
    searched), and the top-k through them is the exhaustive one where they hold it."""
    store = kept_store("exact", tmp_path_factory)
    full = store.influence(TRAIN, TEST, method="ekfac")
    monkeypatch.setattr(index_methods, "REFINE_ABOVE", 0)  # refined however few the candidates
    fast = store.influence(TRAIN, TEST, method="ekfac", k=K, candidates=300, index=True)  # keep: 200 of 300
    assert assert_same_where_held(fast, full) >= 1
    order = store.layers()
    options = {"damping": None, "relative_damping": DEFAULT_RELATIVE_DAMPING, "layers": None}
    fitted = index_preconditioned.fitted_curvature(store, TRAIN[0], "ekfac", None)
    key = index_preconditioned.index_key(store, TRAIN[0], "ekfac", options, order, DEFAULT_MAX_BYTES)
    opened = index_preconditioned.kept_index(key)
    assert opened is not None and opened.factors is not None
    tested = index_preconditioned.query_side(store, TEST[0], None, fitted, options, order, opened)
    assert tested.blocks is not None
    want = store.influence(TRAIN[0], TEST[0], method="ekfac").scores  # (600, 12)
    rows = np.arange(len(opened.sample_ids))
    monkeypatch.setattr(index_factors, "GATHER_ROWS", 7)  # the rows gathered in blocks, the last one short
    monkeypatch.setattr(index_factors, "THREADS_ABOVE", 100)  # and estimated in two threads
    for j, basis in enumerate(index_factors.low_rank(tested.blocks, rank=64)):
        got = opened.factors.estimates(rows, opened.lr, basis)
        np.testing.assert_allclose(got, want[:, j], rtol=1e-4, atol=1e-6 * np.abs(want[:, j]).max())
    searched = opened.search(np.concatenate([tested.sketches, -tested.sketches]), 300)  # (24, 300)
    picked = index_methods._refined(opened, tested, searched, 20, np.zeros(0, np.int64))
    assert len(picked) <= 2 * 20 * len(tested.ids)


def test_the_randomized_low_rank_is_near_the_best_rank_r_approximation() -> None:
    """``index_factors.low_rank`` on blocks wide enough for its randomized path (128 x 129, 128 x 33, as the
    benchmark MLP's) against the SVD's best rank-4 error (Eckart-Young): within 1%, on singular values falling to 1%
    of the largest by the third as the measured test blocks' do; a block narrower than ``R + OVERSAMPLE`` takes
    the SVD itself."""
    rng = np.random.default_rng(3)
    rank = index_factors.REFINE_RANK
    for d_out, d_in in ((128, 129), (128, 33), (6, 40)):
        left = np.linalg.qr(rng.standard_normal((2, 2, d_out, d_out)))[0][..., : min(d_out, d_in)]
        right = np.linalg.qr(rng.standard_normal((2, 2, d_in, d_in)))[0][..., : min(d_out, d_in)]
        values = 0.1 ** np.arange(min(d_out, d_in)) + 1e-4 * rng.random(min(d_out, d_in))  # decaying
        block = (left * values) @ np.swapaxes(right, -1, -2)  # (M=2, G=2, d_out, d_in)
        found = index_factors.low_rank({"x": block}, rank)
        best = np.sqrt((np.linalg.svd(block, compute_uv=False)[..., rank:] ** 2).sum(-1))  # (2, 2)
        for j, layers in enumerate(found):
            lo, ro = layers["x"]  # (G, d_out, R), (G, d_in, R)
            error = np.linalg.norm(block[j] - lo @ np.swapaxes(ro, -1, -2), axis=(-2, -1))  # (G,)
            assert np.all(error <= 1.01 * best[j] + 1e-6 * np.abs(block[j]).max()), (error, best[j])


def test_the_default_candidates_grow_with_the_pass() -> None:
    """``candidates=None``: 48 ``max(4k, 50)`` (2,400 for ``k = 10``) or one row in 40 of the pass, the larger; a
    count given is kept."""
    assert index_methods.candidate_count(10, None, 1_000) == 2_400
    assert index_methods.candidate_count(10, None, 100_000) == 2_500
    assert index_methods.candidate_count(10, None, 1_000_000) == 25_000
    assert index_methods.candidate_count(10, 77, 1_000_000) == 77


def _estimates_in_child(factors: Any, basis: Any) -> np.ndarray:
    return factors.estimates(np.arange(len(factors.rows)), np.ones(len(factors.rows)), basis)


def test_threaded_estimates_run_in_a_forked_child_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimates' thread pool is the process's own: a child forked after the parent used both of its threads
    gets its own pool (the parent's threads do not exist there: one pool shared across the fork leaves the child's
    work queued forever) and the same numbers as a reference of plain products."""
    import multiprocessing

    monkeypatch.setattr(index_factors, "THREADS_ABOVE", 10)
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((200_000, 7)).astype(np.float32)  # enough that both threads start
    factors = index_factors.KeptFactors(["a"], rows, {"a": (1, 3, 4)})
    (basis,) = index_factors.low_rank({"a": rng.standard_normal((1, 1, 3, 4))}, rank=2)
    left, right = basis["a"]  # (1, 3, 2), (1, 4, 2)
    want = np.einsum("nr,nr->n", rows[:, :3].astype(np.float64) @ left[0], rows[:, 3:] @ right[0])  # (N,)
    np.testing.assert_allclose(_estimates_in_child(factors, basis), want, rtol=1e-4, atol=1e-5)  # the parent's pool
    with multiprocessing.get_context("fork").Pool(1) as pool:
        got = pool.apply_async(_estimates_in_child, (factors, basis)).get(timeout=30)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
