"""The peers of the ``lm`` LDS task (:mod:`.lds_lm`): dattri's TRAK and Kronfluence's EK-FAC on a causal LM.

Both score the harness's sign: ``tau_ij > 0`` when training on sequence ``i`` lowers held-out sequence ``j``'s
loss (the sum of its token losses, :func:`~.lm_task.sequence_losses`). Hyperparameters are picked on the
tuning split as :mod:`.lds_peers` picks them; a peer that fails is reported, one not installed is skipped.
"""

from __future__ import annotations

import gc
import logging
import tempfile
import traceback
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .lds_peers import HEURISTIC, pick, timed
from .lds_setup import Setup, Tuning
from .lds_tasks import build_model
from .lm_task import PREDICTED, sequence_losses


def lm_dattri_attributors(
    setup: Setup, data: tuple[Tensor, Tensor], checkpoints: list[dict[str, Tensor]], tuning: Tuning | None
) -> dict[str, dict[str, Any]]:
    """dattri's ``TRAKAttributor`` on the final model and the epoch checkpoints: the model output of a sequence is
    ``f = -loss`` (its log-likelihood), ``p`` (TRAK's ``1 - p`` weights) the geometric mean of its token
    probabilities. ``data``: ``(x_train (N, T), x_held_out (M + T', T))``. ``{name: row}``."""
    x, x_test = data
    m = setup.test_samples
    try:
        import dattri.algorithm.base
        import dattri.algorithm.trak
        from dattri.algorithm.trak import TRAKAttributor
        from dattri.task import AttributionTask
        from torch.utils.data import DataLoader, TensorDataset
        from tqdm import tqdm
    except Exception as error:  # noqa: BLE001  (any import failure: reported, not fatal)
        return {"dattri": {"error": f"dattri does not import: {error!r}"}}
    for module in (dattri.algorithm.base, dattri.algorithm.trak):
        module.tqdm = partial(tqdm, disable=True)  # type: ignore[attr-defined,unused-ignore]  # no progress bars
    model = build_model(setup.kind, setup.seed)

    def log_likelihood(params: dict[str, Tensor], sample: tuple[Tensor, Tensor]) -> Tensor:  # one sequence
        tokens = sample[0].unsqueeze(0)  # (1, T)
        return -sequence_losses(torch.func.functional_call(model, params, (tokens,)), tokens)[0]

    def probability(params: dict[str, Tensor], sample: tuple[Tensor, Tensor]) -> Tensor:
        return torch.exp(log_likelihood(params, sample) / PREDICTED)

    def loader(a: Tensor) -> DataLoader:
        return DataLoader(TensorDataset(a, a), batch_size=64, shuffle=False)

    def trak(states: list[dict[str, Tensor]], regularization: float) -> np.ndarray:
        task = AttributionTask(loss_func=log_likelihood, model=model, checkpoints=states)
        attributor = TRAKAttributor(task, probability, device="cpu", regularization=regularization)
        attributor.cache(loader(x))
        return attributor.attribute(loader(x_test)).detach().double().numpy()  # (N, M + T')

    peers = {
        "dattri TRAK (final model)": checkpoints[-1:],
        f"dattri TRAK ({len(checkpoints)} epoch checkpoints)": checkpoints,
    }
    out: dict[str, dict[str, Any]] = {}
    for name, states in peers.items():
        try:
            out[name] = {**pick(setup.trak_regularizations, partial(trak, states), m, tuning), "trainings": 1}
        except Exception as error:  # noqa: BLE001  (a peer failing on this model is reported)
            out[name] = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc(limit=3)}
    return out


def linear_blocks(model: nn.Module) -> list[str]:
    """Replace GPT-2's ``Conv1D`` modules by the equal ``nn.Linear`` (Kronfluence tracks ``nn.Linear``; its own
    GPT-2 example does the same); returns their names, the modules Kronfluence then tracks."""
    from transformers.pytorch_utils import Conv1D

    names = [name for name, module in model.named_modules() if isinstance(module, Conv1D)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent, conv = model.get_submodule(parent_name), model.get_submodule(name)
        linear = nn.Linear(conv.weight.shape[0], conv.weight.shape[1])
        with torch.no_grad():
            linear.weight.copy_(conv.weight.T)  # Conv1D: x @ W + b, W (in, out)
            linear.bias.copy_(conv.bias)
        setattr(parent, child, linear)
    return names


def lm_kronfluence_attributors(
    setup: Setup, data: tuple[Tensor, Tensor], checkpoints: list[dict[str, Tensor]], tuning: Tuning | None
) -> dict[str, dict[str, Any]]:
    """Kronfluence's EK-FAC on the final model and on the same epoch checkpoints (summed), its factors fitted with
    labels sampled from the model (its default), the training loss each sequence's token sum, the measurement the
    held-out sequence's token-sum loss. It tracks the blocks' ``c_attn``, ``c_proj``, ``c_fc`` as ``nn.Linear``
    (:func:`linear_blocks`), not the embeddings (nor the tied ``lm_head``). Not installed: one row, skipped."""
    try:
        from kronfluence.analyzer import Analyzer, prepare_model
        from kronfluence.arguments import FactorArguments, ScoreArguments
        from kronfluence.task import Task
        from torch.utils.data import TensorDataset
    except ImportError as error:
        return {"Kronfluence EK-FAC": {"skipped": f"kronfluence is not installed ({error.name})"}}
    except Exception as error:  # noqa: BLE001  (any other import failure: reported, not fatal)
        return {"Kronfluence EK-FAC": {"error": f"kronfluence does not import: {error!r}"}}
    x, x_test = data
    m, batch = setup.test_samples, 64

    class SequenceTask(Task):  # type: ignore[misc,unused-ignore]
        def __init__(self, tracked: list[str]) -> None:
            super().__init__()
            self.tracked = tracked

        def compute_train_loss(self, batch: Any, model: nn.Module, sample: bool = False) -> Tensor:
            tokens = batch[0]  # (B, T)
            logits = model(tokens).logits[:, :-1]  # (B, T - 1, V)
            labels = tokens[:, 1:]  # (B, T - 1)
            if sample:  # labels drawn from the model's prediction: the true Fisher
                with torch.no_grad():
                    probs = torch.softmax(logits.detach().reshape(-1, logits.shape[-1]), -1)
                    labels = torch.multinomial(probs, 1).view(labels.shape)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")

        def compute_measurement(self, batch: Any, model: nn.Module) -> Tensor:
            return sequence_losses(model(batch[0]), batch[0]).sum()

        def get_influence_tracked_modules(self) -> list[str]:
            return self.tracked

    train_set, query_set = TensorDataset(x, x), TensorDataset(x_test, x_test)

    def fitted(states: list[dict[str, Tensor]], tmp: str) -> list[Any]:
        analyzers = []
        for c, state in enumerate(states):
            model = build_model(setup.kind, setup.seed)
            model.load_state_dict(state)
            task = SequenceTask(linear_blocks(model))
            analyzer = Analyzer(
                f"checkpoint-{c}", prepare_model(model, task), task, cpu=True, log_level=logging.WARNING,
                disable_tqdm=True, output_dir=tmp,
            )  # fmt: skip
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(setup.seed + c)  # the sampled labels
                analyzer.fit_all_factors(
                    "ekfac", train_set, per_device_batch_size=batch, factor_args=FactorArguments(strategy="ekfac")
                )
            analyzers.append(analyzer)
        return analyzers

    def scores(analyzers: list[Any], damping: float | None) -> np.ndarray:
        total = np.zeros((len(x), len(x_test)))
        for analyzer in analyzers:
            name = f"pairwise-{damping}"
            analyzer.compute_pairwise_scores(
                name, "ekfac", query_set, train_set, per_device_query_batch_size=batch,
                per_device_train_batch_size=batch, score_args=ScoreArguments(damping_factor=damping),
                overwrite_output_dir=True,
            )  # fmt: skip
            total += analyzer.load_pairwise_scores(name)["all_modules"].double().numpy().T  # (N, M + T')
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

    peers: dict[str, Callable[[], dict[str, Any]]] = {
        "Kronfluence EK-FAC (final model) (block layers)": lambda: row(checkpoints[-1:]),
        f"Kronfluence EK-FAC ({len(checkpoints)} epoch checkpoints) (block layers)": lambda: row(checkpoints),
    }
    out: dict[str, dict[str, Any]] = {}
    gc.freeze()  # as lds_peers: its gc.collect() calls then scan only its own objects
    try:
        for name, fn in peers.items():
            try:
                out[name] = {**fn(), "trainings": 1}
            except Exception as error:  # noqa: BLE001  (a peer failing on this model is reported)
                out[name] = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc(limit=3)}
    finally:
        gc.unfreeze()
    return out
