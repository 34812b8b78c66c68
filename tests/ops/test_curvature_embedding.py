"""K-FAC / EK-FAC of embedding records against covariances and dense inverses built by hand.

The model is an ``nn.Embedding(11, 4, padding_idx=0)`` over padded token sequences with repeated tokens,
then a Linear head. References know nothing of records: each row's output gradient ``d_it`` (of sample
``i``'s own loss) comes from ``torch.func`` (``vmap(grad(...))`` of the network after the embedding), the
per-sample weight gradients ``W_i`` ``(11, 4)`` from ``reference_per_sample_gradients``. The Fisher block
is an explicit ``(44, 44)`` matrix in the weight's row-major order: K-FAC ``C ⊗ G`` with
``C = diag(token counts) / R``, EK-FAC ``Q diag(s) Q^T`` with ``Q = I ⊗ Q_G`` (the one-hot input's
eigenbasis is the identity) and ``s`` the exact second moments of ``W_i`` in it; solved with torch.
Training ids use tokens 1..8 only: tokens 9 and 10 are never seen (their eigenvalues are zero, and the
damping's mean eigenvalue counts them), the test batch holds token 9.

Below :data:`~metastore_plugins.core.ops.curvature_embedding.TOKEN_BASIS_MAX_PARAMS` an embedding gets a full token
basis instead: ``C = T / tr(T)``, ``T = sum_i W_i W_i^T`` from the reference gradients, its eigenvectors ``Q_A`` and
EK-FAC's ``Q = Q_A ⊗ Q_G``. The tests of the diagonal rule (a large vocabulary's) lower that size to 0; those of the
token basis (fixture ``basis="tokens"``) keep it. Where the rows of a sample share one output gradient ``d``
(``W_i = c_i d^T``, a bag of tokens), ``F = E[c c^T] ⊗ d d^T`` is diagonal in the token basis, so EK-FAC is the
exact ``(F + delta I)^-1``: records built by hand, against the explicit ``F`` of their gradients.

Tolerances: records hold fp32 rows (relative rounding 6e-8) of a float64 model. Covariances: ``1e-6``
relative; preconditioned scores: ``1e-7 kappa`` relative to the largest score, ``kappa`` the damped
block's condition number (checked below 2,000).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from opscases import get_case, rel_err
from torch import Tensor, nn
from torch.func import grad, vmap

from metastore_plugins.core.capture import CaptureSession, LayerRecord
from metastore_plugins.core.ops import curvature as kfac
from metastore_plugins.core.ops import curvature_embedding as embedding
from metastore_plugins.core.ops import total_dots
from metastore_plugins.core.ops.curvature_rotated import EigenvalueCorrection, rotated
from metastore_plugins.core.ops.leverage import preconditioned_sq_norms
from metastore_plugins.core.ops.precondition import precondition
from metastore_plugins.core.records import to_dense
from metastore_plugins.testing import reference_per_sample_gradients

VOCAB, WIDTH, LENGTH = 11, 4, 6
TOKEN_BASIS_MAX_PARAMS = embedding.TOKEN_BASIS_MAX_PARAMS  # as shipped (44 parameters here are below it)


@pytest.fixture(autouse=True)
def diagonal(monkeypatch: pytest.MonkeyPatch) -> None:
    """The diagonal token factor of a large vocabulary (the sparse rule), unless a test asks for the token basis."""
    monkeypatch.setattr(embedding, "TOKEN_BASIS_MAX_PARAMS", 0)


@pytest.fixture(params=["diagonal", "tokens"])
def basis(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, diagonal: None) -> str:
    if request.param == "tokens":
        monkeypatch.setattr(embedding, "TOKEN_BASIS_MAX_PARAMS", TOKEN_BASIS_MAX_PARAMS)
    return str(request.param)


class Bag(nn.Module):
    """Token embeddings (padding id 0), tanh, masked mean, Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH, padding_idx=0)
        self.head = nn.Linear(WIDTH, 3)

    def pooled(self, e: Tensor, mask: Tensor) -> Tensor:
        """``(..., T, d)`` embedded rows -> ``(..., 3)`` logits."""
        h = torch.tanh(e) * mask.unsqueeze(-1)  # (..., T, d)
        return self.head(h.sum(-2) / mask.sum(-1, keepdim=True))

    def forward(self, ids: Tensor) -> Tensor:
        return self.pooled(self.embed(ids), ids.ne(0).double())


def loss_fn(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch["ids"]), batch["y"])


def make_batch(size: int, seed: int, top: int) -> dict[str, Tensor]:
    """Ids in ``1..top`` padded with 0 after a random length; sample 0 repeats one token over its whole length."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, LENGTH + 1, (size,), generator=g)
    lengths[0] = LENGTH
    ids = torch.randint(1, top + 1, (size, LENGTH), generator=g)
    ids[0] = 3
    ids[torch.arange(LENGTH) >= lengths[:, None]] = 0
    return {"ids": ids, "y": torch.randint(0, 3, (size,), generator=g)}


def build() -> Bag:
    torch.manual_seed(5)
    return Bag().double()


def capture(model: nn.Module, batch: dict[str, Tensor]) -> list[LayerRecord]:
    with CaptureSession(model) as session:
        loss_fn(model, batch).backward()
    model.zero_grad()
    return [r for r in session.factors() if r.layer == "embed"]


def hand_covariances(model: Bag, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """``C = diag(counts) / R`` ``(V, V)`` over the non-padding rows and ``G = (1/N) sum_{i,t} d_it d_it^T``."""
    ids, y = batch["ids"], batch["y"]
    mask = ids.ne(0).double()  # (N, T)

    def own_loss(e: Tensor, m: Tensor, label: Tensor) -> Tensor:  # one sample's rows (T, d)
        return F.cross_entropy(model.pooled(e, m)[None], label[None])

    with torch.no_grad():
        rows = model.embed(ids)  # (N, T, d)
    d = vmap(grad(own_loss))(rows, mask, y).detach()  # (N, T, d)
    kept = ids.ne(0)  # (N, T)
    counts = torch.bincount(ids[kept], minlength=VOCAB).double()  # (V,)
    d_kept = d[kept]  # (R, d)
    return torch.diag(counts) / len(d_kept), d_kept.T @ d_kept / len(ids)


def reference_scores(method: str, basis: str = "diagonal") -> tuple[Tensor, float]:
    """``(24, 7)`` ``g_train^T (F + delta I)^-1 g_test`` with the explicit ``(44, 44)`` ``F``, and its ``kappa``."""
    g, g_test, damped = reference_inverse(method, basis)
    return g @ torch.linalg.solve(damped, g_test.T), float(torch.linalg.cond(damped))


def reference_inverse(method: str, basis: str = "diagonal") -> tuple[Tensor, Tensor, Tensor]:
    """``(g_train (24, V d), g_test (7, V d), F + delta I (V d, V d))``, ``F`` explicit; ``basis="tokens"``: the
    token factor ``C = T / tr(T)``, ``T = sum_i W_i W_i^T``."""
    model, train, test = build(), make_batch(24, 1, 8), make_batch(7, 2, 9)
    c, gg = hand_covariances(model, train)
    w = reference_per_sample_gradients(model, loss_fn, train)["embed.weight"]  # (N, V, d)
    if basis == "tokens":
        tokens = torch.einsum("nvd,nud->vu", w, w)  # (V, V)
        c = tokens / torch.trace(tokens)
    g = w.reshape(24, -1)  # (N, V d)
    g_test = reference_per_sample_gradients(model, loss_fn, test)["embed.weight"].reshape(7, -1)  # (M, V d)
    fisher = torch.kron(c, gg)  # (V d, V d): row-major (v, k)
    if method == "ekfac":
        q_c = torch.eye(VOCAB, dtype=torch.float64) if basis == "diagonal" else torch.linalg.eigh(c)[1]
        q = torch.kron(q_c.contiguous(), torch.linalg.eigh(gg)[1].contiguous())  # (V d, V d)
        fisher = q @ torch.diag(((g @ q) ** 2).mean(0)) @ q.T
    damping = 0.1 * torch.trace(fisher) / len(fisher)  # 0.1 x the mean eigenvalue, unseen tokens included
    return g, g_test, fisher + damping * torch.eye(len(fisher), dtype=torch.float64)


def fitted(method: str, halves: list[list[LayerRecord]]) -> dict[str, kfac.LayerCurvature]:
    sums = kfac.CurvatureSums(token_basis=True)  # as the queries fit it
    for records in halves:
        sums.add(records)
    curvature = sums.fit()
    if method == "ekfac":
        correction = EigenvalueCorrection(curvature)
        for records in halves:
            correction.add(records)
        curvature = correction.fit()
    return curvature


def train_halves(model: nn.Module) -> list[list[LayerRecord]]:
    train = make_batch(24, 1, 8)
    return [capture(model, {key: value[lo : lo + 12] for key, value in train.items()}) for lo in (0, 12)]


def test_token_counts_and_output_covariance_are_the_hand_ones() -> None:
    model = build()
    c, g = hand_covariances(model, make_batch(24, 1, 8))
    sums = kfac.CurvatureSums()
    for records in train_halves(model):
        sums.add(records)
    layer = sums.layers["embed"]
    frequencies, got_g = layer.covariances()
    assert got_g is not None and frequencies.shape == (VOCAB,) and got_g.shape == (WIDTH, WIDTH)
    assert rel_err(torch.diag(frequencies), c) <= 1e-6 and rel_err(got_g, g) <= 1e-6
    ids = make_batch(24, 1, 8)["ids"]
    assert layer.rows == int(ids.ne(0).sum()) < ids.numel()  # padding rows count in neither mean
    curvature = sums.fit()["embed"]
    assert curvature.kind == "embedding" and curvature.eigenvalues.shape == (VOCAB, WIDTH)
    unseen = [0, 9, 10]
    assert float(curvature.eigenvalues[unseen].abs().max()) < 1e-300 < float(curvature.eigenvalues[1:9].min())


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_preconditioned_influence_is_the_dense_inverse(method: str, basis: str) -> None:
    model = build()
    halves = train_halves(model)
    curvature = fitted(method, halves)
    assert (curvature["embed"].q_in is None) == (basis == "diagonal")
    test_records = capture(model, make_batch(7, 2, 9))
    preconditioned = precondition(test_records, curvature)
    got = torch.cat([total_dots(records, preconditioned) for records in halves]).double()  # (N, M)
    expected, kappa = reference_scores(method, basis)
    assert kappa < 2000
    assert rel_err(got, expected) <= 1e-7 * kappa


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_the_square_root_on_both_sides_is_the_dense_inverse(method: str, basis: str) -> None:
    """``<S W_i, S W_j>`` with ``S = (F + delta I)^-1/2`` (``power=0.5``), sparse rows or the full token basis."""
    model = build()
    halves = train_halves(model)
    curvature = fitted(method, halves)
    test_records = precondition(capture(model, make_batch(7, 2, 9)), curvature, power=0.5)
    parts = [total_dots(precondition(records, curvature, power=0.5), test_records) for records in halves]
    expected, kappa = reference_scores(method, basis)
    assert rel_err(torch.cat(parts).double(), expected) <= 1e-7 * kappa


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_self_products_sparse_and_dense_rotated(method: str) -> None:
    """``g_i^T (F + delta I)^-1 g_i`` from the sparse rows, and from the dense ``W_i Q_D`` of :func:`rotated`."""
    model = build()
    halves = train_halves(model)
    c = fitted(method, halves)["embed"]
    g, _, damped = reference_inverse(method)
    expected = (g * torch.linalg.solve(damped, g.T).T).sum(1)  # (24,)
    assert c.q_out is not None
    delta = c.damping()
    sparse = torch.cat([embedding.preconditioned_self_products(h, c.q_out, c.eigenvalues, delta) for h in halves])
    dense = torch.cat([(rotated(h, c, 0, 12).square() / (c.eigenvalues + delta)).sum((1, 2)) for h in halves])
    assert rel_err(sparse, expected) <= 1e-7 * float(torch.linalg.cond(damped))
    assert rel_err(dense, sparse) <= 1e-12


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_self_products_on_the_token_basis(method: str, basis: str) -> None:
    """``g_i^T (F + delta I)^-1 g_i`` of :func:`preconditioned_sq_norms` (sparse rows, or the dense token basis)."""
    model = build()
    halves = train_halves(model)
    curvature = fitted(method, halves)
    g, _, damped = reference_inverse(method, basis)
    expected = (g * torch.linalg.solve(damped, g.T).T).sum(1)  # (24,)
    got = torch.cat([preconditioned_sq_norms(h, curvature) for h in halves])
    assert rel_err(got, expected) <= 1e-7 * float(torch.linalg.cond(damped))


@pytest.mark.parametrize("rows", [1, 5, 1024])
def test_the_token_factor_is_the_hand_one_in_blocks_of_any_size(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``T = sum_i W_i W_i^T`` from the rows, in blocks of whole samples (a sample above the block size alone)."""
    monkeypatch.setattr(embedding, "_TOKEN_ROWS", rows)
    monkeypatch.setattr(embedding, "TOKEN_BASIS_MAX_PARAMS", TOKEN_BASIS_MAX_PARAMS)
    model = build()
    halves = train_halves(model)
    w = reference_per_sample_gradients(model, loss_fn, make_batch(24, 1, 8))["embed.weight"]  # (N, V, d)
    expected = torch.einsum("nvd,nud->vu", w, w)  # (V, V)
    sums = kfac.CurvatureSums(token_basis=True)
    for records in halves:
        sums.add(records)
    tokens = sums.layers["embed"].tokens
    assert tokens is not None and rel_err(tokens, expected) <= 1e-6
    capture_time = kfac.CurvatureSums(torch.float32)  # a capture-time basis fit does not sum it
    capture_time.add(halves[0])
    assert capture_time.layers["embed"].tokens is None


def bag_records(counts: Tensor, d: Tensor) -> list[LayerRecord]:
    """Hand-built embedding records of ``W_i = c_i d^T``: sample ``i`` holds token ``v`` ``counts[i, v]`` times,
    every row with the output gradient ``d`` ``(WIDTH,)`` (a bag of tokens whose rows share one gradient)."""
    sample, ids = counts.nonzero(as_tuple=True)  # (U,), (U,)
    repeats = counts[sample, ids].long()  # (U,)
    sample, ids = sample.repeat_interleave(repeats), ids.repeat_interleave(repeats)  # (R,), (R,)
    tensors = {"ids": ids.int(), "suffix": d.float().expand(len(ids), -1).contiguous(), "sample": sample.int(),
               "position": torch.zeros_like(sample).int()}  # fmt: skip
    params, shapes = {"weight": "embed.weight"}, {"weight": (VOCAB, WIDTH)}
    return [LayerRecord("embed", "embedding", counts.shape[0], params, shapes, tensors)]


def test_ekfac_on_the_token_basis_is_the_exact_inverse_of_a_bag_of_tokens(basis: str) -> None:
    """``F = E[c c^T] ⊗ d d^T`` with co-occurring tokens: EK-FAC on the token basis is ``(F + delta I)^-1`` itself;
    the diagonal basis, blind to the co-occurrence, is not."""
    g = torch.Generator().manual_seed(4)
    counts = torch.randint(0, 3, (40, VOCAB), generator=g).double()  # (N, V): every sample holds many tokens
    counts[:, 1:4] += counts[:, :1]  # tokens 0..3 co-occur
    counts_test = torch.randint(0, 3, (6, VOCAB), generator=g).double()  # (M, V)
    d = torch.tensor([0.5, -1.0, 0.25, 2.0], dtype=torch.float64)  # (WIDTH,), exact in fp32
    train, test = bag_records(counts, d), bag_records(counts_test, d)
    w, w_test = counts[:, :, None] * d, counts_test[:, :, None] * d  # (N, V, d), (M, V, d): c_i d^T
    flat = w.reshape(40, -1)  # (N, V d)
    fisher = flat.T @ flat / 40  # (V d, V d)
    damped = fisher + 0.1 * torch.trace(fisher) / len(fisher) * torch.eye(len(fisher), dtype=torch.float64)
    expected = flat @ torch.linalg.solve(damped, w_test.reshape(6, -1).T)  # (N, M)
    got = total_dots(train, precondition(test, fitted("ekfac", [train]))).double()  # (N, M)
    kappa = float(torch.linalg.cond(damped))
    assert kappa < 2000
    if basis == "tokens":
        assert rel_err(got, expected) <= 1e-7 * kappa
    else:
        assert rel_err(got, expected) > 1e-2


def test_a_preconditioned_embedding_stays_one_row_per_distinct_token() -> None:
    model = build()
    curvature = fitted("ekfac", train_halves(model))
    test = make_batch(7, 2, 9)
    (record,) = precondition(capture(model, test), curvature)
    pairs = {(i, int(v)) for i in range(7) for v in test["ids"][i] if v != 0}
    assert record.kind == "embedding" and len(record.tensors["ids"]) == len(pairs)
    assert {(int(s), int(v)) for s, v in zip(record.tensors["sample"], record.tensors["ids"])} == pairs


def test_dense_records_of_an_embedding_layer_precondition_alike() -> None:
    """A test record held dense ``(B, V, d)`` gives the same preconditioned gradients as its rows."""
    model = build()
    halves = train_halves(model)
    curvature = fitted("ekfac", halves)
    test_records = capture(model, make_batch(7, 2, 9))
    rows = total_dots(halves[0], precondition(test_records, curvature)).double()
    dense = total_dots(halves[0], precondition([to_dense(r) for r in test_records], curvature)).double()
    assert rel_err(dense, rows) <= 1e-6


def test_an_embedding_tied_to_the_output_layer_is_still_refused_by_name() -> None:
    records = get_case("tied-lm").train_records  # an embedding tied to the output layer
    with pytest.raises(ValueError, match=r"layer '(embed|out)' shares a parameter.*layers="):
        kfac.CurvatureSums().add(records)
