"""Projected checkpoint passes on the curvature eigenbasis: what is kept, and the K-FAC / EK-FAC scores on it.

The reference is built by hand from ``torch.func`` per-sample gradients at the pass's weights: the
K-FAC factors ``C = mean [a, 1][a, 1]^T`` and ``G = mean d d^T`` (``d``: each sample's own bias
gradient), their top eigenvectors, each sample's ``Q_D^T [W_i | b_i] Q_A``, and the scores
``sum R_i R_j / (Lambda + delta)``. Eigenvectors have a sign of their own choosing, so records are
compared through sign-free quantities (inner products, squares).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import TensorDataset
from torch.utils.tensorboard import SummaryWriter

from metastore_plugins import open_store
from metastore_plugins.core.errors import RepresentationError
from metastore_plugins.core.model.pass_sources import PassSource
from metastore_plugins.core.ops.sketch import projection
from metastore_plugins.core.policy.budget import Budget
from metastore_plugins.core.policy.plan import LADDER
from metastore_plugins.core.policy.plan_record import CapturePlan
from metastore_plugins.core.training import basis_fit
from metastore_plugins.core.training.report_pass import report_run
from metastore_plugins.core.training.run import RunCapture

K = 3
F64 = torch.float64


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5))


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 5, (n,), generator=g))


def _capture(
    path: Path, model: nn.Module, steps: tuple[int, ...] = (5,), basis_samples: int | None = None, apart: bool = False
) -> None:
    """Passes ``epoch-e/train`` (24 samples) and ``epoch-e/test`` (10) at each step, every layer projected k=3.

    The basis is fitted in the training side's own forward and backward (its factors are measured, 1 KB a sample),
    or ``apart`` in a forward and backward of its own (a rank's share of factors would exceed what a fit holds)."""
    run = RunCapture(path, encoding="fp32", budget=Budget("auto", None))
    run.basis_samples = run.basis_samples if basis_samples is None else basis_samples
    # apart: 24 samples hold 1.2x what a fit may hold; batches of 8 still within a pass batch's bytes
    run.policy.factor_sample_bytes = basis_fit.HELD_FIT_BYTES / 20 if apart else 1000.0
    run.policy.plan = CapturePlan(
        "auto", None, "test", "fp32", K, {"0": "exact", "2": "exact"}, {"0": "projected", "2": "projected"}, 0, 2, {}
    )
    train, test = _data(24, 1), _data(10, 2)
    sources = [PassSource("train", train, list(range(24)), 8), PassSource("test", test, list(range(10)), 4)]

    def loss_of(batch: Any, k: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    try:
        for epoch, step in enumerate(steps):
            run.checkpoint_passes(model, sources, loss_of, name=f"epoch-{epoch}", rank=0, world_size=1,
                                  to_device=lambda b: b, step=step, epoch=epoch, lr=0.1)  # fmt: skip
            with torch.no_grad():
                model[0].weight.add_(0.05)  # the next checkpoint's weights differ
    finally:
        run.close()


def _per_sample(model: nn.Module, data: TensorDataset) -> dict[str, Tensor]:
    """Per-sample gradients of each sample's own loss (torch.func), float64."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    x, y = data.tensors
    return {k: v.to(F64) for k, v in vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y).items()}


def _layer_input(model: nn.Module, layer: int, x: Tensor) -> Tensor:
    return x if layer == 0 else torch.tanh(model[0](x)).detach()


def _reference(model: nn.Module, layer: int) -> dict[str, Tensor]:
    """Hand-built K-FAC of ``layer`` on the training pass, its top k x k basis, and each sample's block."""
    train, test = _data(24, 1), _data(10, 2)
    out: dict[str, Tensor] = {}
    basis: dict[str, Tensor] = {}
    for name, data in (("train", train), ("test", test)):
        g = _per_sample(model, data)
        w, b = g[f"{layer}.weight"], g[f"{layer}.bias"]  # (N, d_out, d_in), (N, d_out)
        if name == "train":
            a = torch.cat([_layer_input(model, layer, data.tensors[0]).to(F64), torch.ones(len(b), 1, dtype=F64)], 1)
            c, gg = a.T @ a / len(a), b.T @ b / len(b)  # (d_in', d_in'), (d_out, d_out)
            l_a, q_a = torch.linalg.eigh(c)
            l_d, q_d = torch.linalg.eigh(gg)
            basis = {"q_a": q_a[:, -K:].flip(1), "q_d": q_d[:, -K:].flip(1)}
            out["kfac"] = l_d[-K:].flip(0)[:, None] * l_a[-K:].flip(0)[None, :]  # (K, K)
            out["mean"] = l_a.clamp_min(0).mean() * l_d.clamp_min(0).mean()
        full = torch.cat([w, b[:, :, None]], 2)  # (N, d_out, d_in')
        out[name] = basis["q_d"].T @ full @ basis["q_a"]  # (N, K, K)
    return out


@pytest.fixture(scope="module", params=["fitted in the pass", "fitted apart"])
def captured(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> tuple[Path, nn.Module]:
    path = tmp_path_factory.mktemp("eigenbasis") / "store"
    model = _model().eval()
    reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _capture(path, model, apart=request.param == "fitted apart")
    model.load_state_dict(reference)  # the weights the first checkpoint's passes ran at
    return path, model


def test_pass_records_are_the_top_block_of_the_hand_built_kfac_basis(captured: tuple[Path, nn.Module]) -> None:
    path, model = captured
    store = open_store(path)
    assert store.verify() == []
    for layer in (0, 2):
        ref = _reference(model, layer)
        for split in ("train", "test"):
            records = [r for b in store.select(f"epoch-0/{split}", layers=[str(layer)]).batches() for r in b.records]
            assert all(r.kind == "projected" and r.basis == 5 for r in records)
            kept = torch.cat([r.tensors["projected"] for r in records]).to(F64)  # (N, K, K)
            got, want = kept.flatten(1), ref[split].flatten(1)
            torch.testing.assert_close(got @ got.T, want @ want.T, rtol=1e-4, atol=1e-7)  # sign-free
            torch.testing.assert_close(got.square(), want.square(), rtol=1e-4, atol=1e-7)
            first = records[0].tensors
            torch.testing.assert_close(first["eigenvalues"].to(F64), ref["kfac"], rtol=1e-4, atol=1e-9)
            torch.testing.assert_close(float(first["mean_eigenvalue"]), float(ref["mean"]), rtol=1e-4, atol=1e-9)
    assert store.config["capture_plan"]["bases"] == [5]


@pytest.mark.parametrize("method", ["ekfac", "kfac"])
def test_kfac_influence_on_eigenbasis_records_is_the_scaled_block_product(
    captured: tuple[Path, nn.Module], method: str
) -> None:
    path, model = captured
    store = open_store(path)
    scores = store.kfac_influence("epoch-0/train", "epoch-0/test", method=method)
    lr = store.learning_rate("epoch-0/train")
    want = torch.zeros(24, 10, dtype=F64)
    for layer in (0, 2):
        ref = _reference(model, layer)
        train, test = ref["train"].flatten(1), ref["test"].flatten(1)  # (N, K*K), (M, K*K)
        values = train.square().mean(0) if method == "ekfac" else ref["kfac"].flatten()
        want += (train / (values + 0.1 * ref["mean"])) @ test.T
    got = torch.as_tensor(scores.scores)[scores.row_ids.argsort()][:, scores.col_ids.argsort()]
    torch.testing.assert_close(got.to(F64), lr * want, rtol=2e-4, atol=1e-6)


@pytest.mark.parametrize("apart", [False, True])
def test_the_training_side_is_read_once_for_its_fit_and_its_records(tmp_path: Path, apart: bool) -> None:
    """24 training samples in batches of 8, 10 test samples in batches of 4: 3 + 3 forwards when the basis is fitted
    in the training side's own forward and backward, 3 more when a rank's share of factors exceeds what a fit holds
    (``apart``). Nothing else differs: the records are checked against the hand-built basis with both."""
    model = _model().eval()
    forwards: list[int] = []
    model.register_forward_hook(lambda module, args, output: forwards.append(len(args[0])))
    _capture(tmp_path / "store", model, apart=apart)
    assert forwards == ([8, 8, 8] if apart else []) + [8, 8, 8, 4, 4, 2]
    assert _bases(tmp_path / "store", "epoch-0/train") == _bases(tmp_path / "store", "epoch-0/test") == {5}


def _bases(path: Path, point: str) -> set[int | None]:
    return {r.basis for b in open_store(path).select(point).batches() for r in b.records}


def test_the_last_pass_keeps_the_latest_basis_unless_it_holds_more_samples_than_a_fit(tmp_path: Path) -> None:
    """No step comes after the last planned pass: a fit there would serve only its own 24 training samples."""
    _capture(tmp_path / "kept", _model().eval(), steps=(5, 9))  # a fit takes up to 256 samples: more than 24
    assert _bases(tmp_path / "kept", "epoch-1/train") == _bases(tmp_path / "kept", "epoch-1/test") == {5}
    _capture(tmp_path / "refit", _model().eval(), steps=(5, 9), basis_samples=8)  # the pass holds more than a fit
    assert _bases(tmp_path / "refit", "epoch-1/train") == _bases(tmp_path / "refit", "epoch-1/test") == {9}
    assert _bases(tmp_path / "refit", "epoch-0/test") == {5}


def test_passes_of_two_checkpoints_never_meet(tmp_path: Path) -> None:
    _capture(tmp_path / "store", _model().eval(), steps=(5, 9), basis_samples=8)  # the last pass refits
    store = open_store(tmp_path / "store")
    with pytest.raises(RepresentationError, match="eigenbasis of step"):
        store.kfac_influence("epoch-0/train", "epoch-1/test")
    with pytest.raises(RepresentationError, match="eigenbasis of step"):
        store.influence("epoch-0/train", "epoch-1/test")
    with pytest.raises(RepresentationError, match="do not compare"):
        store.kernel_influence("epoch-0/train", "epoch-1/test", dim=K)
    assert store.kfac_influence("epoch-1/train", "epoch-1/test").scores.shape == (24, 10)
    kept = torch.cat([r.tensors["projected"] for b in store.select("epoch-1/test").batches() for r in b.records
                      if r.layer == "0"]).flatten(1)  # fmt: skip
    sketches = torch.as_tensor(store.sketches("epoch-1/test", dim=K, layers=["0"], cache=False))
    torch.testing.assert_close(sketches.float(), kept.float())  # the records are their own sketch
    same = store.kernel_influence("epoch-1/train", "epoch-1/test", dim=K)  # one basis: paired
    assert same.scores.shape == (24, 10) and np.isfinite(same.scores).all()


def test_preconditioned_self_influence_on_eigenbasis_records(captured: tuple[Path, nn.Module]) -> None:
    path, model = captured
    store = open_store(path)
    got = store.self_influence("epoch-0/train", method="ekfac")
    want = torch.zeros(24, dtype=F64)
    for layer in (0, 2):
        ref = _reference(model, layer)
        train = ref["train"].flatten(1)  # (N, K*K)
        want += (train.square() / (train.square().mean(0) + 0.1 * ref["mean"])).sum(1)
    order = store.sample_ids("epoch-0/train").argsort()
    torch.testing.assert_close(torch.as_tensor(got)[order].to(F64), store.learning_rate("epoch-0/train") * want,
                               rtol=2e-4, atol=1e-7)  # fmt: skip


class _Bag(nn.Module):
    """Token ids -> embedding, mean over positions, linear head: an embedding layer and a Linear one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.emb, self.head = nn.Embedding(11, 5), nn.Linear(5, 3)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.emb(ids).mean(1))


def _tokens(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, 11, (n, 4), generator=g), torch.randint(0, 3, (n,), generator=g))


def test_an_embedding_layer_keeps_the_seeded_vocabulary_side_and_the_output_eigenbasis(tmp_path: Path) -> None:
    model = _Bag().eval()
    train, test = _tokens(20, 1), _tokens(6, 2)
    run = RunCapture(tmp_path / "store", encoding="fp32", budget=Budget("auto", None))
    both = {"emb": "projected", "head": "projected"}
    run.policy.plan = CapturePlan("auto", None, "test", "fp32", K, dict(both), dict(both), 0, 1, {})
    sources = [PassSource("train", train, list(range(20)), 8), PassSource("test", test, list(range(6)), 4)]
    try:
        run.checkpoint_passes(model, sources, lambda b, k: F.cross_entropy(model(b[0]), b[1]), name="epoch-0",
                              rank=0, world_size=1, to_device=lambda b: b, step=4, epoch=0, lr=0.5)  # fmt: skip
    finally:
        run.close()
    store = open_store(tmp_path / "store")

    def rows(data: TensorDataset) -> Tensor:
        """(N, 4, 5) each sample's own loss gradient w.r.t. its embedded tokens (torch.func)."""
        ids, y = data.tensors
        embedded = model.emb(ids).detach()
        head = {k: v.detach() for k, v in model.head.named_parameters()}

        def loss(e: Tensor, label: Tensor) -> Tensor:
            return F.cross_entropy(functional_call(model.head, head, (e.mean(0)[None],)), label[None])

        return vmap(grad(loss))(embedded, y).to(F64)

    d_train, d_test = rows(train), rows(test)
    ids_train, ids_test = train.tensors[0], test.tensors[0]
    counts = torch.bincount(ids_train.reshape(-1), minlength=11).to(F64)
    frequencies = counts / ids_train.numel()  # C = diag(f): one row per token
    gg = torch.einsum("ntd,nte->de", d_train, d_train) / 20  # summed over a sample's rows, mean over samples
    l_d, q_d = torch.linalg.eigh(gg)
    q = q_d[:, -K:].flip(1)  # (5, K)
    p = projection("out", "emb", 0, (K, 11), K, torch.device("cpu")).to(F64)  # (K, 11)

    def blocks(ids: Tensor, d: Tensor) -> Tensor:  # (N, K, K) P W_i Q_D, W_i = sum_t e_{v_t} d_t^T
        w = torch.zeros(len(ids), 11, 5, dtype=F64).index_put_(
            (torch.arange(len(ids))[:, None].expand_as(ids), ids), d, accumulate=True
        )
        return p @ w @ q

    want = {"train": blocks(ids_train, d_train), "test": blocks(ids_test, d_test)}
    for split in ("train", "test"):
        records = [r for b in store.select(f"epoch-0/{split}", layers=["emb"]).batches() for r in b.records]
        record = records[0]
        kept = torch.cat([r.tensors["projected"] for r in records]).to(F64).flatten(1)  # (N, K*K)
        ref = want[split].flatten(1)
        assert record.basis == 4
        torch.testing.assert_close(kept @ kept.T, ref @ ref.T, rtol=1e-4, atol=1e-8)
        torch.testing.assert_close(kept.square(), ref.square(), rtol=1e-4, atol=1e-8)
    values = (p.square() @ frequencies)[:, None] * l_d[-K:].flip(0)[None, :]
    tiny = 1e-6 * float(values.abs().max())  # fitted in float32: the near-zero eigenvalues are rounding of the largest
    torch.testing.assert_close(record.tensors["eigenvalues"].to(F64), values, rtol=1e-4, atol=tiny)
    torch.testing.assert_close(float(record.tensors["mean_eigenvalue"]), float(frequencies.mean() * l_d.mean()),
                               rtol=1e-4, atol=1e-10)  # fmt: skip
    scores = store.kfac_influence("epoch-0/train", "epoch-0/test", layers=["emb"])
    train_blocks, test_blocks = want["train"].flatten(1), want["test"].flatten(1)
    expected = (train_blocks / (train_blocks.square().mean(0) + 0.1 * frequencies.mean() * l_d.mean())) @ test_blocks.T
    got = torch.as_tensor(scores.scores)[scores.row_ids.argsort()][:, scores.col_ids.argsort()].to(F64)
    torch.testing.assert_close(got, store.learning_rate("epoch-0/train") * expected, rtol=2e-4, atol=1e-7)


def test_the_reports_of_an_eigenbasis_store_use_ekfac_and_draw_the_projector(
    captured: tuple[Path, nn.Module], tmp_path: Path
) -> None:
    path, _ = captured
    with SummaryWriter(str(tmp_path / "tb")) as writer:
        result = report_run(path, tmp_path / "reports", [writer], k=3, test_split="test", recompute=None)
    assert result is not None
    assert {row["method"] for row in result["influence"]} == {"ekfac"}
    assert (tmp_path / "tb" / "projector_config.pbtxt").is_file()  # the sketches of the last pass: its records


def test_a_narrow_layer_block_is_zero_padded_to_the_sketch_size_asked(captured: tuple[Path, nn.Module]) -> None:
    store = open_store(captured[0])
    records = [r for b in store.select("epoch-0/test", layers=["2"]).batches() for r in b.records]
    block = torch.cat([r.tensors["projected"] for r in records])  # (N, 3, 3): the head's block
    padded = torch.as_tensor(store.sketches("epoch-0/test", dim=5, layers=["2"], cache=False)).reshape(-1, 5, 5)
    torch.testing.assert_close(padded[:, :3, :3].float(), block.float())
    assert float(padded[:, 3:, :].abs().sum() + padded[:, :, 3:].abs().sum()) == 0.0  # the padding only


@pytest.mark.parametrize("method", ["ekfac", "kfac"])
def test_some_samples_and_joined_batches_keep_the_basis_tensors_whole(
    captured: tuple[Path, nn.Module], method: str
) -> None:
    path, model = captured
    store = open_store(path)
    whole = store.kfac_influence("epoch-0/train", "epoch-0/test", method=method)
    some = store.kfac_influence("epoch-0/train", "epoch-0/test", method=method, train_ids=[1, 9, 17], test_ids=[0, 7])
    rows, cols = (
        [list(whole.row_ids).index(i) for i in some.row_ids],
        [list(whole.col_ids).index(j) for j in some.col_ids],
    )
    np.testing.assert_allclose(some.scores, whole.scores[np.ix_(rows, cols)], rtol=1e-5, atol=1e-7)
    ids = store.sample_ids("epoch-0/train")
    one_by_one = store.self_influence("epoch-0/train", method=method, max_bytes=1)  # batch by batch
    joined = store.self_influence("epoch-0/train", method=method)  # batches joined within max_bytes
    np.testing.assert_allclose(joined, one_by_one, rtol=1e-5, atol=1e-7)
    assert len(joined) == len(ids)


def test_passes_lowered_to_a_smaller_projection_are_fitted_at_that_size(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(20, 12), nn.Tanh(), nn.Linear(12, 3)).eval()
    run = RunCapture(tmp_path / "store", encoding="fp32", budget=Budget("auto", None))
    both = {"0": "projected", "2": "exact"}
    run.policy.plan = CapturePlan("auto", None, "test", "fp32", 16, dict(both), dict(both), 0, 1, {})
    run.policy._rungs["passes"] = LADDER.index(("projected", 8))  # the run outgrew its plan before this pass
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 20, generator=g), torch.randint(0, 3, (16,), generator=g))
    try:
        run.checkpoint_passes(model, [PassSource("train", data, list(range(16)), 8)],
                              lambda b, k: F.cross_entropy(model(b[0]), b[1]), name="epoch-0", rank=0, world_size=1,
                              to_device=lambda b: b, step=2, epoch=0, lr=0.1)  # fmt: skip
    finally:
        run.close()
    records = [
        r for b in open_store(tmp_path / "store").select("epoch-0/train", layers=["0"]).batches() for r in b.records
    ]
    assert {tuple(r.tensors["projected"].shape[1:]) for r in records} == {(8, 8)}  # not the plan's 16: (12, 16)
    assert {r.basis for r in records} == {2}
