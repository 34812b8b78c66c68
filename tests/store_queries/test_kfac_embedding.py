"""``store.kfac_influence`` with an embedding layer, against explicit dense K-FAC / EK-FAC inverses.

A store holds two checkpoint passes of a token model (``nn.Embedding(11, 4, padding_idx=0)``, tanh,
masked mean, Linear head; train and test samples at the same weights, two train batches per pass,
sequences padded, with repeated tokens). The reference knows nothing of the store or its records:
the embedding's per-row output gradients and the head's input and output gradients come from
``torch.func`` (``vmap(grad(...))`` of each sample's own loss), the per-sample parameter gradients from
``reference_per_sample_gradients``; each layer's Fisher block is an explicit ``(P, P)`` matrix
(embedding: ``C ⊗ G`` with ``C`` the diagonal of token frequencies, the eigenbasis ``I ⊗ Q_G`` for
EK-FAC; head: ``G ⊗ C`` on ``[W | b]``), solved with ``torch.linalg.solve``. An embedding this small gets a full
token basis as shipped (``C = T / tr(T)``, ``T = sum_i W_i W_i^T`` of the reference gradients, EK-FAC's basis
``Q_T ⊗ Q_G``: ``basis="tokens"``); ``basis="diagonal"`` lowers
:data:`~metastore_plugins.core.ops.curvature_embedding.TOKEN_BASIS_MAX_PARAMS` to 0, the rule of a large vocabulary.

Tolerance: fp32 records and scores; the damped inverse amplifies that rounding by at most its
condition number (below 2,000 here, checked): ``1e-7 kappa`` relative to the largest score.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import grad, vmap

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core.analysis import GradientStore
from metastore_plugins.core.ops import curvature_embedding
from metastore_plugins.core.training.passes import capture_step
from metastore_plugins.testing import reference_per_sample_gradients

LRS = (0.7, 0.2)  # per pass
VOCAB, WIDTH, LENGTH = 11, 4, 6
TRAINS, TESTS = ["epoch-0/train", "epoch-1/train"], ["epoch-0/test", "epoch-1/test"]


@pytest.fixture(params=["diagonal", "tokens"])
def basis(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "diagonal":
        monkeypatch.setattr(curvature_embedding, "TOKEN_BASIS_MAX_PARAMS", 0)
    return str(request.param)


class TokenBag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH, padding_idx=0)
        self.head = nn.Linear(WIDTH, 3)

    def features(self, e: Tensor, ids: Tensor) -> Tensor:
        """``(..., T, d)`` embedded rows -> ``(..., d)``: tanh, mean over the non-padding tokens."""
        mask = ids.ne(0).to(e.dtype)  # (..., T)
        return (torch.tanh(e) * mask.unsqueeze(-1)).sum(-2) / mask.sum(-1, keepdim=True)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.features(self.embed(ids), ids))


def data(n: int, seed: int, top: int) -> tuple[Tensor, Tensor]:
    """Ids in ``1..top``, padded with 0 after a random length; sample 0 repeats one token."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, LENGTH + 1, (n,), generator=g)
    ids = torch.randint(1, top + 1, (n, LENGTH), generator=g)
    ids[0] = 5
    ids[torch.arange(LENGTH) >= lengths[:, None]] = 0
    return ids, torch.randint(0, 3, (n,), generator=g)


def checkpoints() -> list[TokenBag]:
    """The model at two passes: the second a seeded perturbation of the first."""
    torch.manual_seed(3)
    first = TokenBag().double()
    second = TokenBag().double()
    second.load_state_dict(first.state_dict())
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in second.parameters():
            p += 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype)
        second.embed.weight[0] = 0.0  # the padding row stays zero
    return [first, second]


def per_sample_ce(outputs: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(outputs, labels, reduction="none")


def loss_fn(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch["ids"]), batch["y"])


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> GradientStore:
    path = tmp_path_factory.mktemp("kfac-embedding-store")
    (x, y), (xt, yt) = data(24, 1, 8), data(8, 2, 9)
    with StoreWriter(path, encoding="fp32") as writer:
        for c, model in enumerate(checkpoints()):
            options = {"step": c, "lr": LRS[c]}
            for part in torch.arange(24).split(12):
                forward = (lambda m, p: lambda: m(x[p]))(model, part)
                capture_step(
                    model, forward, y[part], part, per_sample_ce, writer, capture_point=f"epoch-{c}/train", **options
                )
            forward = (lambda m: lambda: m(xt))(model)
            ids = torch.arange(100, 108)
            capture_step(model, forward, yt, ids, per_sample_ce, writer, capture_point=f"epoch-{c}/test", **options)
            model.zero_grad()
    return open_store(path)


def blocks(model: TokenBag, ids: Tensor, y: Tensor, basis: str) -> dict[str, tuple[Tensor, Tensor, Tensor]]:
    """Per layer ``(g (N, P), C, G)``: per-sample gradients in row-major order and the hand K-FAC factors."""
    ref = reference_per_sample_gradients(model, loss_fn, {"ids": ids, "y": y})
    rows = model.embed(ids).detach()  # (N, T, d)
    d_rows = vmap(grad(lambda e, i, t: F.cross_entropy(model.head(model.features(e, i))[None], t[None])))(rows, ids, y)
    kept = ids.ne(0)  # (N, T): padding rows count in neither mean
    d_kept = d_rows.detach()[kept]  # (R, d)
    c_embed = torch.diag(torch.bincount(ids[kept], minlength=VOCAB).double()) / len(d_kept)  # (V, V)
    if basis == "tokens":
        w = ref["embed.weight"]  # (N, V, d)
        tokens = torch.einsum("nvd,nud->vu", w, w)  # (V, V)
        c_embed = tokens / torch.trace(tokens)
    h = model.features(rows, ids).detach()  # (N, d): the head's input
    d_head = vmap(grad(lambda z, t: F.cross_entropy(z[None], t[None])))(model.head(h).detach(), y)  # (N, 3)
    a_head = torch.cat([h, torch.ones(len(h), 1, dtype=h.dtype)], 1)  # (N, d + 1)
    head = torch.cat([ref["head.weight"], ref["head.bias"][:, :, None]], 2).flatten(1)  # [W | b] row-major
    return {
        "embed": (ref["embed.weight"].flatten(1), c_embed, d_kept.T @ d_kept / len(ids)),
        "head": (head, a_head.T @ a_head / len(h), d_head.T @ d_head / len(h)),
    }


def kron(layer: str, on_inputs: Tensor, on_outputs: Tensor) -> Tensor:
    """The Kronecker product in the weight's row-major order: ``(v, k)`` for the embedding, ``(out, in)`` else."""
    first, second = (on_inputs, on_outputs) if layer == "embed" else (on_outputs, on_inputs)
    return torch.kron(first.contiguous(), second.contiguous())


def reference(method: str, basis: str, layers: tuple[str, ...] = ("embed", "head")) -> tuple[np.ndarray, float]:
    """``(24, 8)`` ``sum_c lr_c sum_l g_train^T (F_cl + delta I)^-1 g_test``, and the largest condition number."""
    (x, y), (xt, yt) = data(24, 1, 8), data(8, 2, 9)
    total, kappa = torch.zeros(24, 8, dtype=torch.float64), 0.0
    for lr, model in zip(LRS, checkpoints()):
        train, test = blocks(model, x, y, basis), blocks(model, xt, yt, basis)
        for layer in layers:
            g, c, gg = train[layer]
            fisher = kron(layer, c, gg)
            if method == "ekfac":
                diagonal = layer == "embed" and basis == "diagonal"
                q_c = torch.eye(len(c), dtype=c.dtype) if diagonal else torch.linalg.eigh(c)[1]
                q = kron(layer, q_c, torch.linalg.eigh(gg)[1])
                fisher = q @ torch.diag(((g @ q) ** 2).mean(0)) @ q.T
            damped = fisher + 0.1 * torch.trace(fisher) / len(fisher) * torch.eye(len(fisher), dtype=torch.float64)
            total += lr * g @ torch.linalg.solve(damped, test[layer][0].T)
            kappa = max(kappa, float(torch.linalg.cond(damped)))
    return total.numpy(), kappa


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_kfac_influence_with_the_embedding_is_the_dense_inverse(store: GradientStore, method: str, basis: str) -> None:
    scores = store.kfac_influence(TRAINS, TESTS, method=method)
    expected, kappa = reference(method, basis)
    assert scores.row_ids.tolist() == list(range(24)) and scores.col_ids.tolist() == list(range(100, 108))
    assert kappa < 2000
    assert rel_err(scores.scores, expected) <= 1e-7 * kappa


def test_the_embedding_alone_in_a_small_memory_budget(store: GradientStore, basis: str) -> None:
    scores = store.kfac_influence(TRAINS, TESTS, layers=["embed"], train_ids=[0, 5, 17], max_bytes=4000)
    expected, kappa = reference("ekfac", basis, ("embed",))
    assert scores.row_ids.tolist() == [0, 5, 17]
    assert rel_err(scores.scores, expected[[0, 5, 17]]) <= 1e-7 * kappa
