"""Sketches kept in ``<store>/sketches/``: equal to fresh ones and to the projections of torch.func
gradients, recomputed when the store grows or the file is damaged, never needed to answer.

References: the sketch maths applied to ``torch.func`` per-sample gradients kept during training
(:func:`runcases.expected_sketch`), and the same query with ``cache=False``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from runcases import Run, expected_sketch, loss_fn, make_data, make_model, occurrences, per_sample_ce, sum_by_id, train
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.analysis import sketches as sketches_module
from metastore_plugins.core.training.passes import capture_step
from metastore_plugins.testing import reference_per_sample_gradients

DIM, SEED, TOL = 4, 3, 1e-5


def rel(actual: np.ndarray | Tensor, expected: np.ndarray | Tensor) -> float:
    a, e = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    assert a.shape == e.shape, (a.shape, e.shape)
    return float((a - e).abs().max() / e.abs().max().clamp_min(1e-30))


def assert_recomputed(actual: np.ndarray, expected: np.ndarray) -> None:
    """Two computations of the same sketches (or of scores from them) agree up to fp32 round-off.

    Not bit for bit: that would hold only while both ran the same kernels in the same summation order
    (BLAS, threads, memory alignment). Values read back from the cache are compared exactly, with what was
    computed and written.
    """
    np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-6 * float(np.abs(expected).max()))


def reference_sketches(grads: list[dict[str, Tensor]], layers: list[str]) -> Tensor:
    """``(N, DIM^2)`` summed sketches of reference gradients."""
    return torch.stack([sum(expected_sketch(g, layer, DIM, SEED) for layer in layers) for g in grads])


@pytest.fixture
def run(tmp_path: Path) -> Run:
    return train(tmp_path / "store")


def cache_files(store: GradientStore) -> list[Path]:
    return sorted((store.path / "sketches").glob("*.safetensors"))


def store_files(store: GradientStore) -> dict[str, str]:
    """sha256 of every shard and manifest: the cache must never change them."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(store.path.iterdir()) if p.is_file()}


@contextmanager
def no_computing(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Computing sketches fails inside: whatever answers comes from the cache."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the sketches were recomputed instead of read from the cache")

    with monkeypatch.context() as patch:
        patch.setattr(sketches_module, "compute_sketches", refuse)
        yield


def from_cache_only(store: GradientStore, monkeypatch: pytest.MonkeyPatch) -> np.ndarray:
    with no_computing(monkeypatch):
        return store.sketches("train", DIM, SEED)


def test_cached_sketches_equal_fresh_ones_and_the_reference(run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    store, before = run.store, store_files(run.store)
    expected = reference_sketches([g for _, _, g, _ in occurrences(run)], store.layers())
    fresh = store.sketches("train", DIM, SEED, cache=False)
    assert not (store.path / "sketches").exists()  # cache=False writes nothing
    first = store.sketches("train", DIM, SEED)  # computes and keeps
    (path,) = cache_files(store)
    cached = from_cache_only(open_store(store.path), monkeypatch)
    assert rel(fresh, expected) <= TOL and np.array_equal(cached, first)  # the cache holds what was computed
    assert_recomputed(first, fresh)
    with safe_open(str(path), framework="pt") as handle:
        assert handle.get_tensor("sketch").dtype == torch.float32
        assert np.array_equal(handle.get_tensor("sample_id").numpy(), store.sample_ids("train"))
        assert handle.metadata()["capture_point"] == "train" and json.loads(handle.metadata()["layers"]) == sorted(
            store.layers()
        )
    assert store.build_sketches("train", DIM, SEED) == path  # already sound: kept
    assert store_files(store) == before  # shards and manifests untouched
    assert store.verify() == [] and open_store(store.path).verify() == []
    # other dims, seeds and layer sets get files of their own; filtered queries do not use the cache
    some = store.sketches("train", DIM, SEED, layers=["0", "3"])
    assert rel(some, reference_sketches([g for _, _, g, _ in occurrences(run)], ["0", "3"])) <= TOL
    assert rel(store.sketches("train", DIM, SEED, steps=(0, 1)), expected[:12]) <= TOL
    assert len(cache_files(store)) == 2


def test_sketched_influence_from_the_cache(run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    store = run.store
    grads = [(sid, g, lr) for _, sid, g, lr in occurrences(run)]
    sketch = reference_sketches([g for _, g, _ in grads], store.layers()).double()  # (N_occ, k)
    lrs = torch.tensor([lr for _, _, lr in grads], dtype=torch.float64)
    unique, expected = sum_by_id([sid for sid, _, _ in grads], (lrs[:, None] * sketch) @ sketch.T)
    uncached = store.sketched_influence("train", "train", dim=DIM, seed=SEED, cache=False)
    assert store.build_sketches("train", DIM, SEED) is not None
    with no_computing(monkeypatch):
        cached = open_store(store.path).sketched_influence("train", "train", dim=DIM, seed=SEED)
    assert cached.row_ids.tolist() == unique == uncached.row_ids.tolist() and cached.col_ids.tolist() == unique
    assert rel(uncached.scores, expected) <= TOL
    assert_recomputed(cached.scores, uncached.scores)


def test_a_grown_store_recomputes(run: Run) -> None:
    store = run.store
    old = store.sketches("train", DIM, SEED)
    (path,) = cache_files(store)
    binding = safe_open(str(path), framework="pt").metadata()["binding"]
    model, (x, y) = make_model(seed=4), make_data()
    ids = torch.tensor([2, 5, 11])
    with StoreWriter(store.path, encoding="fp32") as writer:  # one more batch, after the cache was written
        capture_step(model, lambda: model(x[ids]), y[ids], ids, per_sample_ce, writer, step=99, epoch=2, lr=0.1)
    added = reference_per_sample_gradients(model, loss_fn, {"x": x[ids], "y": y[ids]})
    grown = open_store(store.path)
    assert grown.sample_ids("train").tolist()[-3:] == ids.tolist()
    extra = reference_sketches([{n: g[i] for n, g in added.items()} for i in range(3)], grown.layers())
    new = grown.sketches("train", DIM, SEED)
    assert new.shape == (old.shape[0] + 3, DIM * DIM)
    assert rel(new[-3:], extra) <= TOL
    assert_recomputed(new[:-3], old)
    assert_recomputed(new, grown.sketches("train", DIM, SEED, cache=False))
    assert cache_files(grown) == [path] and safe_open(str(path), framework="pt").metadata()["binding"] != binding
    assert grown.verify() == []


def _sha(*tensors: Tensor) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(np.ascontiguousarray(tensor.numpy()))
    return digest.hexdigest()


def _rewrite(path: Path, sketch: Tensor) -> None:
    """A well-formed file with the original metadata and a checksum that fits ``sketch``: only the
    dtype, shape and finiteness checks can refuse it."""
    with safe_open(str(path), framework="pt") as handle:
        meta, ids = handle.metadata(), handle.get_tensor("sample_id")
    save_file({"sketch": sketch, "sample_id": ids}, str(path), metadata={**meta, "checksum": _sha(ids, sketch)})


def _damage(path: Path, how: str, outside: Path) -> None:
    data = path.read_bytes()
    if how == "changed values":
        at = len(data) - 64
        path.write_bytes(data[:at] + np.full(4, 0.5, dtype=np.float32).tobytes() + data[at + 16 :])
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "not safetensors":
        path.write_bytes(b"\x00" * 8 + b"garbage" * 100)
    elif how == "float64":
        with safe_open(str(path), framework="pt") as handle:
            _rewrite(path, handle.get_tensor("sketch").double())
    elif how == "wrong shape":
        with safe_open(str(path), framework="pt") as handle:
            _rewrite(path, handle.get_tensor("sketch")[:-1].clone())
    elif how == "nan":
        with safe_open(str(path), framework="pt") as handle:
            _rewrite(path, torch.full_like(handle.get_tensor("sketch"), float("nan")))
    elif how == "link":
        outside.write_bytes(data)
        path.unlink()
        path.symlink_to(outside)


@pytest.mark.parametrize(
    "how", ["changed values", "truncated", "not safetensors", "float64", "wrong shape", "nan", "link"]
)
def test_a_damaged_cache_file_is_rebuilt(run: Run, how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = run.store
    expected = store.sketches("train", DIM, SEED, cache=False)
    store.build_sketches("train", DIM, SEED)
    (path,) = cache_files(store)
    outside = tmp_path / "elsewhere.safetensors"
    _damage(path, how, outside)
    again = open_store(store.path)
    rebuilt = again.sketches("train", DIM, SEED)
    assert_recomputed(rebuilt, expected)
    assert path.is_file() and not path.is_symlink()  # rewritten, sound
    assert np.array_equal(from_cache_only(open_store(store.path), monkeypatch), rebuilt)
    scores = again.sketched_influence("train", "train", dim=DIM, seed=SEED).scores
    assert_recomputed(scores, again.sketched_influence("train", "train", dim=DIM, seed=SEED, cache=False).scores)
    if how == "link":
        assert not outside.is_symlink() and outside.stat().st_size > 0  # the link was replaced, its target left alone


def _writable(directory: Path) -> bool:
    probe = directory / ".probe"
    try:
        probe.write_bytes(b"")
    except OSError:
        return False
    probe.unlink()
    return True


@contextmanager
def read_only(*directories: Path) -> Iterator[None]:
    """Directories nobody can write to: mode 555, and the immutable attribute where root ignores modes."""
    modes = {d: d.stat().st_mode for d in directories}
    locked: list[Path] = []
    try:
        for directory in directories:
            directory.chmod(0o555)
            if _writable(directory):  # root
                done = subprocess.run(["chattr", "+i", str(directory)], capture_output=True, check=False)
                if done.returncode != 0 or _writable(directory):
                    pytest.skip("cannot make a directory read-only here (root without chattr)")
                locked.append(directory)
        yield
    finally:
        for directory in locked:
            subprocess.run(["chattr", "-i", str(directory)], capture_output=True, check=False)
        for directory, mode in modes.items():
            os.chmod(directory, mode)


def test_a_read_only_store_still_answers(run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    store = run.store
    expected = reference_sketches([g for _, _, g, _ in occurrences(run)], store.layers())
    with read_only(store.path):
        assert rel(store.sketches("train", DIM, SEED), expected) <= TOL
        scores = store.sketched_influence("train", "train", dim=DIM, seed=SEED).scores
        assert store.build_sketches("train", DIM, SEED) is None
        assert not (store.path / "sketches").exists()
    assert_recomputed(scores, store.sketched_influence("train", "train", dim=DIM, seed=SEED, cache=False).scores)
    path = store.build_sketches("train", DIM, SEED)
    assert path is not None
    path.write_bytes(path.read_bytes()[:100])  # damaged, and cannot be rewritten: computed in memory
    with read_only(store.path, path.parent):
        assert rel(store.sketches("train", DIM, SEED), expected) <= TOL
        assert path.stat().st_size == 100
    store.build_sketches("train", DIM, SEED)
    with read_only(store.path, path.parent):  # a sound cache in a read-only store is read
        assert rel(from_cache_only(store, monkeypatch), expected) <= TOL


def test_kernel_influence_against_an_explicit_inverse_of_reference_sketches(run: Run) -> None:
    """``sum lr S (S^T S + lambda I)^-1 T^T`` with ``S`` from torch.func gradients; the inverse is taken explicitly.

    Tolerance 1e-4: the solve multiplies the fp32 sketches' round-off by the kernel's condition number (the
    ridge, half the mean eigenvalue, keeps it small)."""
    store = run.store
    grads = [(sid, g, lr) for _, sid, g, lr in occurrences(run)]
    sketch = reference_sketches([g for _, g, _ in grads], store.layers()).double()  # (N_occ, k)
    lrs = torch.tensor([lr for _, _, lr in grads], dtype=torch.float64)
    gram = sketch.T @ sketch  # (k, k)
    ridge = 0.5 * torch.trace(gram) / gram.shape[0]
    kernel = sketch @ torch.linalg.inv(gram + ridge * torch.eye(gram.shape[0], dtype=torch.float64)) @ sketch.T
    unique, expected = sum_by_id([sid for sid, _, _ in grads], lrs[:, None] * kernel)
    got = store.kernel_influence("train", "train", dim=DIM, seed=SEED, regularization=0.5, cache=False)
    assert got.row_ids.tolist() == unique and got.col_ids.tolist() == unique
    assert rel(got.scores, expected) <= 1e-4
    # a ridge that dwarfs every eigenvalue leaves plain sketched TracIn, divided by the ridge
    large = store.kernel_influence("train", "train", dim=DIM, seed=SEED, regularization=1e8)
    plain = store.sketched_influence("train", "train", dim=DIM, seed=SEED)
    mean_eigenvalue = float(torch.trace(gram)) / gram.shape[0]
    assert rel(large.scores * 1e8 * mean_eigenvalue, plain.scores) <= 1e-4
    for bad in (0.0, -1.0, True, "1"):
        with pytest.raises(ValueError, match="regularization must be a positive number"):
            store.kernel_influence("train", "train", dim=DIM, seed=SEED, regularization=bad)  # type: ignore[arg-type]
