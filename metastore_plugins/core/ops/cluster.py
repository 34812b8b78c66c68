"""A small deterministic k-means (k-means++ seeding, Lloyd iterations) in torch, for sketches."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from metastore_plugins.core.errors import ConfigError


@dataclass(frozen=True)
class KMeansResult:
    """Outcome of :func:`kmeans`.

    Attributes:
        centroids: ``(k, dim)`` cluster centres (same dtype as the input).
        labels: ``(N,)`` int64 cluster of each point.
        inertia: sum of squared distances of the points to their centres.
        iterations: Lloyd iterations run.
    """

    centroids: Tensor
    labels: Tensor
    inertia: float
    iterations: int


def _sq_distances(x: Tensor, centroids: Tensor) -> Tensor:
    """``(N, k)`` squared Euclidean distances, clamped at 0 against rounding."""
    return (x.pow(2).sum(1, keepdim=True) - 2.0 * x @ centroids.T + centroids.pow(2).sum(1)).clamp_min_(0)


def _plus_plus(x: Tensor, k: int, generator: torch.Generator) -> Tensor:
    """k-means++ seeding: each new centre drawn with probability proportional to ``D(x)^2``."""
    n = x.shape[0]
    first = int(torch.randint(n, (1,), generator=generator))
    centroids = [x[first]]
    closest = _sq_distances(x, x[first : first + 1]).squeeze(1)  # (N,)
    for _ in range(1, k):
        weights = closest.double().cpu()  # (N,)
        if float(weights.sum()) <= 0.0:  # every point already coincides with a centre
            choice = int(torch.randint(n, (1,), generator=generator))
        else:
            choice = int(torch.multinomial(weights, 1, generator=generator))
        centroids.append(x[choice])
        closest = torch.minimum(closest, _sq_distances(x, x[choice : choice + 1]).squeeze(1))
    return torch.stack(centroids)  # (k, dim)


def kmeans(x: Tensor, k: int, seed: int = 0, iters: int = 50, tol: float = 1e-7) -> KMeansResult:
    """Cluster the rows of ``x`` (e.g. gradient sketches ``(N, dim)``) into ``k`` groups.

    Deterministic for a given ``seed``: seeding uses a ``torch.Generator`` and ties go to
    the lowest cluster index. An emptied cluster is moved to the point farthest from
    its centre.

    Args:
        x: ``(N, dim)`` points.
        k: number of clusters, ``1 <= k <= N``.
        seed: seed of the k-means++ initialisation.
        iters: maximum Lloyd iterations.
        tol: stop when no centre moves by more than ``tol`` times the data's scale.

    Raises:
        ValueError: if ``x`` is not 2-D or ``k`` is out of range.
    """
    if x.dim() != 2:
        raise ConfigError(f"kmeans expects points as a 2-D (N, dim) tensor, got shape {tuple(x.shape)}")
    n = x.shape[0]
    if not 1 <= k <= n:
        raise ConfigError(f"k must be between 1 and the number of points ({n}), got {k}")
    generator = torch.Generator().manual_seed(int(seed))
    centroids = _plus_plus(x, k, generator)  # (k, dim)
    scale = float(x.pow(2).sum(1).mean().sqrt()) or 1.0
    labels = torch.zeros(n, dtype=torch.long, device=x.device)
    iteration = 0
    for _ in range(iters):
        iteration += 1
        distances = _sq_distances(x, centroids)  # (N, k)
        labels = distances.argmin(1)  # (N,)
        counts = torch.bincount(labels, minlength=k)  # (k,)
        sums = x.new_zeros(k, x.shape[1]).index_add_(0, labels, x)  # (k, dim)
        updated = sums / counts.clamp_min(1).unsqueeze(1).to(x.dtype)  # (k, dim)
        own = distances.gather(1, labels.unsqueeze(1)).squeeze(1)  # (N,)
        for empty in (counts == 0).nonzero().flatten().tolist():
            far = int(own.argmax())
            updated[empty] = x[far]
            own[far] = -1.0
        shift = float((updated - centroids).norm(dim=1).max())
        centroids = updated
        if shift <= tol * scale:
            break
    distances = _sq_distances(x, centroids)  # (N, k)
    labels = distances.argmin(1)
    inertia = float(distances.gather(1, labels.unsqueeze(1)).sum())
    return KMeansResult(centroids, labels, inertia, iteration)
