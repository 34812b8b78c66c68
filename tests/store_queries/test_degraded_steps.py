"""Queries over training steps whose projection size changed mid-run (the run outgrew its plan).

Consecutive batches are joined into one operand only where their records have the same shapes: a
degrade from 16x16 to 8x8 projections leaves neighbouring batches that cannot be stacked. Reference:
squared per-sample gradient norms from ``torch.func`` (the projections keep the exact norm beside them).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from metastore_plugins import CaptureSession, StoreWriter, open_store
from metastore_plugins.core.policy.budget import Budget, RunShape
from metastore_plugins.core.policy.runtime import CapturePolicy
from metastore_plugins.core.records import BatchMeta

BATCH, TOKENS, D_IN, HIDDEN, CLASSES, STEPS = 4, 6, 40, 48, 3, 24


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.inp(x)).mean(1))


def _reference_sq_norms(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)  # {name: (B, *shape)}
    return {
        layer: sum(grads[f"{layer}.{role}"].double().reshape(len(x), -1).pow(2).sum(1) for role in ("weight", "bias"))
        for layer in ("inp", "head")
    }


def test_norms_over_steps_whose_projection_shrank(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Tokens()
    policy = CapturePolicy(Budget("auto", 110_000), encoding="fp32")
    policy.expect(RunShape(train_batches=12, train_batch_size=BATCH))  # the plan expects 12 steps; up to 24 run
    expected: dict[str, list[torch.Tensor]] = {"inp": [], "head": []}
    stored, sizes = 0, set()
    with StoreWriter(tmp_path, encoding="fp32") as writer, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the run outgrew its capture plan"
        for step in range(STEPS):
            x, y = torch.randn(BATCH, TOKENS, D_IN), torch.randint(0, CLASSES, (BATCH,))
            with CaptureSession(model) as session:
                F.cross_entropy(model(x), y).backward()
            kept = policy.apply(session.factors(), capture_point="train", step=step)
            model.zero_grad()
            if not kept or any(r.kind == "norms" for r in kept):  # no projection left to join
                break
            sizes |= {r.tensors["projected"].shape[1] for r in kept if r.kind == "projected"}
            ids = torch.arange(BATCH) + step * BATCH
            writer.write(kept, BatchMeta(ids, step, "train", 0, 0, y, torch.zeros(BATCH)))
            for layer, values in _reference_sq_norms(model, x, y).items():
                expected[layer].append(values)
            stored += 1
    assert {16, 8} <= sizes, sizes  # the steps' projections shrank during the run
    store = open_store(tmp_path)
    got = store.norms("train", by_layer=True)
    for layer in ("inp", "head"):
        want = torch.cat(expected[layer])  # (stored * BATCH,)
        have = torch.as_tensor(got[layer]).double() ** 2 if layer in got else None
        assert have is not None and have.shape == want.shape, (layer, stored)
        assert torch.allclose(have, want, rtol=1e-4, atol=1e-10), layer
