"""The ``"reduced"`` index kind (rows wider than ``REDUCE_ABOVE``): candidates from the rows projected on their
principal directions, rescored exactly on the full rows; checked against the exhaustive scan of the same scores.

Seeded data of low effective rank (as per-sample gradients are); top-k is compared by score against the
exhaustive k-th score (no order among equal scores, no ``==`` on floats). The store-level cases reuse
tests/store_queries/test_vector_index.py's store (2 layers x 16^2 = 512 numbers a row).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_vector_index import TEST, TRAIN, K, assert_same_top, base, damage, store

from metastore_plugins.cli import main
from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.analysis import vector_index as vi
from metastore_plugins.core.analysis import vector_search as vs
from metastore_plugins.core.store.vectors import vector_files

__all__ = ["base", "store"]  # the fixtures: a copy of a module-scoped store per test

faiss = pytest.importorskip("faiss")


def low_rank(rows: int, width: int, seed: int, rank: int = 24) -> np.ndarray:
    """``(rows, width)`` float32: 32 clusters in a ``rank``-dim subspace, some isotropic noise, log-normal norms."""
    basis_rng, rng = np.random.default_rng(0), np.random.default_rng(seed + 1)
    basis = basis_rng.standard_normal((rank, width)) / np.sqrt(width)  # (rank, width)
    centres = basis_rng.standard_normal((32, rank))  # (32, rank)
    z = centres[rng.integers(0, 32, rows)] + 0.7 * rng.standard_normal((rows, rank))  # (rows, rank)
    noise = 0.35 * np.sqrt(rank / width) * rng.standard_normal((rows, width))  # (rows, width)
    return ((z @ basis + noise) * rng.lognormal(0.0, 0.5, (rows, 1))).astype(np.float32)


def test_choose_plan_reduces_wide_rows_only() -> None:
    assert vs.choose_plan(1_000_000, 3456, True) == vs.Plan("reduced", reduced=64, candidates=256)
    assert vs.choose_plan(1_000_000, 64, True).kind == "ivf"
    assert vs.choose_plan(2_000, 3456, True) == vs.Plan()  # 6.9 million numbers: a flat scan
    assert vs.choose_plan(1_000_000, 3456, False) == vs.Plan()


def test_reduced_candidates_rescored_give_the_exhaustive_top_10(tmp_path: Path) -> None:
    """4,000 rows of 512 numbers, learning rates that differ by row, read through a memory map: recall@10 >= 0.95
    and, after the exact rescoring, every reported row scores at least the exhaustive 10th in >= 95% of queries."""
    rows, width = 4_000, 512
    np.save(tmp_path / "rows.npy", low_rank(rows, width, 0))
    vectors = np.load(tmp_path / "rows.npy", mmap_mode="r")  # (N, D), not read whole by the build
    lr = np.random.default_rng(2).uniform(0.05, 0.2, rows)  # (N,)
    queries = low_rank(40, width, 1)  # (M, D)
    plan = vs.Plan("reduced", reduced=24, candidates=100)
    ann = vs.build_reduced(vectors, lr, plan, faiss, sample=1_000, block=512)
    reduced = vs.VectorIndex("cp", 16, np.arange(rows), lr, vectors, plan, ann)
    exact = (np.asarray(vectors, np.float64) * lr[:, None]) @ queries.astype(np.float64).T  # (N, M)
    tenth = -np.sort(-exact, axis=0)[9]  # (M,)
    threads = faiss.omp_get_max_threads()
    found = reduced.search(queries, 10)  # (M, 10)
    assert found.shape == (40, 10)
    truth = [set(np.flatnonzero(exact[:, j] >= tenth[j]).tolist()) for j in range(40)]
    recall = np.mean([len(t & set(f.tolist())) / 10 for t, f in zip(truth, found)])
    assert recall >= 0.95
    scale = np.abs(tenth) * 1e-5
    whole = [bool(np.all(exact[f, j] >= tenth[j] - scale[j])) for j, f in enumerate(found)]
    assert np.mean(whole) >= 0.95
    single = [reduced.search(q[None], 10)[0] for q in queries[:5]]  # one query at a time: FAISS on one thread
    assert np.mean([np.all(exact[f, j] >= tenth[j] - scale[j]) for j, f in enumerate(single)]) >= 0.8
    assert faiss.omp_get_max_threads() == threads  # its thread count given back
    ann_bytes = faiss.serialize_index(ann).nbytes
    assert ann_bytes < vectors.nbytes / 10  # 24 of 512 numbers a row, plus the projection


def test_store_reduced_plan_top_k_is_the_exhaustive_one_and_inspect_states_it(
    store: GradientStore, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = vs.Plan("reduced", reduced=16, candidates=60)
    opened = vi.open_index(store, TRAIN, plan=plan)
    assert opened is not None and opened.plan == plan
    assert_same_top(store.influence(TRAIN, TEST, k=K), store.influence(TRAIN, TEST))
    again = vi.open_index(store, TRAIN)  # the kept plan and file are reused
    assert again is not None and again.plan == plan and again.rebuilt == []
    assert store.verify() == []
    assert main(["inspect", str(store.path)]) == 0
    assert "reduced (16 principal directions, 60 candidates rescored)" in capsys.readouterr().out


@pytest.mark.parametrize("harm", ["damaged", "missing"])
def test_damaged_or_missing_reduced_file_is_said_then_rebuilt(store: GradientStore, harm: str) -> None:
    vi.open_index(store, TRAIN, plan=vs.Plan("reduced", reduced=16, candidates=60))
    victim = sorted((store.path / vector_files.FOLDER).glob("ann-*"))[0]  # the projection and the reduced rows
    damage(victim) if harm == "damaged" else victim.unlink()
    problems = store.verify()
    assert len(problems) == 1 and victim.name in problems[0] and "\n" not in problems[0]
    with pytest.warns(UserWarning) as caught:
        fast = store.influence(TRAIN, TEST, k=K)
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    assert_same_top(fast, store.influence(TRAIN, TEST))
    assert store.verify() == [] and victim.exists()  # rebuilt and kept


def test_row_stack_reads_the_rows_of_its_parts_as_their_concatenation() -> None:
    rng = np.random.default_rng(3)
    parts = [rng.standard_normal((n, 6)).astype(np.float32) for n in (5, 0, 9, 3)]
    whole, stack = np.concatenate(parts), vs.RowStack(parts, 6)
    assert stack.shape == whole.shape and len(stack) == 17 and stack.nbytes == whole.nbytes
    rows = np.array([16, 0, 5, 4, 13, 5])  # unsorted, repeated, across parts
    np.testing.assert_array_equal(stack[rows], whole[rows])
    np.testing.assert_array_equal(stack[3:15], whole[3:15])
    m = rng.standard_normal((6, 2)).astype(np.float32)
    np.testing.assert_allclose(stack @ m, whole @ m, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(vs.row_norms(stack, block=4), np.linalg.norm(whole, axis=1), rtol=1e-6)
