"""The peers of the LDS benchmark: dattri's TRAK and explicit influence functions, Kronfluence's EK-FAC.

Hyperparameters (TRAK's regularization, the influence functions' and Kronfluence's damping) are
picked on a tuning split, never on the reported test samples (:class:`~.lds_setup.Setup`). A peer that
fails on this torch version is reported, not fatal; one that is not installed is reported as skipped.
"""

from __future__ import annotations

import gc
import time
import traceback
from collections.abc import Callable, Hashable, Sequence
from functools import partial
from typing import Any, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .digits import train_model
from .lds_setup import Setup, Tuning
from .lds_tasks import EMBEDDINGS, build_model

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """``(fn(), seconds)``."""
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def pick(grid: Sequence[K], fn: Callable[[K], np.ndarray], m: int, tuning: Tuning | None) -> dict[str, Any]:
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
    model = build_model(setup.kind, setup.seed)
    call = torch.func.functional_call

    def logits(params: dict[str, Tensor], sample: Tensor) -> Tensor:
        return call(model, params, sample.unsqueeze(0))[0]  # (C,)

    def margin(params: dict[str, Tensor], data: tuple[Tensor, Tensor]) -> Tensor:  # one sample: TRAK's output
        z = logits(params, data[0])  # (C,)
        own = torch.arange(z.shape[0]) == data[1]  # (C,)
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
            other = train_model(build_model(setup.kind, setup.seed + k), x, y, epochs=setup.epochs, seed=setup.seed + k)
            states.append({name: t.detach().clone() for name, t in other.state_dict().items()})
        return states

    def explicit_if() -> dict[str, Any]:
        final = build_model(setup.kind, setup.seed)
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


HEURISTIC = "0.1 x mean eigenvalue"  # Kronfluence's damping when ``damping_factor=None``


def kronfluence_attributors(
    setup: Setup,
    data: tuple[Tensor, Tensor, Tensor, Tensor],
    checkpoints: list[dict[str, Tensor]],
    tuning: Tuning | None,
) -> dict[str, dict[str, Any]]:
    """Kronfluence's EK-FAC influence on the final model and on the same epoch checkpoints as the store's rows.

    Kronfluence (Grosse et al. 2023) fits EK-FAC factors with labels sampled from the model (its
    default, the true Fisher) over all training samples of each checkpoint, then scores
    ``grad f_j^T (F + lambda I)^-1 grad L_i``. Its task mirrors the harness: the training loss is the
    summed cross-entropy, the measurement ``f_j`` the negated margin of :func:`~.lds.margins` (so a
    positive score means training on ``i`` raises test sample ``j``'s margin, the harness's sign).
    Checkpoints are summed (they all trained at the same rate). It tracks the ``nn.Linear`` and
    ``nn.Conv2d`` layers: the token model's embedding is left out, as the store's K-FAC rows leave it.
    The damping is picked on the tuning split from ``setup.kronfluence_dampings`` (``None``:
    Kronfluence's own rule, 0.1 x each layer's mean eigenvalue). Not installed: one row, skipped.
    """
    try:
        from kronfluence.analyzer import Analyzer, prepare_model
        from kronfluence.arguments import FactorArguments, ScoreArguments
        from kronfluence.task import Task
        from torch.utils.data import TensorDataset
    except ImportError as error:
        return {"Kronfluence EK-FAC": {"skipped": f"kronfluence is not installed ({error.name})"}}
    except Exception as error:  # noqa: BLE001  (any other import failure: reported, not fatal)
        return {"Kronfluence EK-FAC": {"error": f"kronfluence does not import: {error!r}"}}
    import logging
    import tempfile
    import warnings

    x, y, x_test, y_test = data
    m, batch = setup.test_samples, 256

    class MarginTask(Task):  # type: ignore[misc,unused-ignore]
        def compute_train_loss(self, batch: Any, model: nn.Module, sample: bool = False) -> Tensor:
            inputs, labels = batch
            logits = model(inputs)  # (B, C)
            if sample:  # labels drawn from the model's prediction: the true Fisher
                with torch.no_grad():
                    labels = torch.multinomial(torch.softmax(logits.detach(), -1), 1).squeeze(1)  # (B,)
            return F.cross_entropy(logits, labels, reduction="sum")

        def compute_measurement(self, batch: Any, model: nn.Module) -> Tensor:
            inputs, labels = batch
            z = model(inputs)  # (B, C)
            own = z.gather(1, labels[:, None]).squeeze(1)  # (B,)
            others = z.scatter(1, labels[:, None], float("-inf")).logsumexp(1)  # (B,)
            return -(own - others).sum()

    train_set, query_set = TensorDataset(x, y), TensorDataset(x_test, y_test)

    def fitted(states: list[dict[str, Tensor]], tmp: str) -> list[Any]:
        analyzers = []
        for c, state in enumerate(states):
            model = build_model(setup.kind, setup.seed)
            model.load_state_dict(state)
            task = MarginTask()
            analyzer = Analyzer(
                f"checkpoint-{c}",
                prepare_model(model, task),
                task,
                cpu=True,
                log_level=logging.WARNING,
                disable_tqdm=True,
                output_dir=tmp,
            )
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(setup.seed + c)  # the sampled labels
                analyzer.fit_all_factors(
                    "ekfac", train_set, per_device_batch_size=batch, factor_args=FactorArguments(strategy="ekfac")
                )
            analyzers.append(analyzer)
        return analyzers

    def scores(analyzers: list[Any], damping: float | None) -> np.ndarray:
        total = np.zeros((len(y), len(y_test)))
        for analyzer in analyzers:
            name = f"pairwise-{damping}"
            analyzer.compute_pairwise_scores(
                name,
                "ekfac",
                query_set,
                train_set,
                per_device_query_batch_size=batch,
                per_device_train_batch_size=batch,
                score_args=ScoreArguments(damping_factor=damping),
                overwrite_output_dir=True,
            )
            total += analyzer.load_pairwise_scores(name)["all_modules"].double().numpy().T  # (N, M + T)
        return total

    def row(states: list[dict[str, Tensor]]) -> dict[str, Any]:
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning)  # its torch.cuda.amp.GradScaler calls
            analyzers, fit_seconds = timed(lambda: fitted(states, tmp))
            result = pick(setup.kronfluence_dampings, partial(scores, analyzers), m, tuning)
        return {
            **result,
            "seconds": result["seconds"] + fit_seconds,
            "value": HEURISTIC if result["value"] is None else result["value"],
            "tuning": {HEURISTIC if k is None else str(k): v for k, v in result["tuning"].items()},
        }

    layers = " (non-embedding layers)" if EMBEDDINGS[setup.kind] else ""
    peers: dict[str, Callable[[], dict[str, Any]]] = {
        f"Kronfluence EK-FAC (final model){layers}": lambda: row(checkpoints[-1:]),
        f"Kronfluence EK-FAC ({len(checkpoints)} epoch checkpoints){layers}": lambda: row(checkpoints),
    }
    out: dict[str, dict[str, Any]] = {}
    # Kronfluence calls gc.collect() after every phase (about 20 per checkpoint); over this harness's
    # heap (stores, dattri) each took 0.5 s, 90% of its time on these models. Frozen, the objects made
    # before it are not scanned: its seconds are then its own work, as in a process of its own.
    gc.freeze()
    try:
        for name, fn in peers.items():
            try:
                out[name] = {**fn(), "trainings": 1}
            except Exception as error:  # noqa: BLE001  (a peer failing on this torch version is reported)
                out[name] = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc(limit=3)}
    finally:
        gc.unfreeze()
    return out
