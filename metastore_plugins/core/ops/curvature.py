"""K-FAC and EK-FAC curvature of per-sample gradient records, and gradients preconditioned by it.

The curvature is the empirical Fisher ``F = (1/N) sum_i g_i g_i^T`` of the per-sample gradients
``g_i`` that records hold (each sample's own loss, the loss reduction undone), approximated
block-diagonally, one block per layer (a record's parameters together):

- **factored layers** (``"outer"`` records). Per weight group, ``[W_i | b_i] = sum_t D_it^T A'_it``
  with ``A'`` the prefix and a column of ones when the layer has a bias (the bias is the last
  column). K-FAC approximates the block by ``G ⊗ C`` (row-major ``(d_out, d_in')`` order) with

  - ``C = (1/R) sum_{i,t} a'_it a'_it^T``: the mean over the ``R`` kept token rows;
  - ``G = (1/N) sum_{i,t} d_it d_it^T``: summed over a sample's rows, averaged over the ``N`` samples.

  This is the "expand" estimator for sequences (Eschenhagen et al. 2023; Grosse & Martens' KFC for
  convolutions, which puts the ``1/T`` on the other factor: the product is the same): cross-token
  terms are dropped, so ``G ⊗ C`` has the scale of ``F`` whatever the length. With one row per sample
  it is plain K-FAC (Martens & Grosse 2015) as Kronfluence fits it; for sequences Kronfluence divides
  ``G`` by the token count too, which scales a layer by ``1/T_mean``. Rows a capture dropped (exactly
  zero suffix: padding, positions the loss never reads) count in neither mean. In the eigenbases
  ``C = Q_A diag(l_A) Q_A^T`` and ``G = Q_D diag(l_D) Q_D^T``, the K-FAC eigenvalues are
  ``Lambda = l_D l_A^T`` ``(d_out, d_in')``; EK-FAC's (George et al. 2018) are the exact diagonal of
  ``F`` in that basis, ``Lambda = (1/N) sum_i (Q_D^T [W_i | b_i] Q_A)^2``, formed from rotated factors
  ``(D_i Q_D)^T (A'_i Q_A)``.
- **embedding layers** (``"embedding"`` records): the same estimators with a one-hot input, so ``C`` is
  the diagonal of token frequencies, ``Q_A = I`` and ``Lambda`` is ``(V, d)``; everything stays sparse
  (one row per distinct token of a sample), see :mod:`.curvature_embedding`. A small embedding
  (``V d`` at most :data:`~.curvature_embedding.TOKEN_BASIS_MAX_PARAMS`) gets a full token-side factor
  ``C = T / tr(T)``, ``T = sum_i W_i W_i^T`` ``(V, V)``, instead: the tokens a sample holds together (its
  co-occurrence), which the diagonal cannot show. An embedding tied to another layer (an LM head) is refused,
  as every tied weight is.
- **dense layers** (``"dense"`` records: norms, small parameters): the flattened gradient's full
  ``F`` (eigendecomposed) up to :data:`FULL_FISHER_MAX_PARAMS` entries, its diagonal above. K-FAC and
  EK-FAC treat them alike.

Preconditioning: ``(F + delta I)^-1 g = Q [(Q^T g) / (Lambda + delta)]``, for a factored layer
``Q_D [(Q_D^T [W | b] Q_A) / (Lambda + delta)] Q_A^T``: no ``(d_out d_in)^2`` matrix is ever built.
The damping ``delta`` of a layer is given, or :data:`DEFAULT_RELATIVE_DAMPING` times the mean of its
``Lambda`` (Kronfluence's rule). Sums accumulate batch by batch (:class:`CurvatureSums`,
:class:`~.curvature_rotated.EigenvalueCorrection`), so a writer can feed them as a run goes; all maths is float64.
The gradients in a fitted eigenbasis, and EK-FAC's correction from them, are :mod:`.curvature_rotated`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from metastore_plugins.core.errors import ConfigError, RepresentationError
from metastore_plugins.core.ops import curvature_eigen as eigen
from metastore_plugins.core.ops import curvature_embedding as embedding
from metastore_plugins.core.ops._common import (
    need_gradients,
    restore_chunk,
)
from metastore_plugins.core.ops.represent import by_layer, shared_layers
from metastore_plugins.core.records import LayerRecord, WeightLayout

CurvatureMethod = Literal["kfac", "ekfac"]
CURVATURE_METHODS: tuple[CurvatureMethod, ...] = ("kfac", "ekfac")
#: Damping of a layer when none is given: this fraction of the mean eigenvalue of its curvature (Kronfluence).
DEFAULT_RELATIVE_DAMPING = 0.1
#: Dense layers with at most this many parameters get a full empirical Fisher; larger ones its diagonal.
FULL_FISHER_MAX_PARAMS = 2048
_F64 = torch.float64


@dataclass
class LayerSums:
    """Running sums of one layer over training batches.

    A layer's batches may be held factored or dense (capture keeps whichever is smaller, batch by
    batch): the Kronecker sums come from its factored batches, the dense Fisher sums from its
    dense ones, and :meth:`CurvatureSums.fit` uses the Kronecker sums wherever there are any.

    Attributes:
        params: role -> parameter name of the layer's records.
        inputs: ``(G, d_in', d_in')`` ``sum_r a'_r a'_r^T`` over the factored batches' rows; for an
            embedding layer ``(V,)`` the token counts (the diagonal of ``sum_r e_{v_r} e_{v_r}^T``).
        outputs: ``(G, d_out, d_out)`` ``sum_r d_r d_r^T`` over the same rows; embedding: ``(d, d)``.
        rows, factored_samples: token rows ``R`` and samples ``N`` of the factored batches.
        dense: ``(P, P)`` ``sum_i g_i g_i^T`` over the dense batches, or ``(P,)`` ``sum_i g_i^2`` above
            :data:`FULL_FISHER_MAX_PARAMS`.
        dense_samples: samples of the dense batches.
        tokens: embedding layers with a full token basis: ``(V, V)`` ``sum_i W_i W_i^T`` (else ``None``).
        layout: the weight layout of the factored records (dense records do not say).
    """

    params: dict[str, str]
    inputs: Tensor | None = None
    outputs: Tensor | None = None
    rows: int = 0
    factored_samples: int = 0
    dense: Tensor | None = None
    dense_samples: int = 0
    tokens: Tensor | None = None
    layout: WeightLayout = "out_in"
    block: tuple[Tensor, float, int] | None = None  # eigenbasis records: (eigenvalues, mean eigenvalue, basis)

    @property
    def is_embedding(self) -> bool:
        """Whether the factored sums are an embedding layer's (``inputs`` holds token counts)."""
        return self.inputs is not None and self.inputs.dim() == 1

    def covariances(self) -> tuple[Tensor, Tensor | None]:
        """``(C, G)`` = ``(inputs / R, outputs / N)`` where there are factored batches, else ``(F, None)``."""
        if self.inputs is not None and self.outputs is not None:
            return self.inputs / max(1, self.rows), self.outputs / max(1, self.factored_samples)
        assert self.dense is not None
        return self.dense / max(1, self.dense_samples), None


@dataclass(frozen=True)
class LayerCurvature:
    """One layer's fitted curvature in its eigenbasis.

    Attributes:
        kind: ``"outer"``, ``"embedding"`` or ``"dense"``.
        params: role -> parameter name.
        q_in: outer: ``(G, d_in', d_in')`` ``Q_A``; dense: ``(P, P)`` ``Q``, or ``None`` (diagonal); embedding:
            ``(V, V)`` ``Q_A`` of a full token basis, or ``None`` (``Q_A = I``: sparse throughout).
        q_out: outer: ``(G, d_out, d_out)`` ``Q_D``; embedding: ``(d, d)`` ``Q_D``; dense: ``None``.
        eigenvalues: outer: ``(G, d_out, d_in')`` ``Lambda``; embedding: ``(V, d)``; dense: ``(P,)``.
        samples: training samples it was fitted on.
        layout: the weight's layout (``"in_out"``: transformers' ``Conv1D``).
    """

    kind: Literal["outer", "embedding", "dense", "eigen"]
    params: dict[str, str]
    q_in: Tensor | None
    q_out: Tensor | None
    eigenvalues: Tensor
    samples: int
    layout: WeightLayout = "out_in"
    mean_eigenvalue: float | None = None  # "eigen": the whole layer's, which its block does not show
    basis: int | None = None  # "eigen": the checkpoint step of the records' eigenbasis

    def damping(self, damping: float | None = None, relative: float = DEFAULT_RELATIVE_DAMPING) -> float:
        """``damping`` if given, else ``relative`` times the mean eigenvalue (1 for a layer without curvature)."""
        if damping is not None:
            return float(damping)
        mean = float(self.eigenvalues.mean()) if self.eigenvalues.numel() else 0.0
        mean = mean if self.mean_eigenvalue is None else self.mean_eigenvalue
        return relative * mean if mean > 0 else 1.0


def layer_groups(records: Sequence[LayerRecord]) -> dict[str, list[LayerRecord]]:
    """Records of one batch by layer (a module called twice gives a layer several), checked for K-FAC.

    Raises:
        RepresentationError: for a projected or norms-only layer.
        ValueError: for layers that share a parameter (tied weights: an embedding tied to an LM head), named.
    """
    tied = shared_layers(records)
    for record in records:
        if record.basis is not None:
            continue  # projected on a curvature eigenbasis: K-FAC is diagonal there (.curvature_eigen)
        need_gradients(record, "K-FAC curvature")
        if record.layer in tied:
            raise ConfigError(
                f"layer '{record.layer}' shares a parameter with another layer (tied weights: {sorted(tied)}); "
                "K-FAC fits one block per layer: leave one of them out with layers="
            )
        if record.kind not in ("outer", "embedding", "dense"):
            raise RepresentationError(
                f"layer '{record.layer}' is kept as {record.kind!r} records, which K-FAC does not fit yet; "
                "leave it out with layers="
            )
    return by_layer(records)


def augmented_prefix(record: LayerRecord, dtype: torch.dtype = _F64) -> Tensor:
    """``(R, G, d_in')`` (float64 by default): the prefix where the record holds a weight, then ones for a bias."""
    prefix = record.tensors["prefix"].to(dtype)  # (R, G, d_in)
    parts = [prefix] if "weight" in record.params else []
    if "bias" in record.params:
        parts.append(prefix.new_ones(*prefix.shape[:2], 1))  # (R, G, 1)
    return torch.cat(parts, 2)


def flat_gradients(record: LayerRecord, lo: int, hi: int) -> Tensor:
    """``(n, P)`` float64: samples ``lo..hi-1``'s gradients of any exact record, its roles flattened in order."""
    grads = restore_chunk(record, lo, hi, list(record.params.values()))
    return torch.cat([grads[name].to(_F64).reshape(hi - lo, -1) for name in record.params.values()], 1)


#: Columns of one block of :func:`gram` (a multiple of 128, so that every block but the last is aligned).
GRAM_BLOCK = 384


def gram(rows: Tensor) -> Tensor:
    """``(G, d, d)`` ``X_g^T X_g`` of ``(G, R, d)`` rows, by blocks of :data:`GRAM_BLOCK` columns: the blocks on
    and above the diagonal are products, those below their transposes (``b (b + 1) / 2`` products of ``b^2``).

    The MiniLM basis fit's 1,537-wide sums (1,536 inputs and the bias's ones): 21 ms a batch of 1,080 rows
    against 41 ms for one product on 2 threads, since a width of 1,537 leaves BLAS misaligned.
    """
    width = rows.shape[-1]
    if width <= GRAM_BLOCK:
        return rows.transpose(1, 2) @ rows
    edges = [*range(0, width, GRAM_BLOCK), width]
    if width - edges[-2] < GRAM_BLOCK // 2:  # a narrow last block joins the one before it
        edges.pop(-2)
    out = rows.new_empty(rows.shape[0], width, width)  # (G, d, d)
    for i, (lo, hi) in enumerate(zip(edges, edges[1:])):
        left = rows[..., lo:hi].transpose(1, 2)  # (G, w_i, R)
        for lo2, hi2 in zip(edges[i:], edges[i + 1 :]):
            block = left @ rows[..., lo2:hi2]  # (G, w_i, w_j)
            out[:, lo:hi, lo2:hi2] = block
            if lo2 != lo:
                out[:, lo2:hi2, lo:hi] = block.transpose(1, 2)
    return out


class CurvatureSums:
    """K-FAC sums over training batches, per layer: :meth:`add` each batch's records, then :meth:`fit`.

    ``dtype``: of the Kronecker sums (float64; a capture-time basis, which needs only the top eigenvectors,
    takes float32 at half the cost). ``token_basis``: also sum a small embedding's ``(V, V)`` token factor
    (:mod:`.curvature_embedding`), for a fit that preconditions (the queries'); a capture-time basis does not use it.
    """

    def __init__(self, dtype: torch.dtype = _F64, token_basis: bool = False) -> None:
        self.layers: dict[str, LayerSums] = {}
        self.dtype = dtype
        self.token_basis = token_basis

    def add(self, records: Sequence[LayerRecord]) -> None:
        """Add one batch (all of a layer's records of the batch together)."""
        for layer, group in layer_groups(records).items():
            first = group[0]
            sums = self.layers.setdefault(layer, LayerSums(dict(first.params)))
            if sums.params != first.params:
                raise ConfigError(f"layer '{layer}' has records of two parameter sets; fit records of one model")
            if all(r.kind == "embedding" for r in group):
                _add_embedding(sums, group, layer, self.token_basis)
                continue
            if first.basis is not None:
                sums.block, sums.factored_samples = eigen.head(group), sums.factored_samples + first.batch_size
                continue
            if all(r.kind == "outer" for r in group):
                prefixes = torch.cat([augmented_prefix(r, self.dtype) for r in group]).transpose(0, 1)  # (G, R, d_in')
                suffixes = torch.cat([r.tensors["suffix"].to(self.dtype) for r in group]).transpose(
                    0, 1
                )  # (G, R, d_out)
                sums.inputs = _added(sums.inputs, gram(prefixes), layer)  # (G, d_in', d_in')
                sums.outputs = _added(sums.outputs, gram(suffixes), layer)  # (G, d_out, d_out)
                sums.rows += prefixes.shape[1]
                sums.layout = first.layout
                sums.factored_samples += first.batch_size
                continue
            flat = sum(
                (flat_gradients(r, 0, r.batch_size) for r in group[1:]), flat_gradients(first, 0, first.batch_size)
            )
            square = flat.T @ flat if flat.shape[1] <= FULL_FISHER_MAX_PARAMS else (flat * flat).sum(0)  # (P, P) / (P,)
            sums.dense = _added(sums.dense, square, layer)
            sums.dense_samples += first.batch_size

    def fit(self) -> dict[str, LayerCurvature]:
        """Each layer's eigenbasis and K-FAC eigenvalues."""
        out = {}
        for layer, sums in self.layers.items():
            if sums.block is not None:
                values, mean, basis = sums.block
                out[layer] = LayerCurvature("eigen", sums.params, None, None, values, sums.factored_samples,
                                            mean_eigenvalue=mean, basis=basis)  # fmt: skip
                continue
            first, second = sums.covariances()
            if second is None:
                if first.dim() == 1:
                    out[layer] = LayerCurvature("dense", sums.params, None, None, first, sums.dense_samples)
                else:
                    values, q = torch.linalg.eigh(first)  # (P,), (P, P)
                    out[layer] = LayerCurvature("dense", sums.params, q, None, values.clamp_min(0), sums.dense_samples)
                continue
            if sums.is_embedding:
                out[layer] = _fit_embedding(sums, first, second)
                continue
            l_in, q_in = torch.linalg.eigh(first)  # (G, d_in'), (G, d_in', d_in')
            l_out, q_out = torch.linalg.eigh(second)  # (G, d_out), (G, d_out, d_out)
            values = l_out.clamp_min(0)[:, :, None] * l_in.clamp_min(0)[:, None, :]  # (G, d_out, d_in')
            out[layer] = LayerCurvature("outer", sums.params, q_in, q_out, values, sums.factored_samples, sums.layout)
        return out


def _add_embedding(sums: LayerSums, group: Sequence[LayerRecord], layer: str, token_basis: bool) -> None:
    """Add one batch's embedding records: token counts, ``sum_r d_r d_r^T``, rows and samples (and the token
    factor's ``sum_i W_i W_i^T`` where ``token_basis`` and the layer is small enough)."""
    counts, outputs, rows = embedding.kronecker_sums(group)  # (V,), (d, d)
    sums.inputs = _added(sums.inputs, counts, layer)
    sums.outputs = _added(sums.outputs, outputs, layer)
    if token_basis and embedding.has_token_basis(group):
        sums.tokens = _added(sums.tokens, embedding.token_second_moment(group), layer)  # (V, V)
    sums.rows += rows
    sums.factored_samples += group[0].batch_size


def _fit_embedding(sums: LayerSums, frequencies: Tensor, second: Tensor) -> LayerCurvature:
    """An embedding layer's K-FAC: ``Q_D`` of ``G``; ``Q_A = I`` and ``Lambda = (n / R) l_D^T`` ``(V, d)``, or with
    a full token basis (``sums.tokens``) ``Q_A`` of ``C = T / tr(T)`` and ``Lambda = l_A l_D^T``."""
    l_out, q_out = torch.linalg.eigh(second)  # (d,), (d, d)
    if sums.tokens is not None:
        q_in, values = embedding.token_basis(sums.tokens, l_out)  # (V, V), (V, d)
        return LayerCurvature("embedding", sums.params, q_in, q_out, values, sums.factored_samples)
    values = embedding.kfac_eigenvalues(frequencies, l_out)  # (V, d)
    return LayerCurvature("embedding", sums.params, None, q_out, values, sums.factored_samples)


def _added(total: Tensor | None, part: Tensor, layer: str) -> Tensor:
    if total is None:
        return part
    if total.shape != part.shape:
        raise ConfigError(f"layer '{layer}' has records of two shapes ({tuple(total.shape)}, {tuple(part.shape)})")
    return total + part
