"""Stores built by real little SGD runs, with references kept independently of the store.

While training, each step keeps: the sample ids it saw, each sample's own-loss gradient from
``torch.func`` (:func:`reference_per_sample_gradients`, at the step's weights), the ``.grad``
the optimizer used, the learning rate and the per-sample losses. None of them goes through
the store or the operators under test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from metastore_plugins import GradientStore, StoreWriter, open_store
from metastore_plugins.core.ops.sketch import projection
from metastore_plugins.core.training.passes import capture_step
from metastore_plugins.testing import reference_per_sample_gradients

N_SAMPLES, N_FEATURES, N_CLASSES = 24, 6, 3


def make_model(seed: int = 0) -> nn.Module:
    """The same weights for a seed, whatever the global RNG state (left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(N_FEATURES, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, N_CLASSES))


class TwiceLinear(nn.Module):
    """A Linear called twice (its parameters get two records per batch), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(N_FEATURES, N_FEATURES)
        self.head = nn.Linear(N_FEATURES, N_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.lin(torch.tanh(self.lin(x)))))


def make_twice(seed: int = 0) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TwiceLinear()


def make_data(seed: int = 1) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(N_SAMPLES, N_FEATURES, generator=generator)  # (N, F)
    x[[3, 17]] *= 6.0  # two loud samples, so that gradient norms spread out
    return x, torch.randint(0, N_CLASSES, (N_SAMPLES,), generator=generator)


def loss_fn(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


def per_sample_ce(outputs: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(outputs, labels, reduction="none")


@dataclass
class Run:
    """A training run's store and its references, one list entry per step (in step order)."""

    store: GradientStore
    steps: list[int] = field(default_factory=list)
    ids: list[Tensor] = field(default_factory=list)  # (B,) per step
    refs: list[dict[str, Tensor]] = field(default_factory=list)  # name -> (B, *shape) per step
    grads: list[dict[str, Tensor]] = field(default_factory=list)  # .grad per step
    losses: list[Tensor] = field(default_factory=list)  # (B,) per step
    lrs: list[float] = field(default_factory=list)
    start: dict[str, Tensor] = field(default_factory=dict)  # weights before training
    end: dict[str, Tensor] = field(default_factory=dict)  # weights after training


def train(
    path: Path,
    *,
    epochs: int = 2,
    batch: int = 6,
    micro: Callable[[int], list[int]] | None = None,
    lr: Callable[[int], float] = lambda step: 0.5 * 0.8**step,
    shuffle_seed: int = 2,
    model_seed: int = 0,
    model_fn: Callable[[int], nn.Module] = make_model,
) -> Run:
    """Plain SGD on the tiny classifier; ``micro(step)`` splits a step into micro-batch sizes.

    With micro-batches each one's mean loss is divided by their number (``loss_scale``),
    as Lightning and HF accumulation do.
    """
    model, (x_all, y_all) = model_fn(model_seed), make_data()
    params = dict(model.named_parameters())
    run = Run(store=None)  # type: ignore[arg-type]
    run.start = {n: p.detach().clone() for n, p in params.items()}
    order = torch.Generator().manual_seed(shuffle_seed)
    step = 0
    with StoreWriter(path, encoding="fp32", shard_bytes=3000) as writer:
        for epoch in range(epochs):
            perm = torch.randperm(N_SAMPLES, generator=order)
            for lo in range(0, N_SAMPLES - batch + 1, batch):
                ids = perm[lo : lo + batch]
                sizes = micro(step) if micro is not None else [batch]
                rate = lr(step)
                run.refs.append(reference_per_sample_gradients(model, loss_fn, {"x": x_all[ids], "y": y_all[ids]}))
                with torch.no_grad():
                    run.losses.append(per_sample_ce(model(x_all[ids]), y_all[ids]))
                model.zero_grad()
                for m, part in enumerate(torch.split(ids, sizes)):
                    x, y = x_all[part], y_all[part]
                    capture_step(
                        model,
                        lambda x=x: model(x),
                        y,
                        part,
                        per_sample_ce,
                        writer,
                        step=step,
                        epoch=epoch,
                        micro_batch=m,
                        lr=rate,
                        loss_scale=1.0 / len(sizes),
                    )
                run.grads.append({n: p.grad.detach().clone() for n, p in params.items()})
                with torch.no_grad():
                    for p in params.values():
                        p -= rate * p.grad
                run.steps.append(step)
                run.ids.append(ids.clone())
                run.lrs.append(rate)
                step += 1
    run.end = {n: p.detach().clone() for n, p in params.items()}
    run.store = open_store(path)
    return run


def occurrences(run: Run, first: int = 0, last: int = 10**9) -> list[tuple[int, int, dict[str, Tensor], float]]:
    """``(step, sample id, own-loss gradients, lr)`` per sample occurrence, in selection order."""
    return [
        (step, int(sid), {n: g[i] for n, g in refs.items()}, lr)
        for step, ids, refs, lr in zip(run.steps, run.ids, run.refs, run.lrs)
        if first <= step <= last
        for i, sid in enumerate(ids)
    ]


def expected_sketch(grads: dict[str, Tensor], layer: str, dim: int, seed: int) -> Tensor:
    """``P_out [W | b] P_in^T`` of a Linear layer (bias as an extra input column), or ``P v`` of
    LayerNorm's flattened ``(bias, weight)``, with the projections the sketch maths defines."""
    cpu = torch.device("cpu")
    if layer == "2":
        flat = torch.cat([grads["2.bias"], grads["2.weight"]])  # roles in sorted order
        p_vec = projection("vector:bias,weight", layer, seed, (dim * dim, flat.numel()), dim * dim, cpu)
        return p_vec @ flat
    weight, bias = grads[f"{layer}.weight"], grads[f"{layer}.bias"]  # (d_out, d_in), (d_out,)
    p_out = projection("out", layer, seed, (dim, weight.shape[0]), dim, cpu)
    p_in = projection("in", layer, seed, (dim, weight.shape[1]), dim, cpu)
    p_bias = projection("bias", layer, seed, (dim, 1), dim, cpu)
    return (p_out @ weight @ p_in.T + (p_out @ bias)[:, None] @ p_bias.T).reshape(-1)


def sum_by_id(ids: list[int], matrix: Tensor) -> tuple[list[int], Tensor]:
    """An ``(N_occ, N_occ)`` matrix of occurrences summed over rows and columns of the same sample id.

    Returns the unique ids (first-seen order, as the store's score rows) and the ``(U, U)`` sums.
    """
    unique = list(dict.fromkeys(ids))
    index = torch.tensor([unique.index(i) for i in ids])
    by_row = torch.zeros(len(unique), len(ids), dtype=matrix.dtype).index_add_(0, index, matrix)  # (U, N_occ)
    return unique, torch.zeros(len(unique), len(unique), dtype=matrix.dtype).index_add_(1, index, by_row)  # (U, U)
