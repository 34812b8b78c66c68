"""Label noise for the quality harness: uniform, class-conditional and hard flips of a fixed share of labels.

- uniform: each chosen label goes to another class drawn uniformly;
- class-conditional: each chosen label of class ``c`` goes to ``T(c)``, the class a clean
  model confuses ``c`` with most (the largest off-diagonal mean probability over class ``c``);
- hard: each chosen label goes to the class a clean model finds second most likely *for
  that sample*.

With two classes the three coincide. The samples are drawn uniformly at random (seeded).
"""

from __future__ import annotations

from typing import Literal, get_args

import numpy as np

Noise = Literal["uniform", "class_conditional", "hard"]
NOISES: tuple[str, ...] = get_args(Noise)


def confusion_map(labels: np.ndarray, clean_probs: np.ndarray) -> np.ndarray:
    """``(C,)``: for each class, the other class a clean model's ``(N, C)`` probabilities put most mass on."""
    classes = clean_probs.shape[1]
    target = np.zeros(classes, dtype=np.int64)
    for c in range(classes):
        mass = clean_probs[labels == c].mean(0) if (labels == c).any() else np.zeros(classes)  # (C,)
        mass[c] = -np.inf
        target[c] = int(np.argmax(mass))
    return target


def flip_labels(
    labels: np.ndarray, rate: float, noise: str, seed: int, clean_probs: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(noisy labels, sorted flipped indices)``: ``round(rate * N)`` labels changed as ``noise`` says.

    ``clean_probs``: ``(N, C)`` class probabilities of a model trained on the clean labels,
    needed by ``class_conditional`` and ``hard``.
    """
    if noise not in NOISES:
        raise ValueError(f"noise must be one of {NOISES}, got {noise!r}")
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"rate must be in [0, 1), got {rate}")
    rng = np.random.default_rng(seed)
    classes = int(labels.max()) + 1 if clean_probs is None else clean_probs.shape[1]
    flipped = np.sort(rng.choice(len(labels), size=round(rate * len(labels)), replace=False))
    noisy = labels.copy()
    if noise == "uniform":
        noisy[flipped] = (labels[flipped] + rng.integers(1, classes, len(flipped))) % classes
        return noisy, flipped
    if clean_probs is None:
        raise ValueError(f"{noise!r} noise needs the clean model's probabilities (clean_probs=)")
    if noise == "class_conditional":
        noisy[flipped] = confusion_map(labels, clean_probs)[labels[flipped]]
    else:
        others = clean_probs[flipped].copy()  # (F, C)
        others[np.arange(len(flipped)), labels[flipped]] = -np.inf
        noisy[flipped] = others.argmax(1)
    return noisy, flipped
