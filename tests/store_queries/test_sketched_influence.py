"""Sketched influence ranks training samples like the exact influence computed from torch.func gradients."""

from __future__ import annotations

import numpy as np
import torch
from runcases import Run, sum_by_id


def _ranks(values: np.ndarray) -> np.ndarray:
    return np.argsort(np.argsort(values, kind="stable"), kind="stable").astype(float)


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(_ranks(a), _ranks(b))[0, 1])


def _reference(run: Run) -> tuple[np.ndarray, np.ndarray]:
    """Occurrence ids and lr-weighted flat per-sample gradients, from torch.func only."""
    ids = torch.cat(run.ids).numpy()
    flat = torch.cat([torch.cat([g.reshape(g.shape[0], -1) for g in ref.values()], 1) for ref in run.refs])  # (N, P)
    lrs = torch.cat([torch.full((len(i),), lr) for i, lr in zip(run.ids, run.lrs)])
    return ids, (flat.double(), lrs.double())


def test_sketched_influence_agrees_with_exact_influence(run_a: Run) -> None:
    store = run_a.store
    sketched = store.sketched_influence("train", "train", dim=64, seed=3)
    ids, (flat, lrs) = _reference(run_a)
    occurrence = (lrs[:, None] * flat) @ flat.T  # (N_occ, N_occ): lr_s <g_i(s), g_j(t)>
    unique, exact = sum_by_id(ids.tolist(), occurrence)
    exact = exact.numpy()  # (U, U)
    assert sketched.row_ids.tolist() == unique and sketched.col_ids.tolist() == unique
    correlations = [_spearman(sketched.scores[:, j], exact[:, j]) for j in range(len(unique))]
    assert np.mean(correlations) >= 0.9 and min(correlations) >= 0.7, correlations  # one seed: sampling error
    exact_store = store.influence("train", "train")
    assert np.abs(exact_store.scores - exact).max() <= 1e-5 * np.abs(exact).max()
