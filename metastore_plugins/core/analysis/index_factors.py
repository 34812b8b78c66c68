"""Exact K-FAC / EK-FAC scores of a train pass's candidates from its rotated factors, kept in memory: no shard read.

Where every training record of a pass is a Kronecker record with one row per sample (an MLP's ``Linear`` layers:
``g_i = d_i a_i^T``), its gradient in the curvature's eigenbasis is rank one, ``u_i v_i^T`` with ``u_i = Q_D^T d_i``
and ``v_i = Q_A^T a_i'``, and the preconditioned score against a test sample is

    ``lr_i sum_layers sum_g u_i,g^T [X_j,g / (Lambda_g + delta)] v_i,g``

with ``X_j = Q_D^T G_j Q_A`` the test gradient rotated alike (any records: its rows summed). Keeping ``u_i, v_i``
(``sum G (d_out + d_in')`` float32 numbers a row: 557 on the benchmark's MLP 32-128-128-10, where a ``32 x 32``
sketch per layer holds 3,072) scores a candidate with ``sum G d_out d_in'`` products, where
:func:`.curvature.preconditioned_scores` reads every shard holding one (0.25 s of a 0.56 s indexed query at 10^5
rows, before). The numbers are the exhaustive query's up to float32 rounding (the factors and their products:
about 1e-6 relative; the exhaustive query works in float64).

The test blocks ``X_j / (Lambda + delta)`` are nearly low rank, so their best rank-:data:`REFINE_RANK`
approximations ``L R^T`` rank many candidates cheaply first (:meth:`KeptFactors.estimates`: ``R (d_out + d_in')``
products a row and layer) and only the best of them are scored exactly.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from metastore_plugins.core.ops._common import chunks
from metastore_plugins.core.ops.curvature import LayerCurvature, augmented_prefix, layer_groups
from metastore_plugins.core.ops.curvature_rotated import rotated, sample_chunk
from metastore_plugins.core.records import LayerRecord

Curvature = dict[str, LayerCurvature]


#: Rows gathered at a time by :meth:`KeptFactors.scores` and :meth:`~KeptFactors.estimates`: their products then
#: read the gathered rows from the cache, not the memory (measured: the estimates of 38,400 rows of 10^6, 17 ms in
#: blocks of 1,024 against 41 ms gathered at once; 256: 20 ms, 4,096: 22 ms).
GATHER_ROWS = 1024
#: From this many rows the estimates run in :data:`THREADS` threads (numpy's gathers and products release the GIL;
#: 76,800 rows of 10^6: 19-26 ms against 33 ms on one, load average 1.8).
THREADS_ABOVE, THREADS = 16_384, 2
#: The estimates' threads, per process (a pool's threads are not carried into a forked child).
_POOLS: dict[int, ThreadPoolExecutor] = {}


def _pool() -> ThreadPoolExecutor:
    pool = _POOLS.get(os.getpid())
    if pool is None:
        pool = _POOLS[os.getpid()] = ThreadPoolExecutor(THREADS)
    return pool


@dataclass
class KeptFactors:
    """A train pass's rotated factors, in its index's row order.

    Attributes:
        order: the layers, in the column order of ``rows``.
        rows: ``(N, W)`` float32: per layer ``u_i`` ``(G d_out)`` then ``v_i`` ``(G d_in')``.
        shapes: layer -> ``(G, d_out, d_in')``.
    """

    order: list[str]
    rows: np.ndarray
    shapes: dict[str, tuple[int, int, int]]

    def scores(self, rows: np.ndarray, lr: np.ndarray, tests: dict[str, np.ndarray]) -> np.ndarray:
        """``(n, M)`` exact scores of these rows (``lr`` their rates) against :func:`query_blocks` (float32
        products, float64 sums over the layers)."""
        count = len(next(iter(tests.values()))) if tests else 0
        out = np.zeros((len(rows), count))  # (n, M) float64
        blocks = {layer: block.astype(np.float32) for layer, block in tests.items()}  # (M, G, d_out, d_in')
        for lo, hi in chunks(len(rows), GATHER_ROWS):
            for layer, u, v in self._split(rows[lo:hi]):
                for j, block in enumerate(blocks[layer]):  # (G, d_out, d_in')
                    for g in range(block.shape[0]):  # float32 products
                        out[lo:hi, j] += np.einsum("no,no->n", v[:, g] @ block[g].T, u[:, g])
        return out * lr[:, None]

    def estimates(
        self, rows: np.ndarray, lr: np.ndarray, basis: dict[str, tuple[np.ndarray, np.ndarray]]
    ) -> np.ndarray:
        """``(n,)`` the scores of these rows against one test sample whose blocks are replaced by their best rank
        ``R`` approximations ``L R^T`` (:func:`low_rank`): ``R (d_out + d_in')`` products a row and layer, not
        ``d_out d_in'``. From :data:`THREADS_ABOVE` rows, in :data:`THREADS` threads (halves of ``rows``)."""
        if len(rows) >= THREADS_ABOVE:
            parts = np.array_split(np.arange(len(rows)), THREADS)
            done = [_pool().submit(self._estimates, rows[part], lr[part], basis) for part in parts]
            return np.concatenate([d.result() for d in done])
        return self._estimates(rows, lr, basis)

    def _estimates(
        self, rows: np.ndarray, lr: np.ndarray, basis: dict[str, tuple[np.ndarray, np.ndarray]]
    ) -> np.ndarray:
        out = np.zeros(len(rows))  # (n,)
        for lo, hi in chunks(len(rows), GATHER_ROWS):
            for layer, u, v in self._split(rows[lo:hi]):
                left, right = basis[layer]  # (G, d_out, R), (G, d_in', R)
                for g in range(left.shape[0]):
                    out[lo:hi] += np.einsum("nr,nr->n", u[:, g] @ left[g], v[:, g] @ right[g])
        return out * lr

    def _split(self, rows: np.ndarray) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """``(layer, u (n, G, d_out), v (n, G, d_in'))`` float32 of these rows, per layer (views of one gather)."""
        picked = self.rows[rows]  # (n, W) float32
        found, start = [], 0
        for layer in self.order:
            groups, d_out, d_in = self.shapes[layer]
            u = picked[:, start : start + groups * d_out].reshape(-1, groups, d_out)
            start += groups * d_out
            v = picked[:, start : start + groups * d_in].reshape(-1, groups, d_in)
            start += groups * d_in
            found.append((layer, u, v))
        return found


def factor_rows(records: Sequence[LayerRecord], fitted: Curvature, order: Sequence[str]) -> np.ndarray | None:
    """``(B, W)`` float32 :attr:`KeptFactors.rows` of one batch, or ``None`` where a layer is not one Kronecker
    record with one row per sample under a Kronecker curvature (its gradient is then not rank one)."""
    groups = layer_groups(records)
    parts: list[Tensor] = []
    for layer in order:
        group, c = groups.get(layer, []), fitted.get(layer)
        if len(group) != 1 or c is None or c.kind != "outer" or group[0].kind != "outer":
            return None
        record = group[0]
        sample = record.tensors["sample"].long()  # (R,)
        if not torch.equal(sample, torch.arange(record.batch_size)):
            return None
        assert c.q_in is not None and c.q_out is not None
        v = torch.einsum("rgi,gij->rgj", augmented_prefix(record), c.q_in)  # (B, G, d_in')
        u = torch.einsum("rgo,gop->rgp", record.tensors["suffix"].double(), c.q_out)  # (B, G, d_out)
        parts += [u.flatten(1), v.flatten(1)]
    return torch.cat(parts, 1).float().numpy()


def factor_shapes(fitted: Curvature, order: Sequence[str]) -> dict[str, tuple[int, int, int]]:
    """Layer -> ``(G, d_out, d_in')`` of its eigenvalues."""
    return {layer: tuple(fitted[layer].eigenvalues.shape) for layer in order}  # type: ignore[misc]


def query_rotations(
    records: Sequence[LayerRecord], fitted: Curvature, order: Sequence[str], max_bytes: int
) -> dict[str, Tensor] | None:
    """Layer -> ``(B, G, d_out, d_in')`` float64 ``X_j = Q_D^T G_j Q_A`` of one test batch (any records of a Kronecker
    layer), or ``None`` where a layer's curvature is not Kronecker."""
    out: dict[str, Tensor] = {}
    groups = layer_groups(records)
    for layer in order:
        c = fitted.get(layer)
        if c is None or c.kind != "outer" or layer not in groups:
            return None
        size = groups[layer][0].batch_size
        out[layer] = torch.cat(
            [rotated(groups[layer], c, lo, hi) for lo, hi in chunks(size, sample_chunk(c, max_bytes))]
        )
    return out


def query_blocks(rotations: dict[str, Tensor], fitted: Curvature, options: dict[str, Any]) -> dict[str, np.ndarray]:
    """Layer -> ``(B, G, d_out, d_in')`` float64 ``X_j / (Lambda + delta)`` of :func:`query_rotations`."""
    out: dict[str, np.ndarray] = {}
    for layer, x in rotations.items():
        c = fitted[layer]
        delta = c.damping(options["damping"], options["relative_damping"])
        out[layer] = (x / (c.eigenvalues + delta)).numpy()
    return out


#: The rank of the test blocks' approximation that ranks a pass's candidates before the exact scores
#: (:meth:`KeptFactors.estimates`). ``1 / (Lambda + delta)`` is nearly low rank (on the benchmark's MLP its singular
#: values fall to 1% of the largest by the third), so at rank 4 the 100 rows of largest and smallest estimate,
#: among 10^5, held every test sample's exact top-10 (rank 2: 97%).
REFINE_RANK = 4


#: Columns beyond the rank the randomized approximation draws, and its power iterations (:func:`low_rank`).
OVERSAMPLE, POWER_STEPS = 4, 2


def low_rank(blocks: dict[str, np.ndarray], rank: int = REFINE_RANK) -> list[dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Per test sample, layer -> ``(L (G, d_out, R), R (G, d_in', R))`` float32 with ``L R^T`` the best rank-``R``
    approximation of its block (the singular values in ``L``): its SVD, or where ``R +`` :data:`OVERSAMPLE` is below
    both sides, the randomized one (a seeded range of ``R +`` :data:`OVERSAMPLE` columns refined by
    :data:`POWER_STEPS` power iterations, then the SVD of the block on it: the benchmark MLP's three blocks in 0.65 ms,
    not 1.9 ms; its error within 0.02% of the SVD's there, within 1% in ``test_vector_index_methods.py``)."""
    found: list[dict[str, tuple[np.ndarray, np.ndarray]]] = []
    for layer, block in blocks.items():  # (M, G, d_out, d_in')
        left, values, right = _svd(block.astype(np.float32), rank)
        r = min(rank, values.shape[-1])
        pairs = zip(left[..., :r] * values[..., None, :r], np.swapaxes(right[..., :r, :], -1, -2))
        for j, (lo, ro) in enumerate(pairs):
            if j == len(found):
                found.append({})
            found[j][layer] = (np.ascontiguousarray(lo), np.ascontiguousarray(ro))
    return found


def _svd(block: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(U (..., d_out, p), S (..., p), V^T (..., p, d_in'))`` of ``block`` ``(..., d_out, d_in')``: its SVD, or the
    randomized one of :func:`low_rank` (``p = rank +`` :data:`OVERSAMPLE`)."""
    width = rank + OVERSAMPLE
    if width >= min(block.shape[-2:]):
        return np.linalg.svd(block, full_matrices=False)
    draw = np.random.default_rng(0).standard_normal((block.shape[-1], width)).astype(np.float32)  # (d_in', p)
    transposed = np.swapaxes(block, -1, -2)  # (..., d_in', d_out)
    basis = np.linalg.qr(block @ draw)[0]  # (..., d_out, p)
    for _ in range(POWER_STEPS):
        basis = np.linalg.qr(block @ np.linalg.qr(transposed @ basis)[0])[0]  # (..., d_out, p)
    small, values, right = np.linalg.svd(np.swapaxes(basis, -1, -2) @ block, full_matrices=False)  # (..., p, p)
    return basis @ small, values, right
