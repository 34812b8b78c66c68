"""K-FAC and EK-FAC of ``"embedding"`` records: the maths :mod:`.curvature` calls for them.

An embedding record holds, per kept row ``r`` (a token of sample ``i``), the token id ``v_r`` and the
output gradient ``d_r`` ``(d,)``; the sample's gradient is ``W_i = sum_{r in i} e_{v_r} d_r^T`` ``(V, d)``.
The layer's input is one-hot, so the Linear estimators of :mod:`.curvature` become:

- ``C = (1/R) sum_r e_{v_r} e_{v_r}^T = diag(n / R)``, ``n_v`` the count of token ``v`` over the ``R`` kept
  rows: diagonal, its eigenbasis the identity (``Q_A = I``), its eigenvalues the token frequencies;
- ``G = (1/N) sum_r d_r d_r^T = Q_D diag(l_D) Q_D^T`` over the ``N`` samples, as for a Linear layer;
- K-FAC's eigenvalues ``Lambda[v, k] = (n_v / R) l_D[k]`` ``(V, d)``; EK-FAC's (the exact diagonal of ``F``
  in that basis) ``Lambda[v, :] = (1/N) sum_i ((W_i Q_D)[v, :])^2``, where
  ``(W_i Q_D)[v] = (sum_{r in i, v_r = v} d_r) Q_D`` is nonzero only for the tokens sample ``i`` holds.

Preconditioning keeps that sparsity: ``((F + delta I)^-1 W_j)[v] = ((W_j Q_D)[v] / (Lambda[v] + delta)) Q_D^T``
is nonzero only in the rows of sample ``j``'s tokens, so the result is again an embedding record, one row
per distinct ``(sample, token)``, whose dot products with training embedding records stay the factored ones
of :mod:`.dots`. No ``(V, d)`` gradient is built per sample; the layer's ``Lambda`` is one ``(V, d)`` tensor.

**A small embedding gets a full token basis** (``V d`` at most :data:`TOKEN_BASIS_MAX_PARAMS`). The diagonal
``C`` holds no token co-occurrence: where a sample's rows share their output gradient (a pooled or
classifying model: the rows of a sample are one bag of tokens), ``W_i ~ c_i d_i^T`` with ``c_i`` the sample's
token counts, and the Fisher's strongest directions mix the tokens that occur together, which the identity
basis cannot show (EK-FAC then corrects only the diagonal of a basis far from the Fisher's: on the LDS
harness's token transformer the embedding alone scored 0.195 where its dense ``(F + delta I)^-1`` scored 0.270).
There ``C = T / tr(T)`` with ``T = sum_i W_i W_i^T`` ``(V, V)``, the token side of the per-sample gradients'
second moment (the diagonal rule's ``diag(n / R)`` when the rows' output gradients are uncorrelated, as in a
language model's per-token loss), ``Q_A`` its eigenvectors and K-FAC's ``Lambda = l_A l_D^T`` (``tr(C) = 1``
as before), EK-FAC's the exact diagonal of ``F`` in ``Q_A ⊗ Q_D``; the rotated and preconditioned gradients are
then dense ``(V, d)`` per sample (:func:`dense_rotated`), as a dense layer's are. A larger embedding keeps the
diagonal and stays sparse.

Damping: the layer rule of :mod:`.curvature` (``relative`` times the mean of ``Lambda``) averages over all
``V d`` entries, tokens the fit never saw included (their ``Lambda`` is 0). That mean is ``trace(F) / (V d)``,
the mean eigenvalue of the block as a dense ``F`` has it (for K-FAC ``trace(G) / (V d)``, as
``trace(C) = 1``). With a large vocabulary mostly unseen it is smaller than a mean over the seen tokens
would be; an absolute ``damping`` overrides it. Rows a capture dropped (padding, ``padding_idx``, exactly
zero gradients) count in neither ``R`` nor ``G``. All maths is float64.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from metastore_plugins.core.ops._common import segment_sum
from metastore_plugins.core.ops.dots import _grouped_embedding_rows as grouped_rows
from metastore_plugins.core.records import LayerRecord

_F64 = torch.float64
#: An embedding of at most this many parameters ``V d`` (and :data:`TOKEN_BASIS_MAX_VOCAB` tokens) gets a full token
#: basis (module docstring): its ``(V, V)`` factor and its samples' dense ``(V, d)`` rotated gradients stay small.
#: A larger one keeps the diagonal ``C``.
TOKEN_BASIS_MAX_PARAMS = 65_536
TOKEN_BASIS_MAX_VOCAB = 2048
#: Rows per block of :func:`token_second_moment` (a block's ``(n, n)`` Gram: 8 MiB in float64).
_TOKEN_ROWS = 1024


def is_embedding_layer(group: Sequence[LayerRecord]) -> bool:
    """Whether one batch's records of a layer include ``"embedding"`` records (K-FAC fits its rows sparsely)."""
    return any(record.kind == "embedding" for record in group)


def joined_rows(group: Sequence[LayerRecord]) -> LayerRecord:
    """One ``"embedding"`` record (float64 suffix) of all rows of one batch's records of a layer.

    A module called twice gives a layer two records: their rows together are the gradient's. A ``"dense"``
    record ``(B, V, d)`` gives its nonzero rows ``W_i[v]`` (the same gradient, one row per sample and token).
    """
    first = group[0]
    samples, ids, suffixes = [], [], []
    for record in group:
        if record.kind == "embedding":
            samples.append(record.tensors["sample"].long())  # (R,)
            ids.append(record.tensors["ids"].long())  # (R,)
            suffixes.append(record.tensors["suffix"].to(_F64))  # (R, d)
            continue
        dense = record.dense_grad("weight").to(_F64)  # (B, V, d)
        sample, token = dense.ne(0).any(2).nonzero(as_tuple=True)  # (U,), (U,)
        samples.append(sample)
        ids.append(token)
        suffixes.append(dense[sample, token])  # (U, d)
    return _rows_record(first, torch.cat(samples), torch.cat(ids), torch.cat(suffixes))


def _rows_record(like: LayerRecord, sample: Tensor, ids: Tensor, suffix: Tensor) -> LayerRecord:
    """An ``"embedding"`` record of ``like``'s layer from rows ``sample (R,)``, ``ids (R,)``, ``suffix (R, d)``
    (``position`` 0: a row may stand for several of its sample's positions)."""
    tensors = {"ids": ids, "suffix": suffix, "sample": sample.int(), "position": torch.zeros_like(sample).int()}
    return LayerRecord(like.layer, "embedding", like.batch_size, dict(like.params), dict(like.param_shapes), tensors)


def kronecker_sums(group: Sequence[LayerRecord]) -> tuple[Tensor, Tensor, int]:
    """``(n (V,), sum_r d_r d_r^T (d, d), R)`` over the kept rows of one batch's embedding records of a layer.

    ``C = diag(n) / R`` and ``G = (sum_r d_r d_r^T) / N`` once every batch is added.
    """
    vocab = group[0].param_shapes["weight"][0]
    ids = torch.cat([record.tensors["ids"].long() for record in group])  # (R,)
    suffix = torch.cat([record.tensors["suffix"].to(_F64) for record in group])  # (R, d)
    counts = torch.bincount(ids, minlength=vocab).to(_F64)  # (V,)
    return counts, suffix.T @ suffix, int(ids.numel())  # (V,), (d, d)


def has_token_basis(group: Sequence[LayerRecord]) -> bool:
    """Whether the layer of these records is small enough for a full token basis (:data:`TOKEN_BASIS_MAX_PARAMS`)."""
    vocab, width = group[0].param_shapes["weight"]
    return vocab <= TOKEN_BASIS_MAX_VOCAB and vocab * width <= TOKEN_BASIS_MAX_PARAMS


def token_second_moment(group: Sequence[LayerRecord]) -> Tensor:
    """``(V, V)`` ``T = sum_i W_i W_i^T`` over one batch's embedding records of a layer (float64).

    ``T[v, u] = sum_i (W_i)[v] . (W_i)[u]``: each sample's distinct-token rows against each other, so the cost is
    ``sum_i U_i^2 d`` (``U_i`` distinct tokens of sample ``i``), in blocks of whole samples of about
    :data:`_TOKEN_ROWS` rows; no ``(V, d)`` gradient is built.
    """
    vocab, batch = group[0].param_shapes["weight"][0], group[0].batch_size
    sample, ids, rows = grouped_rows(joined_rows(group))  # (U,), (U,), (U, d), sample-major
    total = rows.new_zeros(vocab * vocab)  # (V V,)
    ends = torch.bincount(sample, minlength=batch).cumsum(0)  # (B,) each sample's last row + 1
    lo = 0
    while lo < len(sample):
        whole = int(torch.searchsorted(ends, lo + _TOKEN_ROWS, right=True))  # samples ending within the block
        hi = int(ends[whole - 1]) if whole > 0 else lo
        hi = hi if hi > lo else int(ends[int(sample[lo])])  # one sample above the block size: alone
        s, v, r = sample[lo:hi], ids[lo:hi], rows[lo:hi]  # (n,), (n,), (n, d)
        gram = (r @ r.T) * (s[:, None] == s[None, :])  # (n, n), pairs of one sample
        total.index_add_(0, (v[:, None] * vocab + v[None, :]).reshape(-1), gram.reshape(-1))
        lo = hi
    return total.view(vocab, vocab)


def token_basis(tokens: Tensor, output_values: Tensor) -> tuple[Tensor, Tensor]:
    """``(Q_A (V, V), K-FAC's Lambda (V, d))`` of the full token factor ``C = T / tr(T)`` and ``G``'s ``l_D``."""
    trace = float(tokens.diagonal().sum())
    l_in, q_in = torch.linalg.eigh(tokens / trace if trace > 0 else tokens)  # (V,), (V, V)
    return q_in, l_in.clamp_min(0)[:, None] * output_values.clamp_min(0)[None, :]  # (V, V), (V, d)


def kfac_eigenvalues(frequencies: Tensor, output_values: Tensor) -> Tensor:
    """``(V, d)`` K-FAC's ``Lambda[v, k] = (n_v / R) l_D[k]``, from ``C``'s diagonal ``n / R`` and ``G``'s ``l_D``."""
    return frequencies[:, None] * output_values.clamp_min(0)[None, :]  # (V, d)


def rotated_rows(group: Sequence[LayerRecord], q_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(sample (U,), ids (U,), (W_i Q_D)[v] (U, d))``: each sample's gradient rows in the eigenbasis, one per
    distinct ``(sample, token)`` (rows of the same pair summed first)."""
    sample, ids, rows = grouped_rows(joined_rows(group))  # (U,), (U,), (U, d)
    return sample, ids, rows @ q_out  # (U, d)


def add_squared_rotated(total: Tensor, group: Sequence[LayerRecord], q_out: Tensor) -> Tensor:
    """``total (V, d) += sum_i ((W_i Q_D)[v, :])^2`` over one batch, in place (only the batch's tokens' rows are
    touched): EK-FAC's sums, divided by ``N`` once every batch is added. Returns ``total``."""
    _, ids, rotated = rotated_rows(group, q_out)  # (U,), (U, d)
    return total.index_add_(0, ids, rotated.square())  # (V, d)


def preconditioned_rows(
    group: Sequence[LayerRecord], q_out: Tensor, eigenvalues: Tensor, delta: float, power: float = 1.0
) -> LayerRecord:
    """``(F + delta I)^-power W_j`` of every sample of one batch as an ``"embedding"`` record, in the records' dtype.

    Row ``v`` of sample ``j``: ``((W_j Q_D)[v] / (Lambda[v] + delta)^power) Q_D^T``, one row per distinct ``(j, v)``.
    """
    first = group[0]
    sample, ids, rotated = rotated_rows(group, q_out)  # (U,), (U,), (U, d)
    scaled = rotated / (eigenvalues[ids] + delta) ** power @ q_out.T  # (U, d)
    dtype = first.tensors["suffix"].dtype if first.kind == "embedding" else first.dense_grad("weight").dtype
    return _rows_record(first, sample, ids, scaled.to(dtype).contiguous())


def preconditioned_self_products(
    group: Sequence[LayerRecord], q_out: Tensor, eigenvalues: Tensor, delta: float
) -> Tensor:
    """``(B,)`` ``W_i^T (F + delta I)^-1 W_i = sum_v sum_k (W_i Q_D)[v, k]^2 / (Lambda[v, k] + delta)``."""
    sample, ids, rotated = rotated_rows(group, q_out)  # (U,), (U,), (U, d)
    per_row = (rotated.square() / (eigenvalues[ids] + delta)).sum(1)  # (U,)
    return segment_sum(per_row, sample, group[0].batch_size)  # (B,)


def dense_rotated(group: Sequence[LayerRecord], q_out: Tensor, lo: int, hi: int, q_in: Tensor | None = None) -> Tensor:
    """``(n, V, d)`` ``Q_A^T W_i Q_D`` of samples ``lo..hi-1``, dense (``Q_A = I`` when ``q_in`` is None): for a
    full token basis, and callers that need the whole rotated gradient (the sparse functions above never build it)."""
    vocab = group[0].param_shapes["weight"][0]
    sample, ids, rotated = rotated_rows(group, q_out)  # (U,), (U,), (U, d)
    out = _scattered(sample, ids, rotated, lo, hi, vocab)  # (n, V, d)
    return out if q_in is None else q_in.T @ out


def _scattered(sample: Tensor, ids: Tensor, rows: Tensor, lo: int, hi: int, vocab: int) -> Tensor:
    """``(n, V, d)``: rows ``(U, d)`` of samples ``lo..hi-1`` placed at their tokens (zeros elsewhere)."""
    kept = ((sample >= lo) & (sample < hi)).nonzero().squeeze(1)  # (U_chunk,)
    out = rows.new_zeros((hi - lo) * vocab, rows.shape[1])  # (n V, d)
    out.index_add_(0, (sample[kept] - lo) * vocab + ids[kept], rows[kept])
    return out.view(hi - lo, vocab, -1)  # (n, V, d)
