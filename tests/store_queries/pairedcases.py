"""Two paired checkpoint passes of a float64 MLP at two weights, with learning rates, written through
``capture_step`` (tests/store_queries/test_influence_methods.py, test_method_table.py): train ids ``0..19`` in
two batches, test ids ``100..105`` in one; exact fp32 factors. The tests build their references from
:func:`checkpoints` and :func:`data` with ``torch.func``, knowing nothing of the store.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from metastore_plugins import StoreWriter
from metastore_plugins.core.training.passes import capture_step

LRS = (0.6, 0.3)
TRAIN, TEST = ["epoch-0/train", "epoch-1/train"], ["epoch-0/val", "epoch-1/val"]
N_TRAIN, N_TEST = 20, 6
TEST_IDS = list(range(100, 100 + N_TEST))


def make_model(perturb: int | None = None) -> nn.Sequential:
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    if perturb is not None:
        g = torch.Generator().manual_seed(perturb)
        with torch.no_grad():
            for p in model.parameters():
                p += 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype)
    return model


def checkpoints() -> list[nn.Sequential]:
    """The model at the weights of each pair of passes."""
    return [make_model(), make_model(perturb=11)]


def data(n: int, seed: int) -> tuple[Tensor, Tensor]:
    """``(x (n, 5), y (n,))``: the training set with seed 1, the test set with seed 2."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def per_sample_ce(outputs: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(outputs, labels, reduction="none")


def write_paired(path: Path) -> Path:
    """The store at ``path``: per pair ``c``, ``TRAIN[c]`` and ``TEST[c]`` at ``checkpoints()[c]``, lr ``LRS[c]``."""
    (x, y), (xt, yt) = data(N_TRAIN, 1), data(N_TEST, 2)
    with torch.random.fork_rng(devices=[]), StoreWriter(path, encoding="fp32") as writer:
        for c, model in enumerate(checkpoints()):
            options = {"step": c, "lr": LRS[c]}
            for part in torch.arange(N_TRAIN).split(10):
                forward = (lambda m, p: lambda: m(x[p]))(model, part)
                capture_step(model, forward, y[part], part, per_sample_ce, writer, capture_point=TRAIN[c], **options)
            forward = (lambda m: lambda: m(xt))(model)
            ids = torch.tensor(TEST_IDS)
            capture_step(model, forward, yt, ids, per_sample_ce, writer, capture_point=TEST[c], **options)
            model.zero_grad()
    return path
