"""The peers of the LDS benchmark: dattri's TRAK and explicit influence functions, tuned on held-out rows.

Hyperparameters (TRAK's regularization, the influence functions' damping) are picked on a tuning
split, never on the reported test samples (:class:`~.lds.Setup`). A peer that fails on this
torch version is reported, not fatal.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.quality.digits import make_model, train_model

if TYPE_CHECKING:
    from benchmarks.quality.lds import Setup, Tuning

T = TypeVar("T")


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """``(fn(), seconds)``."""
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def pick(grid: tuple[float, ...], fn: Callable[[float], np.ndarray], m: int, tuning: Tuning | None) -> dict[str, Any]:
    """Run ``fn(value) -> (N, M + T)`` for each value of ``grid``; keep the best on the tuning columns."""
    runs = {value: timed(partial(fn, value)) for value in grid}
    lds = {value: tuning.lds(scores[:, m:]) for value, (scores, _) in runs.items()} if tuning else {}
    best = max(lds, key=lambda v: lds[v]) if lds else grid[0]
    scores, seconds = runs[best]
    tuning_seconds = sum(t for v, (_, t) in runs.items() if v != best)
    return {"scores": scores[:, :m], "seconds": seconds, "value": best, "tuning": lds, "tuning_seconds": tuning_seconds}


def tune_damping(
    model: nn.Module, x: Tensor, y: Tensor, x_tune: Tensor, y_tune: Tensor, grid: tuple[float, ...], tuning: Tuning
) -> tuple[float, dict[float, float]]:
    """The damping ``lambda`` whose ``g_i^T (H + lambda I)^-1 g_j`` has the best tuning LDS.

    ``H`` is the Hessian of the mean training loss (what dattri's explicit attributor inverts),
    diagonalised once, ``H = Q diag(e) Q^T``, so each damping costs one product.
    """
    names = [name for name, _ in model.named_parameters()]
    params = {name: p.detach() for name, p in model.named_parameters()}
    shapes, sizes = [params[k].shape for k in names], [params[k].numel() for k in names]
    flat = torch.cat([params[k].reshape(-1) for k in names])  # (P,)

    def loss(v: Tensor, xb: Tensor, yb: Tensor) -> Tensor:
        unflat = {k: t.reshape(shape) for k, t, shape in zip(names, v.split(sizes), shapes)}
        return F.cross_entropy(torch.func.functional_call(model, unflat, xb), yb)

    def grads(xs: Tensor, ys: Tensor) -> Tensor:  # (B, P)
        one = torch.func.grad(lambda v, xi, yi: loss(v, xi[None], yi[None]))
        return torch.func.vmap(one, in_dims=(None, 0, 0))(flat, xs, ys)

    eig, q = torch.linalg.eigh(torch.func.hessian(loss)(flat, x, y).double())  # (P,), (P, P)
    left, right = grads(x, y).double() @ q, grads(x_tune, y_tune).double() @ q  # (N, P), (T, P)
    lds = {damping: tuning.lds(((left / (eig + damping)) @ right.T).numpy()) for damping in grid}
    return max(lds, key=lambda v: lds[v]), lds


def dattri_attributors(
    setup: Setup,
    data: tuple[Tensor, Tensor, Tensor, Tensor],
    checkpoints: list[dict[str, Tensor]],
    tuning: Tuning | None,
) -> dict[str, dict[str, Any]]:
    """dattri's TRAK (final model, epoch checkpoints, ensemble) and explicit influence functions.

    ``data``'s test part holds the reported rows, then the tuning rows. Returns
    ``{name: {"scores": (N, M), "seconds", "trainings", "value", "tuning"}}`` or ``{"error": ...}``.
    """
    x, y, x_test, y_test = data
    m = setup.test_samples
    try:
        import dattri.algorithm.base
        import dattri.algorithm.trak
        from dattri.algorithm.influence_function import IFAttributorExplicit
        from dattri.algorithm.trak import TRAKAttributor
        from dattri.task import AttributionTask
        from torch.utils.data import DataLoader, TensorDataset
        from tqdm import tqdm
    except Exception as error:  # noqa: BLE001  (any import failure: reported, not fatal)
        return {"dattri": {"error": f"dattri does not import: {error!r}"}}
    for module in (dattri.algorithm.base, dattri.algorithm.trak):
        module.tqdm = partial(tqdm, disable=True)  # type: ignore[attr-defined,unused-ignore]  # no progress bars
    model, classes = make_model(setup.kind, setup.seed), 10
    call = torch.func.functional_call

    def logits(params: dict[str, Tensor], image: Tensor) -> Tensor:
        return call(model, params, image.unsqueeze(0))[0]  # (C,)

    def margin(params: dict[str, Tensor], data: tuple[Tensor, Tensor]) -> Tensor:  # one sample: TRAK's output
        z, own = logits(params, data[0]), torch.arange(classes) == data[1]  # (C,), (C,)
        return (z * own).sum() - z.masked_fill(own, float("-inf")).logsumexp(0)

    def probability(params: dict[str, Tensor], data: tuple[Tensor, Tensor]) -> Tensor:
        return torch.softmax(logits(params, data[0]), 0).gather(0, data[1].reshape(1))[0]

    def mean_loss(params: dict[str, Tensor], data: tuple[Tensor, Tensor]) -> Tensor:  # a batch
        return F.cross_entropy(call(model, params, data[0]), data[1])

    def loader(a: Tensor, b: Tensor, batch: int = 256) -> DataLoader:
        return DataLoader(TensorDataset(a, b), batch_size=batch, shuffle=False)

    def trak(states: list[dict[str, Tensor]], regularization: float) -> np.ndarray:
        task = AttributionTask(loss_func=margin, model=model, checkpoints=states)
        attributor = TRAKAttributor(task, probability, device="cpu", regularization=regularization)
        attributor.cache(loader(x, y))
        return attributor.attribute(loader(x_test, y_test)).detach().double().numpy()  # (N, M + T)

    def ensemble() -> list[dict[str, Tensor]]:
        states = [checkpoints[-1]]
        for k in range(1, setup.ensemble):
            other = train_model(make_model(setup.kind, setup.seed + k), x, y, epochs=setup.epochs, seed=setup.seed + k)
            states.append({name: t.detach().clone() for name, t in other.state_dict().items()})
        return states

    def explicit_if() -> dict[str, Any]:
        final = make_model(setup.kind, setup.seed)
        final.load_state_dict(checkpoints[-1])
        tuned: dict[float, float] = {}
        damping, start = setup.dampings[0], time.perf_counter()
        if tuning is not None and len(setup.dampings) > 1:
            damping, tuned = tune_damping(final, x, y, x_test[m:], y_test[m:], setup.dampings, tuning)
        tuning_seconds = time.perf_counter() - start
        task = AttributionTask(loss_func=mean_loss, model=model, checkpoints=checkpoints[-1])
        attributor = IFAttributorExplicit(task, device="cpu", regularization=damping)
        attributor.cache(loader(x, y, len(y)))
        scores, seconds = timed(
            lambda: attributor.attribute(loader(x, y, len(y)), loader(x_test[:m], y_test[:m], m)).detach().numpy()
        )  # (N, M): g_train^T (H + damping I)^-1 g_test; > 0: the train sample lowers the test loss
        return {
            "scores": scores,
            "seconds": seconds,
            "value": damping,
            "tuning": tuned,
            "tuning_seconds": tuning_seconds,
        }

    peers: dict[str, tuple[Callable[[], dict[str, Any]], int]] = {
        "dattri TRAK (final model)": (
            lambda: pick(setup.trak_regularizations, lambda r: trak(checkpoints[-1:], r), m, tuning),
            1,
        ),
        f"dattri TRAK ({len(checkpoints)} epoch checkpoints)": (
            lambda: pick(setup.trak_regularizations, lambda r: trak(checkpoints, r), m, tuning),
            1,
        ),
    }
    if setup.ensemble > 1:

        def trak_ensemble() -> dict[str, Any]:
            states, train_seconds = timed(ensemble)
            result = pick(setup.trak_regularizations, lambda r: trak(states, r), m, tuning)
            return {**result, "seconds": result["seconds"] + train_seconds}

        peers[f"dattri TRAK (ensemble of {setup.ensemble} models)"] = (trak_ensemble, setup.ensemble)
    if setup.influence_functions:
        peers["dattri IF explicit (final model)"] = (explicit_if, 1)
    out: dict[str, dict[str, Any]] = {}
    for name, (fn, trainings) in peers.items():
        try:
            out[name] = {**fn(), "trainings": trainings}
        except Exception as error:  # noqa: BLE001  (a peer failing on this torch version is reported)
            out[name] = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc(limit=3)}
    return out
