"""Projections onto the curvature eigenbasis: what a projected checkpoint pass keeps so that K-FAC still applies.

A seeded random projection ``P_out G_i P_in^T`` keeps inner products (TracIn) but not what a
curvature needs: preconditioning *after* a random projection loses most of its gain. Here the
projection is the top of the layer's K-FAC eigenbasis, fitted at the checkpoint's weights
(:func:`fit_bases`). With ``C = Q_A diag(l_A) Q_A^T`` and ``G = Q_D diag(l_D) Q_D^T``
(:mod:`~metastore_plugins.core.ops.curvature`, eigenvalues largest first), a sample's record is

    ``R_i = Q_D[:, :k_out]^T [W_i | b_i] Q_A[:, :k_in]``    ``(k_out, k_in)``

the gradient's coordinates in the top block of the Kronecker eigenbasis, formed from the rotated
factors ``(D Q_D)^T (A' Q_A)`` (no gradient is built). A layer whose curvature is a full Fisher
``F = Q diag(l) Q^T`` (dense records) keeps ``Q[:, :k^2]^T g_i`` as ``(k, k)``. In that basis the
curvature is diagonal, so the preconditioned inner product is a division,

    ``<g_i, (F + delta I)^-1 g_j>  ~  sum_ab R_i[a, b] R_j[a, b] / (Lambda[a, b] + delta)``,

with K-FAC's ``Lambda = l_D l_A^T`` (kept in the record) or EK-FAC's ``(1/N) sum_i R_i^2`` over the
training pass (exact in the block: the records are the rotated gradients), and ``delta`` a fraction
of the mean K-FAC eigenvalue of the *whole* layer (kept in the record). The directions left out
have small eigenvalues: each weighs ``l / (l + delta)`` in the preconditioned product, little
against the ``~1`` of a kept one.

An embedding layer (``W_i`` ``(V, d)``, one-hot inputs, so ``C`` is the diagonal of token
frequencies) keeps ``R_i = P W_i Q_D``: the seeded Gaussian ``P`` ``(k, V)`` of its seeded sketch on
the vocabulary side (the top of a diagonal ``C`` would keep only the most frequent tokens, and a
sample's gradient lives on its own tokens) and the eigenbasis on the other; its ``Lambda`` is
``diag(P C P^T) l_D^T`` for K-FAC and ``(1/N) sum_i R_i^2`` for EK-FAC, an estimate of the curvature's
diagonal in that basis. A dense layer whose Fisher is kept diagonal (above 2,048 parameters) keeps its
``k^2`` coordinates of largest variance. Layers this does not fit keep the seeded projection: weights
split into groups (grouped convolutions) and tied layers.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from metastore_plugins.core.ops._common import rebuild_outer
from metastore_plugins.core.ops.cost import TENSOR_OVERHEAD_BYTES
from metastore_plugins.core.ops.curvature import CurvatureSums, LayerCurvature, LayerSums
from metastore_plugins.core.ops.curvature_rotated import rotated
from metastore_plugins.core.ops.influence import total_sq_norms
from metastore_plugins.core.ops.represent import by_layer, represent, shared_layers, summary_record
from metastore_plugins.core.ops.sketch import Projections, projection
from metastore_plugins.core.records import EIGENBASIS_TENSORS, PROJECTION_SEED, LayerRecord, Representation

_F64, _F32 = torch.float64, torch.float32


@dataclass(frozen=True)
class EigenBasis:
    """One layer's kept eigenbasis: ``curvature`` truncated to its top block, fitted at checkpoint ``step``.

    ``curvature.q_in`` ``(1, d_in', k_in)`` and ``q_out`` ``(1, d_out, k_out)`` (Kronecker), or
    ``q_in`` ``(P, k_out k_in)`` (full Fisher); ``curvature.eigenvalues`` the block's K-FAC
    eigenvalues; ``mean_eigenvalue`` the mean over the whole layer.
    """

    curvature: LayerCurvature
    mean_eigenvalue: float
    step: int
    block: tuple[int, int]  # (k_out, k_in)

    def truncated(self, k: int) -> EigenBasis:
        """The same basis cut to its top ``min(k_out, k) x min(k_in, k)`` block (itself where that is all of it).

        A record on the cut basis is the top-left block of the record on this one (:func:`truncated_record`):
        Kronecker and embedding layers keep their first columns on each side; a dense layer's ``(K, K)`` block
        keeps the vectors ``a K + b`` for ``a < k_out``, ``b < k_in``.
        """
        k_out, k_in = min(self.block[0], k), min(self.block[1], k)
        if (k_out, k_in) == self.block:
            return self
        c = self.curvature
        assert c.q_in is not None
        if c.kind == "dense":
            kept = (torch.arange(k_out)[:, None] * self.block[1] + torch.arange(k_in)[None, :]).reshape(-1)
            cut = replace(c, q_in=c.q_in[:, kept], eigenvalues=c.eigenvalues.reshape(-1)[kept])
        else:  # outer: (1, d, k) factors, (1, k_out, k_in) values; embedding: (V, k_v), (d, k_d), (k_v, k_d)
            assert c.q_out is not None
            lead = c.eigenvalues.shape[:-2]
            values = c.eigenvalues.reshape(-1, *self.block)[:, :k_out, :k_in].reshape(*lead, k_out, k_in)
            if c.kind == "embedding":  # the block's rows are the vocabulary side
                cut = replace(c, q_in=c.q_in[:, :k_out], q_out=c.q_out[:, :k_in], eigenvalues=values)
            else:
                cut = replace(c, q_in=c.q_in[..., :k_in], q_out=c.q_out[..., :k_out], eigenvalues=values)
        return EigenBasis(cut, self.mean_eigenvalue, self.step, (k_out, k_in))


#: Extra directions and power iterations of the subspace iteration.
_OVERSAMPLE, _POWER_ITERATIONS = 16, 6
#: What one unit of a full float32 ``eigh``'s ``d^3`` costs, in matrix-product flops (one thread; measured on a
#: 2-core AMD EPYC: ``eigh`` of 768 and 1,537 wide 42 and 300 ms, subspace iteration 16 ps a flop).
EIGH_FLOPS_PER_CUBE = 5.5


def subspace_cheaper(d: int, k: int) -> bool:
    """Whether subspace iteration for the top ``k`` of ``d`` eigenpairs, ``(q + 1) (2 d^2 m + 4 d m^2)`` flops with
    ``m = k + p`` (its products and QRs), costs less than a full ``eigh``, :data:`EIGH_FLOPS_PER_CUBE` ``d^3``."""
    m = k + _OVERSAMPLE
    return m < d and (_POWER_ITERATIONS + 1) * (2 * d * d * m + 4 * d * m * m) < EIGH_FLOPS_PER_CUBE * d**3


def _top(values: Tensor, vectors: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest eigenpairs of an ascending ``eigh``: ``(k,)`` values and ``(d, k)`` vectors, largest first."""
    return values[-k:].flip(0).clamp_min(0), vectors[:, -k:].flip(1)


def top_eigenpairs(matrix: Tensor, k: int, rank: int | None = None) -> tuple[Tensor, Tensor]:
    """``(k,)`` largest eigenvalues (largest first) and ``(d, k)`` eigenvectors of a symmetric PSD ``(d, d)`` matrix.

    ``rank``: a bound on the matrix's rank (the per-sample gradients summed into a full Fisher). Below ``k`` only
    the top ``rank`` pairs are computed, and the rest are a seeded orthonormal complement with eigenvalue 0 (what
    they are): a LayerNorm's 768-wide Fisher of 32 samples at ``k = 256``, 20 ms against a 42 ms ``eigh``.

    Seeded subspace iteration (Halko et al. 2011) where it is cheaper (:func:`subspace_cheaper`: the MiniLM's
    385-wide factors at ``k = 16``, 2.0 ms against 8.4), else ``eigh``: ``Y = M^q Omega`` for a Gaussian
    ``(d, k + p)`` ``Omega``, orthonormalised at each step, then the ``eigh`` of the small ``Q^T M Q``:
    ``O(q d^2 (k + p))`` instead of ``O(d^3)``. Computed in float32 on one thread (returned in
    float64): the basis only chooses the directions records are kept on, and a fit of a MiniLM's 46 factors took
    1.6 s in float64 against 0.6 s in float32 on one thread, and 2.4-2.9 s on two (LAPACK's small parallel
    regions contend with the training's threads; under load a single 1,536-wide ``eigh`` took 11 s on two
    threads against 0.8 s on one, docs/benchmarks.md). The eigenvalues of a 385-wide factor agree with float64's to
    3e-7 relative.
    """
    d = matrix.shape[0]
    if rank is not None and rank < min(k, d):
        top, kept = top_eigenpairs(matrix, max(1, rank))  # (r,), (d, r)
        with _one_thread():
            found = kept.float()  # (d, r)
            rest = torch.randn(d, min(k, d) - len(top), generator=torch.Generator().manual_seed(1))  # (d, k - r)
            rest = torch.linalg.qr(rest - found @ (found.T @ rest)).Q  # (d, k - r): orthogonal to the top r
        return torch.cat([top, top.new_zeros(rest.shape[1])]), torch.cat([kept, rest.to(_F64)], 1)
    with _one_thread():
        matrix = matrix.to(_F32)
        if not subspace_cheaper(d, k):
            values, vectors = torch.linalg.eigh(matrix)  # (d,), (d, d)
            top, kept = _top(values, vectors, min(k, d))
        else:
            omega = torch.randn(d, k + _OVERSAMPLE, generator=torch.Generator().manual_seed(0))  # (d, k + p)
            q = torch.linalg.qr(matrix @ omega).Q  # (d, k + p)
            for _ in range(_POWER_ITERATIONS):
                q = torch.linalg.qr(matrix @ q).Q
            values, small = torch.linalg.eigh(q.T @ matrix @ q)  # (k + p,), (k + p, k + p)
            top, kept = _top(values, q @ small, k)
    return top.to(_F64), kept.to(_F64)


@contextmanager
def _one_thread() -> Iterator[None]:
    """torch's intra-op threads set to one while the block runs (restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def fit_bases(sums: CurvatureSums, k: int, step: int) -> dict[str, EigenBasis]:
    """Each layer's top ``k x k`` eigenbasis from K-FAC sums (layers it cannot serve are left out).

    Kronecker layers (one weight group): ``k_in = min(k, d_in')``, ``k_out = min(k, d_out)``; full-Fisher
    layers with at least ``k^2`` parameters: the top ``k^2`` eigenvectors, as a ``(k, k)`` block.
    """
    out: dict[str, EigenBasis] = {}
    for layer, layer_sums in sums.layers.items():
        first, second = layer_sums.covariances()
        if layer_sums.is_embedding and second is not None:
            out[layer] = _embedding_basis(layer, layer_sums, first, second, k, step)
        elif second is not None:
            if first.shape[0] != 1:
                continue  # grouped weights keep the seeded projection
            inputs, outputs = first[0].to(_F64), second[0].to(_F64)  # (d_in', d_in'), (d_out, d_out)
            mean = float(inputs.diagonal().mean() * outputs.diagonal().mean())  # traces: the mean eigenvalue
            (top_in, vec_in), (top_out, vec_out) = top_eigenpairs(inputs, k), top_eigenpairs(outputs, k)
            values = top_out[:, None] * top_in[None, :]  # (k_out, k_in)
            kept = LayerCurvature("outer", layer_sums.params, vec_in[None], vec_out[None], values[None],
                                  layer_sums.factored_samples, layer_sums.layout)  # fmt: skip
            out[layer] = EigenBasis(kept, mean, step, (len(top_out), len(top_in)))
        elif first.dim() == 2 and first.shape[0] >= k * k:
            top, kept_vectors = top_eigenpairs(first, k * k, layer_sums.dense_samples)  # (k^2,), (P, k^2)
            kept = LayerCurvature("dense", layer_sums.params, kept_vectors, None, top, layer_sums.dense_samples)
            out[layer] = EigenBasis(kept, float(first.diagonal().mean()), step, (k, k))
        elif first.dim() == 1 and first.shape[0] >= k * k:  # a diagonal Fisher: its largest coordinates
            top, index = first.topk(k * k)  # (k^2,), (k^2,)
            selection = torch.zeros(first.shape[0], k * k, dtype=first.dtype)  # (P, k^2)
            selection[index, torch.arange(k * k)] = 1.0
            kept = LayerCurvature("dense", layer_sums.params, selection, None, top, layer_sums.dense_samples)
            out[layer] = EigenBasis(kept, float(first.mean()), step, (k, k))
    return out


def _embedding_basis(layer: str, sums: LayerSums, frequencies: Tensor, second: Tensor, k: int, step: int) -> EigenBasis:
    """An embedding's basis: the seeded ``P`` ``(k_v, V)`` on the vocabulary, ``Q_D``'s top ``k_d`` on the output."""
    top_out, vec_out = top_eigenpairs(second, k)  # (k_d,), (d, k_d)
    k_d, vocab = len(top_out), frequencies.shape[0]
    k_v = min(k, vocab)
    p = projection("out", layer, PROJECTION_SEED, (k_v, vocab), k_v, torch.device("cpu")).to(_F64)  # (k_v, V)
    values = (p.square() @ frequencies)[:, None] * top_out[None, :]  # (k_v, k_d): diag(P C P^T) l_D^T
    mean = float(frequencies.mean() * second.diagonal().mean())  # over every V x d entry
    kept = LayerCurvature("embedding", sums.params, p.T, vec_out, values, sums.factored_samples)
    return EigenBasis(kept, mean, step, (k_v, k_d))


def _embedding_block(group: Sequence[LayerRecord], curvature: LayerCurvature, batch: int) -> Tensor:
    """``(B, 1, k_v, k_d)`` ``P W_i Q_D`` from the rows: ``sum_t P[:, v_t] (Q_D^T d_t)^T`` per sample."""
    assert curvature.q_in is not None and curvature.q_out is not None
    total = torch.zeros(batch, 1, curvature.q_in.shape[1], curvature.q_out.shape[1], dtype=_F64)
    for record in group:
        vocab_side = curvature.q_in[record.tensors["ids"].long()]  # (R, k_v)
        out_side = record.tensors["suffix"].to(_F64) @ curvature.q_out  # (R, k_d)
        total += rebuild_outer(out_side[:, None, :], vocab_side[:, None, :], record.tensors["sample"].long(), batch)
    return total


def basis_batch_bytes(k: int) -> float:
    """Bytes a batch's record of one layer on its ``k x k`` eigenbasis block holds besides its samples' numbers: the
    :data:`~metastore_plugins.core.records.EIGENBASIS_TENSORS` (float32 eigenvalues under every encoding, the
    basis step and the mean eigenvalue, 4 bytes each in the shard), with their tensor overheads."""
    return 4.0 * k * k + 8.0 + len(EIGENBASIS_TENSORS) * TENSOR_OVERHEAD_BYTES


def eigenbasis_record(group: Sequence[LayerRecord], basis: EigenBasis) -> LayerRecord:
    """The ``"projected"`` record of one layer's exact records of one batch on its eigenbasis.

    ``projected (B, k_out, k_in)`` = ``R_i``; ``sq_norm (B,)`` exact; ``basis``, ``eigenvalues`` and
    ``mean_eigenvalue`` as :data:`~metastore_plugins.core.records.EIGENBASIS_TENSORS` says.
    """
    batch = group[0].batch_size
    if basis.curvature.kind == "embedding":
        values = _embedding_block(group, basis.curvature, batch)  # (B, 1, k_v, k_d)
    else:
        values = rotated(group, basis.curvature, 0, batch, torch.float32)  # (B, 1, k_out, k_in) or (B, k_out k_in)
    tensors = {
        "projected": values.reshape(batch, *basis.block).float(),  # (B, k_out, k_in)
        "sq_norm": total_sq_norms(list(group)).float(),  # (B,)
        "basis": torch.tensor([basis.step], dtype=torch.int64),
        "eigenvalues": basis.curvature.eigenvalues.reshape(basis.block).float(),  # (k_out, k_in)
        "mean_eigenvalue": torch.tensor([basis.mean_eigenvalue], dtype=torch.float32),
    }
    return summary_record(group, "projected", tensors)


def represent_on_bases(
    records: Sequence[LayerRecord],
    choose: dict[str, Representation],
    k: int,
    projections: Projections | None,
    bases: Mapping[str, EigenBasis],
) -> list[LayerRecord]:
    """:func:`~metastore_plugins.core.ops.represent.represent`, with projected layers that have a basis on it.

    A layer goes on its basis when it is to be projected, has one of the same ``k`` (or smaller, for
    narrow layers), is not tied to another layer, and holds only outer or dense records.
    """
    tied = shared_layers(records)
    out: list[LayerRecord] = []
    for layer, group in by_layer(records).items():
        basis = bases.get(layer)
        usable = (
            basis is not None
            and choose.get(layer, "exact") == "projected"
            and layer not in tied
            and max(basis.block) <= k
            and all(
                r.kind in (("embedding",) if basis.curvature.kind == "embedding" else ("outer", "dense")) for r in group
            )
        )
        if usable:
            assert basis is not None
            out.append(eigenbasis_record(group, basis))
        else:  # tied layers stay exact, as represent() keeps them when it sees the whole batch
            wanted: Representation = "exact" if layer in tied else choose.get(layer, "exact")
            out.extend(represent(group, {layer: wanted}, k, k, projections))
    return out


def truncated_record(record: LayerRecord, block: tuple[int, int]) -> LayerRecord:
    """An eigenbasis record cut to the top-left ``block`` of its own: the record the same sample has on
    :meth:`EigenBasis.truncated` (the same coordinates). Any other record is returned as it is."""
    if record.basis is None or tuple(record.tensors["projected"].shape[1:]) == tuple(block):
        return record
    k_out, k_in = block
    tensors = dict(record.tensors)
    tensors["projected"] = record.tensors["projected"][:, :k_out, :k_in].contiguous()  # (B, k_out, k_in)
    tensors["eigenvalues"] = record.tensors["eigenvalues"][:k_out, :k_in].contiguous()  # (k_out, k_in)
    return replace(record, tensors=tensors)


#: Token rows per layer and micro-batch that a training step adds to the K-FAC sums of the steps' basis.
STEP_BASIS_ROWS = 32


def sampled_rows(records: Sequence[LayerRecord], rows: int, generator: torch.Generator) -> list[LayerRecord]:
    """The records with at most ``rows`` token rows each (uniform, without replacement), for K-FAC sums.

    Rows whose output gradient is exactly zero (padding, positions the loss never reads) are left out first.
    The kept output gradients are scaled by ``sqrt(R / r)`` (``R`` rows, ``r`` kept), so that the sums'
    ``C = (1/r) sum a a^T`` and ``G = (1/N) (R / r) sum d d^T`` are unbiased estimates of the whole
    batch's (:class:`~metastore_plugins.core.ops.curvature.CurvatureSums`). Dense records are kept whole.
    Cost of the sums that follow: ``O(r (d_in'^2 + d_out^2))`` per layer instead of ``O(R (...))``.
    """
    out: list[LayerRecord] = []
    for record in records:
        if record.kind not in ("outer", "embedding"):
            out.append(record)
            continue
        live = record.tensors["suffix"].flatten(1).abs().amax(1).nonzero().squeeze(1)  # (R,) nonzero rows
        total = live.shape[0]
        chosen = torch.randperm(total, generator=generator)[:rows] if total > rows else torch.arange(total)
        kept = live[chosen.sort().values]  # (r,), in sample order
        tensors = {key: value[kept] for key, value in record.tensors.items()}  # every tensor is per row
        tensors["suffix"] = tensors["suffix"] * math.sqrt(total / max(1, len(kept)))
        out.append(replace(record, tensors=tensors))
    return out


def fittable(records: Sequence[LayerRecord]) -> list[LayerRecord]:
    """The records a basis can be fitted on (:class:`CurvatureSums`): exact ones of untied layers."""
    tied = shared_layers(records)
    return [r for r in records if r.kind in ("outer", "embedding", "dense") and r.layer not in tied]
