"""``CaptureSession.backward`` with ``capture_only``: the hooked gradients and nothing else, still exact.

Reference: ``torch.func`` per-sample gradients (``reference_per_sample_gradients``). The skipped work is
observed directly: a hook on every parameter counts the weight gradients autograd computes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from metastore_plugins import CaptureSession
from metastore_plugins.core.capture.autograd_graph import nodes_reaching
from metastore_plugins.testing import reference_per_sample_gradients


class Branches(nn.Module):
    """Two embeddings summed (a BERT's word and position embeddings), then Linear - LayerNorm - Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.words, self.positions = nn.Embedding(11, 8), nn.Embedding(5, 8)
        self.hidden, self.norm, self.head = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, tokens: Tensor) -> Tensor:  # tokens: (B, T)
        x = self.words(tokens) + self.positions(torch.arange(tokens.shape[1]))  # (B, T, 8)
        return self.head(self.norm(torch.tanh(self.hidden(x)))).mean(1)  # (B, 3)


class Attention(nn.Module):
    """``nn.MultiheadAttention``, whose rule hooks an autograd node, then a Linear head; ``front``: a Linear before."""

    def __init__(self, front: bool) -> None:
        super().__init__()
        self.front = nn.Linear(8, 8) if front else nn.Identity()
        self.attention, self.head = nn.MultiheadAttention(8, 2, batch_first=True), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, T, 8)
        h = self.front(x)  # (B, T, 8)
        return self.head(self.attention(h, h, h)[0].mean(1))  # (B, 3)


def loss_fn(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch["x"]), batch["y"])


def captured(model: nn.Module, batch: dict[str, Tensor], capture_only: bool) -> tuple[dict[str, Tensor], int]:
    """Per-sample gradients from one captured backward, and how many parameter gradients autograd computed."""
    computed = [0]
    handles = [p.register_hook(lambda g: computed.__setitem__(0, computed[0] + 1)) for p in model.parameters()]
    try:
        with CaptureSession(model) as session:
            session.capture_only = capture_only
            session.backward(loss_fn(model, batch))
            return session.per_sample_gradients(), computed[0]
    finally:
        for handle in handles:
            handle.remove()


def assert_matches(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_capture_only_backward_skips_every_weight_gradient_and_stays_exact() -> None:
    torch.manual_seed(0)
    model = Branches()
    batch = {"x": torch.randint(0, 11, (6, 5)), "y": torch.randint(0, 3, (6,))}
    expected = reference_per_sample_gradients(model, loss_fn, batch)
    records, computed = captured(model, batch, capture_only=True)
    assert_matches(records, expected)  # both embedding branches reached
    assert computed == 0 and all(p.grad is None for p in model.parameters())
    records, computed = captured(model, batch, capture_only=False)  # a training step: .grad as always
    assert_matches(records, expected)
    assert computed == len(list(model.parameters())) and all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("front", [True, False])
def test_a_hooked_autograd_node_is_reached_or_the_backward_is_whole(front: bool) -> None:
    """The attention rule's hooked node leads to the front Linear's output (a hooked tensor): the backward is
    restricted. Without that Linear nothing hooked lies below the node, so it gets the whole backward."""
    torch.manual_seed(1)
    model = Attention(front)
    batch = {"x": torch.randn(4, 3, 8), "y": torch.randint(0, 3, (4,))}
    records, computed = captured(model, batch, capture_only=True)
    assert_matches(records, reference_per_sample_gradients(model, loss_fn, batch))
    assert computed == (0 if front else len(list(model.parameters())))


@pytest.mark.parametrize("capture_only", [True, False])
def test_the_hooked_tensors_are_let_go_after_the_backward(capture_only: bool) -> None:
    model = Branches()
    with CaptureSession(model) as session:
        session.capture_only = capture_only
        session.backward(loss_fn(model, {"x": torch.randint(0, 11, (2, 5)), "y": torch.tensor([0, 1])}))
        assert session._grad_targets == {} and session._hooked_nodes == []  # no activation kept alive past it


def test_nodes_reaching_are_those_above_a_target_on_a_path_to_it() -> None:
    x, w = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    a = x * 2  # the target's node
    side = w.exp()  # a branch that never reaches it
    b = a + side
    c = (b * 3).sum()
    reached = nodes_reaching(c.grad_fn, {a.grad_fn})
    names = {type(node).__name__ for node in reached}
    assert names == {"SumBackward0", "MulBackward0", "AddBackward0"} and len(reached) == 3  # c's sum, * 3, + side
    assert a.grad_fn not in reached and side.grad_fn not in reached
