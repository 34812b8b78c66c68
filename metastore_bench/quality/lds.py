"""LDS (linear datamodeling score) of influence from the store, next to dattri's TRAK and IF and Kronfluence.

``python -m metastore_bench.quality.lds [--quick] [--kinds mlp cnn tokens positions lm] [--out JSON]``
(default ``metastore_bench/results/quality_lds.json``)

Tasks (:mod:`.lds_tasks`): the digits MLP and CNN, and a one-block transformer on a synthetic token task
(:mod:`.tokens`), with fixed sinusoidal positions (``tokens``) or a learned position table on its root module
(``positions``: an ``nn.Parameter`` the capture's generic rule takes, as a dense record of layer ``""``); a causal
LM (``lm``: a 2-layer GPT-2, its measurement a held-out sequence's loss) runs in :mod:`.lds_lm`.

The setup (TRAK, Park et al. 2023; dattri):

- ``S`` random subsets ``D_s`` holding a ``fraction`` (50%) of the ``N`` training samples
  (seeded), each trained from the *same* initialisation and shuffle seed as the full run,
  so that the subset alone differs between runs;
- model output on held-out test sample ``j``: the margin
  ``f_j(D_s) = log(p_y / (1 - p_y)) = z_y - log sum_{k != y} exp z_k`` of the model trained on ``D_s``;
- an attributor gives ``tau_ij``, with ``tau_ij > 0`` meaning that training on ``i`` raises
  ``f_j`` (lowers test sample ``j``'s loss), and predicts ``g_j(D_s) = sum_{i in D_s} tau_ij``;
- ``LDS_j = Spearman_s(g_j(D_s), f_j(D_s))``; LDS is the mean over the test samples, with a
  percentile bootstrap 95% interval over test samples (and a paired one for differences).

Attributors: TracIn from one captured run (fp32 store, exact factors of every layer):
``influence`` over the epoch-end checkpoint passes (exact), ``in_run_influence`` (the
training steps' gradients against the last pass's test gradients), ``sketched_influence``
(Kronecker sketches ``dim x dim`` per layer) and ``kernel_influence`` (the sketches through a
ridge-regularised kernel inverse, TRAK's estimator; the ridge picked on the tuning split as the
peers' are), and ``kfac_influence`` (EK-FAC and K-FAC curvature fitted on each checkpoint pass's
stored factors, ``g_train^T (F_c + delta I)^-1 g_test`` summed with the passes' rates; the damping's
fraction of the mean eigenvalue picked on the tuning split, and at the default 0.1 the reports use;
every layer, the embedding included), the same on a second capture whose passes are projected ``k x k``
on the curvature eigenbasis as a budgeted policy keeps them (:mod:`.lds_projected`); dattri's
``TRAKAttributor`` (final model,
the epoch checkpoints, an ensemble of independently trained models) and ``IFAttributorExplicit``
(exact damped Hessian); Kronfluence's EK-FAC (final model, the epoch checkpoints). A peer that
fails is reported, not fatal; one not installed is reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from metastore_plugins import StoreWriter, open_store
from metastore_plugins.core.ops.curvature import DEFAULT_RELATIVE_DAMPING, CurvatureMethod

from ..publish import RESULTS
from ..timing import machine, versions
from .digits import Capture, train_model
from .lds_defaults import defaults_attributors
from .lds_lm import run_lm
from .lds_peers import dattri_attributors, kronfluence_attributors, pick, timed
from .lds_projected import capture_projected, projected_scores
from .lds_setup import (
    Setup,
    Tuning,
    bootstrap_interval,
    lds_per_sample,
    margins,
    ordered,
    subset_masks,
    subset_outputs,
)
from .lds_steps import steps_attributors
from .lds_tasks import KINDS, TITLES, build_model, load_arrays
from .lds_tasks import Kind as Kind  # lds.Kind: the task names


def store_attributors(store_dir: Path, setup: Setup, n: int) -> dict[str, tuple[np.ndarray, float]]:
    """TracIn from the captured store: ``{name: ((N, M) scores, query seconds)}``."""
    store, m = open_store(store_dir), setup.test_samples
    trains = [f"epoch-{e}/train" for e in range(setup.epochs)]
    tests = [f"epoch-{e}/test" for e in range(setup.epochs)]
    out = {
        "TracIn exact (checkpoint passes)": timed(
            lambda: ordered(store.influence(trains, tests, test_ids=list(range(m))), n, m)
        ),
        "TracIn in-run (training steps)": timed(lambda: ordered(store.in_run_influence(tests[-1]), n, m)),
    }
    for dim in setup.sketch_dims:
        out[f"TracIn projected {dim}x{dim} (checkpoint passes)"] = timed(
            partial(lambda d: ordered(store.sketched_influence(trains, tests, dim=d, seed=setup.seed), n, m), dim)
        )
    return out


def kernel_scores(store_dir: Path, setup: Setup, n: int, regularization: float) -> np.ndarray:
    """``(N, M + T)`` :meth:`kernel_influence` over the epoch passes (reported rows, then tuning rows)."""
    store, columns = open_store(store_dir), setup.test_samples + setup.tune_samples
    trains = [f"epoch-{e}/train" for e in range(setup.epochs)]
    tests = [f"epoch-{e}/test" for e in range(setup.epochs)]
    scores = store.kernel_influence(trains, tests, dim=setup.kernel_dim, seed=setup.seed, regularization=regularization)
    return ordered(scores, n, columns)


def kfac_scores(store_dir: Path, setup: Setup, n: int, method: CurvatureMethod, relative_damping: float) -> np.ndarray:
    """``(N, M + T)`` :meth:`kfac_influence` (``"ekfac"`` or ``"kfac"``) over the epoch passes, every layer."""
    store, columns = open_store(store_dir), setup.test_samples + setup.tune_samples
    trains = [f"epoch-{e}/train" for e in range(setup.epochs)]
    tests = [f"epoch-{e}/test" for e in range(setup.epochs)]
    scores = store.kfac_influence(trains, tests, method=method, relative_damping=relative_damping)
    return ordered(scores, n, columns)


def in_run_scores(
    store_dir: Path, setup: Setup, n: int, method: CurvatureMethod | None, relative_damping: float
) -> np.ndarray:
    """``(N, M + T)`` :meth:`in_run_influence` of the training steps, each epoch's steps with that epoch's test
    pass: TracIn (``method=None``) or the curvature fitted on each epoch's steps."""
    store, columns = open_store(store_dir), setup.test_samples + setup.tune_samples
    tests = [f"epoch-{e}/test" for e in range(setup.epochs)]
    if method is None:
        return ordered(store.in_run_influence(tests), n, columns)
    return ordered(store.in_run_influence(tests, method=method, relative_damping=relative_damping), n, columns)


def run(setup: Setup) -> dict[str, Any]:
    """Train, capture, retrain on the subsets, attribute, and score: the result for one model kind."""
    x, y, x_test, y_test = load_arrays(setup.kind, setup.seed, setup.train_size)
    n, m, t = len(y), setup.test_samples, setup.tune_samples
    if m + t > len(y_test):
        raise ValueError(f"test_samples + tune_samples must be at most {len(y_test)}, got {m} + {t}")
    train_model(build_model(setup.kind, setup.seed), x[:64], y[:64], epochs=1, seed=setup.seed)  # warm-up
    plain, plain_seconds = timed(
        lambda: train_model(build_model(setup.kind, setup.seed), x, y, epochs=setup.epochs, seed=setup.seed)
    )
    tuning = None
    if t > 0:
        tune_masks = subset_masks(n, setup.tune_subsets, setup.fraction, setup.seed + 1)
        rows = slice(m, m + t)
        tuning = Tuning(tune_masks, subset_outputs(setup, x, y, x_test[rows], y_test[rows], tune_masks))
    checkpoints: list[dict[str, Tensor]] = []
    with tempfile.TemporaryDirectory() as tmp:
        store_dir = Path(tmp) / "store"
        with StoreWriter(store_dir, encoding="fp32") as writer:
            model, capture_seconds = timed(
                lambda: train_model(
                    build_model(setup.kind, setup.seed),
                    x,
                    y,
                    epochs=setup.epochs,
                    seed=setup.seed,
                    capture=Capture(writer, passes={"train": (x, y), "test": (x_test[: m + t], y_test[: m + t])}),
                    on_epoch_end=lambda e, mod: checkpoints.append(
                        {k: p.detach().clone() for k, p in mod.state_dict().items()}
                    ),
                )
            )
        if not np.allclose(margins(model, x_test, y_test), margins(plain, x_test, y_test), atol=1e-4):
            raise RuntimeError("capture changed training: the captured and plain runs disagree")
        store_bytes = sum(f.stat().st_size for f in store_dir.rglob("*") if f.is_file())
        overhead = capture_seconds - plain_seconds
        attributions: dict[str, dict[str, Any]] = {
            name: {"scores": scores, "seconds": overhead + seconds, "query_seconds": seconds, "trainings": 1}
            for name, (scores, seconds) in store_attributors(store_dir, setup, n).items()
        }
        kernel = pick(setup.kernel_regularizations, partial(kernel_scores, store_dir, setup, n), m, tuning)
        kernel.update(seconds=overhead + kernel["seconds"], query_seconds=kernel["seconds"], trainings=1)
        attributions[f"TracIn kernel {setup.kernel_dim}x{setup.kernel_dim} (checkpoint passes)"] = kernel
        methods: tuple[tuple[CurvatureMethod, str], ...] = (("ekfac", "EK-FAC"), ("kfac", "K-FAC"))
        for method, label in methods:
            fitted = pick(setup.kfac_dampings, partial(kfac_scores, store_dir, setup, n, method), m, tuning)
            fitted.update(seconds=overhead + fitted["seconds"], query_seconds=fitted["seconds"], trainings=1)
            attributions[f"{label} (checkpoint passes)"] = fitted
        default = pick((DEFAULT_RELATIVE_DAMPING,), partial(kfac_scores, store_dir, setup, n, "ekfac"), m, None)
        default.update(seconds=overhead + default["seconds"], query_seconds=default["seconds"], trainings=1)
        attributions["EK-FAC (checkpoint passes), default damping: what the reports use"] = default
        for method, label in ((None, "TracIn"), ("ekfac", "EK-FAC")):  # no training-set pass: the steps' own records
            grid = (0.0,) if method is None else (DEFAULT_RELATIVE_DAMPING,)
            row = pick(grid, partial(in_run_scores, store_dir, setup, n, method), m, None)
            row.update(seconds=overhead + row["seconds"], query_seconds=row["seconds"], trainings=1)
            attributions[f"{label} in-run (each epoch's steps with its test pass)"] = row
        data = (x, y, x_test[: m + t], y_test[: m + t])
        for dim in setup.projected_dims:  # the passes as a budgeted policy keeps them: projected on the eigenbasis
            path, layers = Path(tmp) / f"projected-{dim}", open_store(store_dir).layers()
            _, projected_seconds = timed(partial(capture_projected, setup, data, layers, dim, path))
            cost = projected_seconds - plain_seconds
            for method, label in ((None, "TracIn"), ("ekfac", "EK-FAC")):
                grid = (0.0,) if method is None else setup.kfac_dampings
                row = pick(grid, partial(projected_scores, path, setup, n, method), m, tuning)
                row.update(seconds=cost + row["seconds"], query_seconds=row["seconds"], trainings=1)
                attributions[f"{label} (passes projected {dim}x{dim} on the eigenbasis)"] = row
        layers = open_store(store_dir).layers()  # the steps as a budgeted policy keeps them; the default answer
        attributions.update(steps_attributors(setup, data, layers, Path(tmp), plain_seconds))
        attributions.update(
            defaults_attributors(setup, data, Path(tmp), plain_seconds)
        )  # the one line, as users add it
    peer_data = (x, y, x_test[: m + t], y_test[: m + t])
    attributions.update(dattri_attributors(setup, peer_data, checkpoints, tuning))
    if setup.kronfluence:
        attributions.update(kronfluence_attributors(setup, peer_data, checkpoints, tuning))

    masks = subset_masks(n, setup.subsets, setup.fraction, setup.seed)
    outputs, truth_seconds = timed(lambda: subset_outputs(setup, x, y, x_test[:m], y_test[:m], masks))
    exact = lds_per_sample(attributions["TracIn exact (checkpoint passes)"]["scores"], masks, outputs)
    results = []
    for name, result in attributions.items():
        if "error" in result or "skipped" in result:
            results.append({"attributor": name, **result})
            continue
        per_sample = lds_per_sample(result["scores"], masks, outputs)
        diff = per_sample - exact  # paired over the same test samples
        row: dict[str, Any] = {"attributor": name, "lds": float(np.nanmean(per_sample))}
        row["ci95"] = bootstrap_interval(per_sample, setup.bootstrap, setup.seed)
        row["minus_exact_tracin"] = float(np.nanmean(diff))
        row["minus_exact_tracin_ci95"] = bootstrap_interval(diff, setup.bootstrap, setup.seed)
        row.update({k: v for k, v in result.items() if k != "scores"})
        results.append(row)
    return {
        "setup": asdict(setup),
        "test_accuracy": float((model(x_test).argmax(1) == y_test).float().mean()),
        "train_seconds": plain_seconds,
        "capture_seconds": capture_seconds,
        "store_bytes": store_bytes,
        "subset_trainings": setup.subsets + (setup.tune_subsets if t > 0 else 0),
        "subset_seconds": truth_seconds,
        "attributors": results,
    }


def table(result: dict[str, Any]) -> str:
    """The markdown table of one model kind's result."""
    lines = [
        "| attributor | LDS | 95% interval | minus exact TracIn (95%) | trainings | seconds | picked |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["attributors"]:
        if "error" in row or "skipped" in row:
            status = f"failed: {row['error']}" if "error" in row else f"skipped: {row['skipped']}"
            lines.append(f"| {row['attributor']} | {status} | | | | | |")
            continue
        (lo, hi), (dlo, dhi) = row["ci95"], row["minus_exact_tracin_ci95"]
        value = row.get("value")
        picked = "" if value is None else f"{value:g}" if isinstance(value, (int, float)) else str(value)
        lines.append(
            f"| {row['attributor']} | {row['lds']:.3f} | [{lo:.3f}, {hi:.3f}] | {row['minus_exact_tracin']:+.3f} "
            f"[{dlo:+.3f}, {dhi:+.3f}] | {row['trainings']} | {row['seconds']:.2f} | {picked} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="600 train samples, 64 subsets, 100 test samples, MLP")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=None, help="default: all (quick: mlp)")
    parser.add_argument("--subsets", type=int, default=None, help="number of random 50%% subsets (at least 50)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=RESULTS / "quality_lds.json")
    args = parser.parse_args(argv)
    if args.subsets is not None and args.subsets < 50:
        parser.error("--subsets must be at least 50")
    torch.set_num_threads(args.threads)
    kinds = args.kinds or (["mlp"] if args.quick else list(KINDS))
    results: dict[str, Any] = {"machine": machine(), "versions": versions("torch", "dattri", "kronfluence", "scipy")}
    results["threads"] = args.threads
    start = time.perf_counter()
    for kind in kinds:
        setup = Setup.quick(kind) if args.quick else Setup.full(kind)
        if args.subsets is not None:
            setup = replace(setup, subsets=args.subsets)
        results[kind] = run_lm(setup) if kind == "lm" else run(setup)  # lm: the causal LM's own measurement
        fit = results[kind].get("test_accuracy", results[kind].get("test_loss_per_token"))
        print(f"{TITLES[kind]}: {setup.subsets} subsets, {setup.test_samples} test samples, held-out fit {fit:.3f}")
        print(table(results[kind]), flush=True)
    results["seconds"] = time.perf_counter() - start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"{results['seconds']:.0f} s; written to {args.out}")
    return results


if __name__ == "__main__":
    main()
