"""nn.Embedding against the torch.func reference."""

from __future__ import annotations

import pytest
import torch
from capturecases import assert_exact
from torch import Tensor, nn

from metastore_plugins.core.capture import CaptureSession


class BagOfTokens(nn.Module):
    def __init__(self, vocab: int, dim: int, padding_idx: int | None, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.embed(ids)).mean(1))


def loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


@pytest.mark.parametrize(
    "padding_idx,reduction", [(None, "mean"), (0, "mean"), (0, "sum")], ids=["no-padding", "padding-idx", "sum"]
)
def test_embedding_is_exact(padding_idx: int | None, reduction: str) -> None:
    model = BagOfTokens(vocab=11, dim=4, padding_idx=padding_idx)
    ids = torch.randint(1, 11, (5, 6))
    ids[:, 4:] = 0  # padding at the end
    ids[2, 1] = ids[2, 0]  # a repeated token in one sample
    session = assert_exact(model, loss, (ids, torch.randint(0, 3, (5,))), loss_reduction=reduction)
    (record,) = [r for r in session.factors() if r.layer == "embed"]
    if padding_idx is not None:
        assert record.kind == "embedding"
        assert not (record.tensors["ids"] == padding_idx).any()  # padding rows are never stored


def test_scale_grad_by_freq_is_reported_not_wrong() -> None:
    model = BagOfTokens(vocab=7, dim=3, padding_idx=None)
    model.embed.scale_grad_by_freq = True
    ids = torch.randint(0, 7, (2, 4))
    with pytest.warns(UserWarning, match="scale_grad_by_freq"):
        with CaptureSession(model) as session:
            loss(model, (ids, torch.tensor([0, 1]))).backward()
    assert session.uncaptured_parameters() == ["embed.weight"]
    assert "embed.weight" not in session.per_sample_gradients()
