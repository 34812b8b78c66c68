"""Digits data, small models and a plain SGD loop with optional per-sample gradient capture.

The quality benchmarks (LDS, label-error detection) share these pieces:

- :func:`load_digits_arrays`: scikit-learn's 8x8 digits with the split of
  ``examples/lightning_digits.py`` (300 held out, the rest for training);
- :func:`make_model`: the example's MLP, or a small CNN, seeded;
- :func:`train_model`: SGD with momentum over seeded shuffles, fast enough to retrain
  hundreds of times (a few epochs on 750 samples: tens of milliseconds). With a
  :class:`Capture` it records every training step as capture point ``"train"`` and, at each
  epoch end, a checkpoint pass per named set as ``"epoch-{e}/{name}"``.

A checkpoint pass stands for the training steps since the previous pass (TracIn's
``sum_c lr_c <g_i(w_c), g_j(w_c)>``), so its recorded ``lr`` is the *sum* of the learning
rates of those optimizer steps, ``lr_c = sum_{t in (c-1, c]} lr_t``, not the learning rate of
the moment.

Example::

    x, y, x_test, y_test = load_digits_arrays()
    model = make_model("mlp", seed=0)
    with StoreWriter("runs/digits/store", encoding="fp32") as writer:
        train_model(model, x, y, epochs=4, seed=0,
                    capture=Capture(writer, passes={"train": (x, y), "test": (x_test, y_test)}))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from metastore_plugins import StoreWriter
from metastore_plugins.core.training.passes import capture_step, checkpoint_pass

ModelKind = Literal["mlp", "cnn"]
TEST_SIZE = 300


def load_digits_arrays(
    seed: int = 0, train_size: int = 1497, flip: float = 0.0
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(x_train, y_train, x_test, y_test)``: images ``(N, 1, 8, 8)`` float32 in [0, 1], labels int64.

    The split is the one of ``examples/lightning_digits.py`` for the same ``seed``: a seeded
    permutation of the 1,797 digits, its last 300 held out. ``flip`` > 0 changes that share of
    the training labels to another digit as the example does (same draws); the flipped rows are
    then ``np.flatnonzero(y_train != clean)``, or see :func:`flipped_rows`.
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)  # (1797, 1, 8, 8)
    labels = torch.tensor(digits.target, dtype=torch.long)  # (1797,)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(labels))
    test_rows = order[-TEST_SIZE:]
    train_rows = order[: min(train_size, len(order) - TEST_SIZE)]
    y_train = labels[train_rows].clone()
    if flip > 0:
        flipped = np.sort(rng.choice(len(train_rows), size=round(flip * len(train_rows)), replace=False))
        y_train[flipped] = (y_train[flipped] + torch.from_numpy(rng.integers(1, 10, len(flipped)))) % 10
    return images[train_rows], y_train, images[test_rows], labels[test_rows]


def flipped_rows(seed: int = 0, train_size: int = 1497, flip: float = 0.1) -> np.ndarray:
    """Sorted rows of ``y_train`` that :func:`load_digits_arrays` flips for these arguments."""
    clean = load_digits_arrays(seed, train_size)[1]
    noisy = load_digits_arrays(seed, train_size, flip)[1]
    return np.flatnonzero((clean != noisy).numpy())


def make_model(kind: ModelKind, seed: int) -> nn.Module:
    """The digits MLP (``64-64-10``, ReLU) or a small CNN, initialised from ``torch.manual_seed(seed)``.

    The global RNG is left as it was.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "mlp":
            return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        if kind == "cnn":
            return nn.Sequential(
                nn.Conv2d(1, 8, 3, padding=1),  # (B, 8, 8, 8)
                nn.ReLU(),
                nn.Conv2d(8, 16, 3, stride=2, padding=1),  # (B, 16, 4, 4)
                nn.ReLU(),
                nn.Flatten(),
                nn.Linear(16 * 4 * 4, 10),
            )
    raise ValueError(f"kind must be 'mlp' or 'cnn', got {kind!r}")


def per_sample_ce(logits: Tensor, labels: Tensor) -> Tensor:
    """``(B,)`` cross-entropy of each sample."""
    return F.cross_entropy(logits, labels, reduction="none")


@dataclass
class Capture:
    """What :func:`train_model` records, and where.

    Attributes:
        writer: the store's writer.
        passes: ``{name: (x, y)}``: sets captured at every epoch end as ``"epoch-{e}/{name}"``,
            sample ids = row indices of that set.
        steps: also capture every training step as ``"train"`` (ids = ``ids`` of the rows).
        ids: ``(N,)`` dataset ids of the training rows (default: row indices).
        pass_batch_size: batch size of the checkpoint passes.
    """

    writer: StoreWriter
    passes: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    steps: bool = True
    ids: Tensor | None = None
    pass_batch_size: int = 256


def _pass_batches(
    model: nn.Module, x: Tensor, y: Tensor, batch_size: int
) -> list[tuple[Tensor, Callable[[], Tensor], Tensor]]:
    rows = torch.arange(len(y))  # (N,)
    return [(ids, partial(_forward, model, x, ids), y[ids]) for ids in rows.split(batch_size)]


def _forward(model: nn.Module, x: Tensor, rows: Tensor) -> Tensor:
    return model(x[rows])  # (B, C)


def train_model(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    epochs: int,
    batch_size: int = 32,
    lr: float = 0.1,
    momentum: float = 0.9,
    seed: int,
    capture: Capture | None = None,
    lr_at: Callable[[int], float] | None = None,
    on_epoch_end: Callable[[int, nn.Module], None] | None = None,
) -> nn.Module:
    """Mean cross-entropy, SGD with momentum, seeded shuffles; returns ``model`` (trained in place).

    Args:
        x, y: ``(N, ...)`` inputs and ``(N,)`` labels.
        seed: seeds the shuffles (a private generator: the global RNG is not used).
        capture: record steps and checkpoint passes (see :class:`Capture`).
        lr_at: learning rate of global step ``t`` (default: ``lr`` throughout).
        on_epoch_end: called with ``(epoch, model)`` after each epoch (and its passes).

    A checkpoint pass after epoch ``e`` records ``lr = sum of lr_t`` over the steps of epoch ``e``.
    """
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    ids = capture.ids if capture is not None and capture.ids is not None else torch.arange(len(y))  # (N,)
    step, lr_since_pass = 0, 0.0
    model.train()
    for epoch in range(epochs):
        for rows in torch.randperm(len(y), generator=generator).split(batch_size):
            step_lr = lr if lr_at is None else float(lr_at(step))
            for group in optimizer.param_groups:
                group["lr"] = step_lr
            if capture is not None and capture.steps:
                capture_step(
                    model,
                    partial(_forward, model, x, rows),
                    y[rows],
                    ids[rows],
                    per_sample_ce,
                    capture.writer,
                    step=step,
                    epoch=epoch,
                    lr=step_lr,
                )
            else:
                F.cross_entropy(model(x[rows]), y[rows]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            lr_since_pass += step_lr
            step += 1
        if capture is not None and capture.passes:
            for name, (px, py) in capture.passes.items():
                checkpoint_pass(
                    model,
                    _pass_batches(model, px, py, capture.pass_batch_size),
                    per_sample_ce,
                    capture.writer,
                    capture_point=f"epoch-{epoch}/{name}",
                    step=step,
                    epoch=epoch,
                    lr=lr_since_pass,
                )
            lr_since_pass = 0.0
        if on_epoch_end is not None:
            on_epoch_end(epoch, model)
    model.eval()
    return model
