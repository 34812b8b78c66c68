"""K-FAC / EK-FAC on records against covariances and dense inverses built by hand.

References know nothing of factors or of the code under test: a layer's inputs and output
gradients come from forward hooks and a backward pass of each sample's own loss (one sample
at a time), per-sample gradients from ``torch.func`` (``reference_per_sample_gradients``), and the
preconditioner is an explicit dense ``(G ⊗ C + delta I)^-1`` (K-FAC) or ``Q diag(s + delta)^-1 Q^T``
(EK-FAC) solved with torch.

Tolerances: records hold fp32 factors (relative rounding 6e-8) of float64 models. Covariances are
sums of products of them: ``1e-6`` relative. Preconditioned scores divide by ``Lambda + delta``, which
amplifies that rounding by at most the damped block's condition number ``kappa`` (measured here,
below 2,000): ``1e-7 kappa`` relative to the largest score.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from opscases import get_case, rel_err
from torch import Tensor, nn

from metastore_plugins.core.capture import CaptureSession, LayerRecord
from metastore_plugins.core.errors import RepresentationError
from metastore_plugins.core.ops import curvature as kfac
from metastore_plugins.core.ops import represent, total_dots
from metastore_plugins.core.ops.curvature_rotated import EigenvalueCorrection
from metastore_plugins.core.ops.precondition import precondition
from metastore_plugins.core.records import to_dense
from metastore_plugins.testing import reference_per_sample_gradients


class Tokens(nn.Module):
    """A Linear over padded token sequences (padded rows: zero suffix, dropped by capture), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 10)  # wide enough that capture keeps factors, not dense gradients
        self.head = nn.Linear(10, 3)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x)) * mask.unsqueeze(-1)  # (B, T, 10)
        return self.head(h.sum(1) / mask.sum(1, keepdim=True))


class MLP(nn.Module):
    """Two Linear layers with a LayerNorm (a dense record) between them."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.head(self.norm(torch.tanh(self.inp(x))))


def loss_fn(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch["x"], batch["mask"]), batch["y"])


def make_batch(model: str, size: int, seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    if model == "mlp":
        x = torch.randn(size, 6, generator=g, dtype=torch.float64)
        return {
            "x": x,
            "mask": torch.ones(size, 1, dtype=torch.float64),
            "y": torch.randint(0, 3, (size,), generator=g),
        }
    lengths = torch.randint(1, 5, (size,), generator=g)
    mask = (torch.arange(4) < lengths[:, None]).double()  # (B, T)
    x = torch.randn(size, 4, 12, generator=g, dtype=torch.float64)  # padded rows are not zero
    return {"x": x, "mask": mask, "y": torch.randint(0, 3, (size,), generator=g)}


def build(kind: str) -> nn.Module:
    torch.manual_seed(7)
    return (MLP() if kind == "mlp" else Tokens()).double()


def capture(model: nn.Module, batch: dict[str, Tensor]) -> list[LayerRecord]:
    with CaptureSession(model) as session:
        loss_fn(model, batch).backward()
    model.zero_grad()
    return session.factors()


def hand_factors(model: nn.Module, batch: dict[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """Per Linear layer, ``(rows of [a | 1], rows of d)`` over samples, calls and unpadded tokens."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    rows: dict[str, tuple[list[Tensor], list[Tensor]]] = {name: ([], []) for name in linears}
    for i in range(batch["y"].shape[0]):
        seen: dict[str, list[tuple[Tensor, Tensor]]] = {name: [] for name in linears}
        hooks = [
            m.register_forward_hook(lambda mod, inp, out, found=seen[name]: found.append((inp[0], out)))
            for name, m in linears.items()
        ]
        loss = loss_fn(model, {key: value[i : i + 1] for key, value in batch.items()})  # sample i's own loss
        for hook in hooks:
            hook.remove()
        calls = [(name, a, out) for name, found in seen.items() for a, out in found]
        grads = torch.autograd.grad(loss, [out for _, _, out in calls])
        for (name, a, _), d in zip(calls, grads):
            keep = batch["mask"][i].bool() if a.dim() == 3 else torch.ones(1, dtype=torch.bool)  # tokens of sample i
            a_rows = a.detach().reshape(-1, a.shape[-1])[keep]  # (T_i, d_in)
            rows[name][0].append(torch.cat([a_rows, torch.ones(len(a_rows), 1, dtype=a.dtype)], 1))
            rows[name][1].append(d.reshape(-1, d.shape[-1])[keep])  # (T_i, d_out)
    return {name: (torch.cat(a), torch.cat(d)) for name, (a, d) in rows.items()}


def hand_covariances(model: nn.Module, batch: dict[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """``C = mean over kept rows of a' a'^T``, ``G = (1/N) sum over rows of d d^T``."""
    n = batch["y"].shape[0]
    return {name: (a.T @ a / len(a), d.T @ d / n) for name, (a, d) in hand_factors(model, batch).items()}


def blocks(model: nn.Module, ref: dict[str, Tensor], records: list[LayerRecord]) -> dict[str, Tensor]:
    """Per layer, ``(B, P)`` reference gradients: ``[W | b]`` row-major for a Linear, ``(weight, bias)`` else."""
    out = {}
    for record in records:
        w, b = ref[f"{record.layer}.weight"], ref[f"{record.layer}.bias"]
        if record.kind == "outer":
            out[record.layer] = torch.cat([w, b[:, :, None]], 2).reshape(len(w), -1)  # (B, d_out (d_in + 1))
        else:
            out[record.layer] = torch.cat([ref[name].reshape(len(w), -1) for name in record.params.values()], 1)
    return out


def reference_scores(kind: str, method: str, full_limit: int) -> tuple[Tensor, float]:
    """``sum_l g_train_l^T (F_l + delta_l I)^-1 g_test_l`` with explicit dense ``F_l``, and the largest ``kappa``."""
    model, train, test = build(kind), make_batch(kind, 24, 1), make_batch(kind, 7, 2)
    covariances = hand_covariances(model, train)
    ref_train = reference_per_sample_gradients(model, loss_fn, train)
    ref_test = reference_per_sample_gradients(model, loss_fn, test)
    records = capture(model, train)
    g_train, g_test = blocks(model, ref_train, records), blocks(model, ref_test, records)
    total, kappa = torch.zeros(24, 7, dtype=torch.float64), 0.0
    for layer, g in g_train.items():
        if layer in covariances:
            c, gg = covariances[layer]
            fisher = torch.kron(gg, c)  # (P, P): G ⊗ C in [W | b] row-major order
            if method == "ekfac":
                q = torch.kron(torch.linalg.eigh(gg)[1], torch.linalg.eigh(c)[1])  # (P, P)
                s = ((g @ q) ** 2).mean(0)  # (P,) the exact second moments in that basis
                fisher = q @ torch.diag(s) @ q.T
        else:  # a dense layer: its empirical Fisher, full or diagonal
            fisher = g.T @ g / len(g)
            if g.shape[1] > full_limit:
                fisher = torch.diag(torch.diagonal(fisher))
        damping = 0.1 * torch.trace(fisher) / len(fisher)  # 0.1 x the mean eigenvalue
        damped = fisher + damping * torch.eye(len(fisher), dtype=torch.float64)
        total += g @ torch.linalg.solve(damped, g_test[layer].T)  # (N, M)
        kappa = max(kappa, float(torch.linalg.cond(damped)))
    return total, kappa


def store_scores(kind: str, method: str, power: float = 1.0) -> Tensor:
    """The code under test: sums over two train batches, fit, precondition the test batch, factored dots; with
    ``power = 0.5`` both sides are multiplied by the square root instead (``<S g_i, S g_j>``)."""
    model, train, test = build(kind), make_batch(kind, 24, 1), make_batch(kind, 7, 2)
    halves = [{key: value[lo : lo + 12] for key, value in train.items()} for lo in (0, 12)]
    sums = kfac.CurvatureSums()
    train_records = [capture(model, half) for half in halves]
    for records in train_records:
        sums.add(records)
    curvature = sums.fit()
    if method == "ekfac":
        correction = EigenvalueCorrection(curvature)
        for records in train_records:
            correction.add(records)
        curvature = correction.fit()
    preconditioned = precondition(capture(model, test), curvature, power=power)
    if power != 1.0:
        train_records = [precondition(records, curvature, power=power) for records in train_records]
    return torch.cat([total_dots(records, preconditioned) for records in train_records]).double()  # (N, M)


@pytest.mark.parametrize("kind", ["mlp", "tokens"])
def test_kronecker_factors_are_the_hand_covariances(kind: str) -> None:
    model, train = build(kind), make_batch(kind, 24, 1)
    expected = hand_covariances(model, train)
    sums = kfac.CurvatureSums()
    for lo in (0, 12):
        sums.add(capture(model, {key: value[lo : lo + 12] for key, value in train.items()}))
    for layer, (c, g) in expected.items():
        got_c, got_g = sums.layers[layer].covariances()
        assert got_g is not None and got_c.shape == (1, *c.shape) and got_g.shape == (1, *g.shape)
        assert rel_err(got_c[0], c) <= 1e-6 and rel_err(got_g[0], g) <= 1e-6, layer
    if kind == "tokens":  # padded rows were dropped: fewer rows than B x T
        assert sums.layers["inp"].rows == int(train["mask"].sum()) < train["mask"].numel()


@pytest.mark.parametrize("kind", ["mlp", "tokens"])
@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_preconditioned_influence_is_the_dense_inverse(kind: str, method: str) -> None:
    expected, kappa = reference_scores(kind, method, kfac.FULL_FISHER_MAX_PARAMS)
    assert kappa < 2000  # the tolerance below assumes it
    assert rel_err(store_scores(kind, method), expected) <= 1e-7 * kappa


@pytest.mark.parametrize("kind", ["mlp", "tokens"])
@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_the_square_root_on_both_sides_is_the_dense_inverse(kind: str, method: str) -> None:
    """``<S g_i, S g_j>`` with ``S = (F + delta I)^-1/2`` (``power=0.5``): what the preconditioned index sketches."""
    expected, kappa = reference_scores(kind, method, kfac.FULL_FISHER_MAX_PARAMS)
    assert rel_err(store_scores(kind, method, power=0.5), expected) <= 1e-7 * kappa


def test_large_dense_layers_get_a_diagonal_fisher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kfac, "FULL_FISHER_MAX_PARAMS", 8)  # LayerNorm(8) has 16 parameters
    expected, kappa = reference_scores("mlp", "kfac", 8)
    assert rel_err(store_scores("mlp", "kfac"), expected) <= 1e-7 * kappa


def test_ekfac_and_kfac_differ_and_absolute_damping_is_used() -> None:
    model, train = build("tokens"), make_batch("tokens", 12, 1)
    records = capture(model, train)
    sums = kfac.CurvatureSums()
    sums.add(records)
    fitted = sums.fit()
    correction = EigenvalueCorrection(fitted)
    correction.add(records)
    corrected = correction.fit()
    assert rel_err(corrected["inp"].eigenvalues, fitted["inp"].eigenvalues) > 0.01
    assert fitted["inp"].damping(0.5) == 0.5
    a = total_dots(records, precondition(records, fitted, damping=1e6))
    b = total_dots(records, precondition(records, fitted, damping=2e6))
    assert rel_err(2 * b.double(), a.double()) < 1e-3  # (F + lambda I)^-1 ~ I / lambda for a huge lambda


def test_tied_records_of_one_layer_are_one_block() -> None:
    case = get_case("tied")  # one Linear called twice over sequences: two records per batch
    sums = kfac.CurvatureSums()
    sums.add(case.train_records)
    shared = [r for r in case.train_records if r.layer == "shared"]
    assert len(shared) == 2 and sums.layers["shared"].rows == sum(len(r.tensors["sample"]) for r in shared)
    fitted = sums.fit()
    correction = EigenvalueCorrection(fitted)
    correction.add(case.train_records)
    corrected = correction.fit()["shared"]
    q = torch.kron(corrected.q_out[0], corrected.q_in[0])  # (P, P)
    g = torch.cat([case.train_ref["shared.weight"], case.train_ref["shared.bias"][:, :, None]], 2).flatten(1)
    assert rel_err(corrected.eigenvalues[0].flatten(), ((g @ q) ** 2).mean(0)) <= 1e-5  # the summed gradient's


def test_layers_kfac_cannot_fit_are_named() -> None:
    with pytest.raises(ValueError, match="shares a parameter.*layers="):
        kfac.CurvatureSums().add(get_case("tied-lm").train_records)  # an embedding tied to the output layer
    projected = [represent.projected_record([r], 2, 2) for r in get_case("layernorm").train_records[:1]]
    with pytest.raises(RepresentationError, match="K-FAC"):
        kfac.CurvatureSums().add(projected)


def test_dense_batches_of_a_factored_layer() -> None:
    """Capture keeps whichever is smaller per batch: a dense batch of a Kronecker layer is rotated, not lost."""
    model, train, test = build("tokens"), make_batch("tokens", 24, 1), make_batch("tokens", 7, 2)
    halves = [capture(model, {key: value[lo : lo + 12] for key, value in train.items()}) for lo in (0, 12)]
    mixed = [to_dense(r) if r.layer == "inp" else r for r in halves[1]]
    sums = kfac.CurvatureSums()
    for records in (halves[0], mixed):
        sums.add(records)
    c, g = hand_covariances(model, {key: value[:12] for key, value in train.items()})["inp"]  # the factored half
    got_c, got_g = sums.layers["inp"].covariances()
    assert got_g is not None and rel_err(got_c[0], c) <= 1e-6 and rel_err(got_g[0], g) <= 1e-6
    fitted = sums.fit()
    assert fitted["inp"].kind == "outer"
    corrections = [EigenvalueCorrection(fitted) for _ in range(2)]
    for records, correction in zip((halves[1], mixed), corrections):
        correction.add(halves[0])
        correction.add(records)
    values = [correction.fit()["inp"].eigenvalues for correction in corrections]
    assert rel_err(values[1], values[0]) <= 1e-6  # the same gradients, held dense or factored
    test_records = capture(model, test)
    factored = total_dots(halves[0], precondition(test_records, fitted)).double()
    dense = total_dots(halves[0], precondition([to_dense(r) for r in test_records], fitted)).double()
    assert rel_err(dense, factored) <= 1e-6
