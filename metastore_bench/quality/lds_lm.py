"""LDS on the causal-LM task (``lm``: :mod:`.lm_task`, a 2-layer GPT-2 on synthetic Markov-chain sequences).

The protocol is :mod:`.lds`'s with a language model's measurement: ``S`` seeded subsets of half the training
sequences, each retrained from the full run's initialisation and shuffle seed; for held-out sequence ``j`` the
output is ``f_j(D_s) = -loss_j``, minus the sum of its token losses under the model trained on ``D_s``; an
attributor's ``tau_ij > 0`` says training on ``i`` lowers that loss; ``LDS_j = Spearman_s(sum_{i in D_s}
tau_ij, f_j(D_s))``, averaged over the held-out sequences.

Attributors: from one captured run (fp32 store, exact factors of every layer, the token-sum loss of
:func:`~.lm_task.sequence_losses`, checkpoint passes at each epoch end) TracIn over the passes, what
``"auto"`` resolves to (:func:`~metastore_plugins.core.analysis.methods.resolve_method`, the reports' method:
TracIn over every layer, since K-FAC refuses GPT-2's tied ``wte`` / ``lm_head``; EK-FAC with ``layers=`` leaving
one of them out, as its refusal advises), and that EK-FAC with its damping tuned; dattri's TRAK on the final model
and on the same epoch checkpoints (its model output ``f_j``; ``p`` the geometric mean of the token probabilities);
Kronfluence's EK-FAC on the same checkpoints when it is installed (:mod:`.lds_lm_peers`).
"""

from __future__ import annotations

import tempfile
import traceback
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core.analysis.methods import resolve_method
from metastore_plugins.core.ops.curvature import DEFAULT_RELATIVE_DAMPING

from .digits import Capture
from .lds_lm_peers import lm_dattri_attributors, lm_kronfluence_attributors
from .lds_peers import pick, timed
from .lds_setup import Setup, Tuning, bootstrap_interval, lds_per_sample, ordered, subset_masks
from .lds_tasks import build_model
from .lm_task import PREDICTED, lm_losses, load_lm_arrays, train_lm

TIED = ("lm_head", "transformer.wte")  # GPT-2's tied output layer and token embedding


def lm_outputs(setup: Setup, x: Tensor, x_test: Tensor, masks: np.ndarray) -> np.ndarray:
    """``(S, M)`` ``f_j = -loss_j`` of the models trained on each subset (the full run's init and shuffle seed)."""
    out = np.zeros((len(masks), len(x_test)))
    for s, mask in enumerate(masks):
        rows = torch.from_numpy(np.flatnonzero(mask))  # (N/2,)
        model = train_lm(build_model(setup.kind, setup.seed), x[rows], epochs=setup.epochs, seed=setup.seed)
        out[s] = -lm_losses(model, x_test)
    return out


def store_rows(store_dir: Path, setup: Setup, n: int, tuning: Tuning | None) -> dict[str, dict[str, Any]]:
    """TracIn and ``"auto"`` over every layer, and ``"auto"`` / EK-FAC with ``layers=`` leaving out one of GPT-2's
    tied ``lm_head`` and ``transformer.wte`` (K-FAC refuses tied layers and says so): ``{name: row}``
    (``{"error"}`` where the store refuses)."""
    store, columns = open_store(store_dir), setup.test_samples + setup.tune_samples
    trains = [f"epoch-{e}/train" for e in range(setup.epochs)]
    tests = [f"epoch-{e}/test" for e in range(setup.epochs)]
    every = store.layers()

    def scores(method: str, layers: list[str] | None, relative: float) -> np.ndarray:
        damping = None if method == "tracin" else relative
        scored = store.influence(trains, tests, method=method, relative_damping=damping, layers=layers)
        return ordered(scored, n, columns)

    rows: dict[str, tuple[str, list[str] | None, tuple[float, ...], Tuning | None]] = {
        "TracIn exact (checkpoint passes)": ("tracin", None, (0.0,), None),
        "EK-FAC, every layer (checkpoint passes)": ("ekfac", None, (DEFAULT_RELATIVE_DAMPING,), None),
    }
    fallbacks: dict[str, str] = {}
    for left_out in (None, *TIED):
        layers = None if left_out is None else [layer for layer in every if layer != left_out]
        resolved = resolve_method(store, "auto", trains + tests, layers)
        where = "every layer" if left_out is None else f"every layer but {left_out}"
        chose = resolved.method + "".join(f" without {layer}" for layer in resolved.left_out)
        name = f"auto, {where}: {chose} (checkpoint passes), default damping: what the reports use"
        rows[name] = (resolved.method, resolved.layers_or(layers), (DEFAULT_RELATIVE_DAMPING,), None)
        if resolved.fallback is not None:
            fallbacks[name] = resolved.fallback
        if left_out is not None and tuning is not None:
            rows[f"EK-FAC, {where} (checkpoint passes)"] = ("ekfac", layers, setup.kfac_dampings, tuning)
    out: dict[str, dict[str, Any]] = {}
    for name, (method, layers, grid, tune) in rows.items():
        try:
            out[name] = pick(grid, partial(scores, method, layers), setup.test_samples, tune)
        except Exception as error:  # noqa: BLE001  (a method the store refuses on this model is reported)
            out[name] = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc(limit=3)}
        if name in fallbacks:
            out[name]["auto_fallback"] = fallbacks[name]
    return out


def run_lm(setup: Setup) -> dict[str, Any]:
    """Train, capture, retrain on the subsets, attribute and score the ``lm`` task: :func:`.lds.run`'s result."""
    x, _, x_test, _ = load_lm_arrays(setup.seed, setup.train_size)
    n, m, t = len(x), setup.test_samples, setup.tune_samples
    if m + t > len(x_test):
        raise ValueError(f"test_samples + tune_samples must be at most {len(x_test)}, got {m} + {t}")
    plain, plain_seconds = timed(
        lambda: train_lm(build_model(setup.kind, setup.seed), x, epochs=setup.epochs, seed=setup.seed)
    )
    tuning = None
    if t > 0:
        tune_masks = subset_masks(n, setup.tune_subsets, setup.fraction, setup.seed + 1)
        tuning = Tuning(tune_masks, lm_outputs(setup, x, x_test[m : m + t], tune_masks))
    checkpoints: list[dict[str, Tensor]] = []
    held_out = x_test[: m + t]
    with tempfile.TemporaryDirectory() as tmp:
        store_dir = Path(tmp) / "store"
        with StoreWriter(store_dir, encoding="fp32") as writer:
            model, capture_seconds = timed(
                lambda: train_lm(
                    build_model(setup.kind, setup.seed),
                    x,
                    epochs=setup.epochs,
                    seed=setup.seed,
                    capture=Capture(writer, passes={"train": (x, x), "test": (held_out, held_out)}),
                    on_epoch_end=lambda e, mod: checkpoints.append(
                        {k: p.detach().clone() for k, p in mod.state_dict().items()}
                    ),
                )
            )
        if not np.allclose(lm_losses(model, x_test), lm_losses(plain, x_test), rtol=1e-4, atol=1e-4):
            raise RuntimeError("capture changed training: the captured and plain runs disagree")
        store_bytes = sum(f.stat().st_size for f in store_dir.rglob("*") if f.is_file())
        layers = open_store(store_dir).layers()
        overhead = capture_seconds - plain_seconds
        attributions = store_rows(store_dir, setup, n, tuning)
        for row in attributions.values():
            if "error" not in row:
                row.update(seconds=overhead + row["seconds"], query_seconds=row["seconds"], trainings=1)
    data = (x, held_out)
    attributions.update(lm_dattri_attributors(setup, data, checkpoints, tuning))
    if setup.kronfluence:
        attributions.update(lm_kronfluence_attributors(setup, data, checkpoints, tuning))

    masks = subset_masks(n, setup.subsets, setup.fraction, setup.seed)
    outputs, truth_seconds = timed(lambda: lm_outputs(setup, x, x_test[:m], masks))
    exact = lds_per_sample(attributions["TracIn exact (checkpoint passes)"]["scores"], masks, outputs)
    results = []
    for name, result in attributions.items():
        if "error" in result or "skipped" in result:
            results.append({"attributor": name, **result})
            continue
        per_sample = lds_per_sample(result["scores"], masks, outputs)
        diff = per_sample - exact  # paired over the same held-out sequences
        row: dict[str, Any] = {"attributor": name, "lds": float(np.nanmean(per_sample))}
        row["ci95"] = bootstrap_interval(per_sample, setup.bootstrap, setup.seed)
        row["minus_exact_tracin"] = float(np.nanmean(diff))
        row["minus_exact_tracin_ci95"] = bootstrap_interval(diff, setup.bootstrap, setup.seed)
        row.update({k: v for k, v in result.items() if k != "scores"})
        results.append(row)
    return {
        "setup": asdict(setup),
        "test_loss_per_token": float(lm_losses(model, x_test).mean() / PREDICTED),
        "train_seconds": plain_seconds,
        "capture_seconds": capture_seconds,
        "store_bytes": store_bytes,
        "store_layers": layers,
        "subset_trainings": setup.subsets + (setup.tune_subsets if t > 0 else 0),
        "subset_seconds": truth_seconds,
        "attributors": results,
    }
