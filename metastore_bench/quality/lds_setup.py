"""The LDS measurement (TRAK, Park et al. 2023): its setup, the subsets retrained, and the score.

``S`` seeded subsets ``D_s`` of a ``fraction`` of the ``N`` training samples, each trained from the
full run's initialisation and shuffle seed; on test sample ``j`` the margin
``f_j(D_s) = z_y - log sum_{k != y} exp z_k``; an attribution ``tau`` predicts ``g_j(D_s) = sum_{i in D_s} tau_ij``,
and ``LDS_j = Spearman_s(g_j(D_s), f_j(D_s))``, averaged over test samples with a bootstrap interval.
:mod:`.lds` runs it over the attributors; :mod:`.lds_peers` picks the peers' hyperparameters on :class:`Tuning`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import rankdata
from torch import Tensor, nn

from metastore_plugins.core.analysis.results import Scores

from .digits import train_model
from .lds_tasks import TOKEN_KINDS, Kind, build_model


@dataclass(frozen=True)
class Setup:
    """One LDS measurement. Peers' hyperparameters are picked on a tuning split: held-out rows
    ``test_samples .. test_samples + tune_samples - 1`` against ``tune_subsets`` other subsets;
    the LDS is reported on rows ``0 .. test_samples - 1``. ``quick()`` is the one-minute variant."""

    kind: Kind = "mlp"
    train_size: int = 1497
    test_samples: int = 200
    tune_samples: int = 100
    subsets: int = 256
    tune_subsets: int = 64
    fraction: float = 0.5
    epochs: int = 4
    seed: int = 0
    sketch_dims: tuple[int, ...] = (8, 16)
    kernel_dim: int = 32
    kernel_regularizations: tuple[float, ...] = (0.01, 0.1, 1.0, 10.0)
    kfac_dampings: tuple[float, ...] = (0.01, 0.1, 1.0)  # relative_damping of kfac_influence
    projected_dims: tuple[int, ...] = (16, 8)  # passes projected k x k on the curvature eigenbasis
    ensemble: int = 5
    trak_regularizations: tuple[float, ...] = (0.0, 0.01, 0.1, 1.0, 10.0)
    dampings: tuple[float, ...] = (0.01, 0.1, 0.3, 1.0, 3.0, 10.0)
    kronfluence_dampings: tuple[float | None, ...] = (None, 1e-5, 1e-4, 1e-3, 1e-2, 0.1)  # None: its own rule
    influence_functions: bool = True
    kronfluence: bool = True  # its rows (skipped when the package is not installed)
    bootstrap: int = 2000

    @staticmethod
    def full(kind: Kind = "mlp") -> Setup:
        """The reported run. No explicit IF on the CNN: dattri's Hessian of all 1,497 samples, a vmapped
        jacfwd over 3,818 parameters, needs ~12 GB per intermediate (killed here), and its CG variant
        took 174 s at 10 iterations (docs/quality-lds.md); nor on the token model (a jacfwd through
        attention over 12 tokens). The token tasks train 1,000 sequences for 8 epochs (4 underfit)."""
        if kind in TOKEN_KINDS:
            return Setup(kind=kind, train_size=1000, epochs=8, influence_functions=False)
        if kind == "lm":  # 600 sequences, 8 epochs: about 1 s a training on one core
            return Setup(kind=kind, train_size=600, epochs=8, influence_functions=False)
        return Setup(kind=kind, influence_functions=kind == "mlp")

    @staticmethod
    def quick(kind: Kind = "mlp") -> Setup:
        """600 training samples (``lm``: 400), 64 subsets, 100 test samples; TRAK at the full run's pick (no tuning),
        no IF."""
        return Setup(
            kind=kind,
            epochs=8 if kind in (*TOKEN_KINDS, "lm") else 4,
            train_size=400 if kind == "lm" else 600,
            test_samples=100,
            tune_samples=0,
            subsets=64,
            ensemble=3,
            trak_regularizations=(0.1,),
            kernel_regularizations=(1.0,),
            kfac_dampings=(0.1,),
            kronfluence_dampings=(None,),
            dampings=(1.0,),
            influence_functions=False,  # its explicit Hessian alone takes 15-40 s here
        )


@dataclass(frozen=True)
class Tuning:
    """Subsets and their models' margins on the tuning rows: scores a ``(N, T)`` attribution."""

    masks: np.ndarray  # (S', N) bool
    outputs: np.ndarray  # (S', T)

    def lds(self, scores: np.ndarray) -> float:
        return float(np.nanmean(lds_per_sample(scores, self.masks, self.outputs)))


def ordered(scores: Scores, n: int, m: int) -> np.ndarray:
    """``(n, m)`` scores with rows = train ids ``0..n-1`` and columns = test ids ``0..m-1`` (zero when absent)."""
    out = np.zeros((n, m))
    cols = np.flatnonzero(scores.col_ids < m)
    out[np.ix_(scores.row_ids, scores.col_ids[cols])] = scores.scores[:, cols]
    return out


def margins(model: nn.Module, x: Tensor, y: Tensor) -> np.ndarray:
    """``(M,)`` margins ``z_y - logsumexp_{k != y} z_k`` (= ``log(p_y / (1 - p_y))``)."""
    with torch.no_grad():
        z = model(x).double()  # (M, C)
    own = z.gather(1, y[:, None]).squeeze(1)  # (M,)
    others = z.scatter(1, y[:, None], float("-inf")).logsumexp(1)  # (M,)
    return (own - others).numpy()


def subset_masks(n: int, count: int, fraction: float, seed: int) -> np.ndarray:
    """``(S, N)`` bool: ``count`` seeded random subsets of ``round(fraction * n)`` samples each."""
    rng = np.random.default_rng(seed)
    masks = np.zeros((count, n), dtype=bool)
    for s in range(count):
        masks[s, rng.choice(n, size=round(fraction * n), replace=False)] = True
    return masks


def subset_outputs(setup: Setup, x: Tensor, y: Tensor, x_test: Tensor, y_test: Tensor, masks: np.ndarray) -> np.ndarray:
    """``(S, M)`` test margins of models trained on each subset (same init and shuffle seed as the full run)."""
    out = np.zeros((len(masks), len(y_test)))
    for s, mask in enumerate(masks):
        rows = torch.from_numpy(np.flatnonzero(mask))  # (N/2,)
        model = train_model(build_model(setup.kind, setup.seed), x[rows], y[rows], epochs=setup.epochs, seed=setup.seed)
        out[s] = margins(model, x_test, y_test)
    return out


def lds_per_sample(scores: np.ndarray, masks: np.ndarray, outputs: np.ndarray) -> np.ndarray:
    """``(M,)`` Spearman over subsets of ``masks @ scores`` against ``outputs`` (NaN where one is constant).

    Args:
        scores: ``(N, M)`` attributions ``tau_ij``; masks: ``(S, N)`` bool; outputs: ``(S, M)`` ``f_j(D_s)``.
    """
    predicted = masks.astype(np.float64) @ scores  # (S, M)
    a = rankdata(predicted, axis=0)  # (S, M) average ranks, as scipy.stats.spearmanr
    b = rankdata(outputs, axis=0)  # (S, M)
    a, b = a - a.mean(0), b - b.mean(0)
    denom = np.sqrt((a * a).sum(0) * (b * b).sum(0))  # (M,)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denom > 0, (a * b).sum(0) / denom, np.nan)


def bootstrap_interval(values: np.ndarray, reps: int = 2000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of ``nanmean(values)``, resampling the entries with replacement."""
    values = values[~np.isnan(values)]
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), (reps, len(values)))].mean(1)  # (reps,)
    tail = (1 - level) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))
