"""Every layer family survives the store: restored gradients equal torch.func per-sample gradients, per encoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from metastore_plugins import CaptureSession, StoreWriter, open_store
from metastore_plugins.testing import reference_per_sample_gradients

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # vmap: EmbeddingBag

#: max |restored - reference| / max |reference| per encoding (measured errors are far below: see docs/store.md)
BOUNDS = {"fp32": 1e-5, "fp16": 1e-3, "bf16": 2e-2, "int8": 2e-2}


class Families(nn.Module):
    """Conv2d (grouped), Conv1d, nn.MultiheadAttention, transformers' Conv1D, GroupNorm and a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.conv = nn.Conv2d(4, 8, kernel_size=3, padding=1, groups=2)
        self.norm = nn.GroupNorm(2, 8)
        self.conv1d = nn.Conv1d(8, 8, kernel_size=3, stride=2)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.proj = Conv1D(6, 8)  # weight (8, 6): the in_out layout
        self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.norm(self.conv(x)))  # (B, 8, 4, 4)
        h = torch.tanh(self.conv1d(h.flatten(2)))  # (B, 8, 7)
        h = h.transpose(1, 2)  # (B, 7, 8)
        h, _ = self.attn(h, h, h, need_weights=False)
        return self.head(torch.tanh(self.proj(h.contiguous())).mean(1))


class MoreFamilies(nn.Module):
    """The record layouts of the other rules: EmbeddingBag (embedding rows per bag), ConvTranspose2d (factors
    with the input as ``D``, and its ``.bias``), Conv3d, cross-attention (``in_proj`` as 3 row blocks, ``bias_k``
    and ``bias_v``), and separate ``kdim``/``vdim`` projections (``in_proj_bias`` in one record per block)."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 8, mode="mean", padding_idx=0)
        self.deconv = nn.ConvTranspose2d(8, 4, kernel_size=3, stride=2)  # (B, 8, 1, 1) -> (B, 4, 3, 3): factored
        self.conv3d = nn.Conv3d(1, 2, kernel_size=2)
        self.cross = nn.MultiheadAttention(8, 2, batch_first=True, add_bias_kv=True)
        self.kv = nn.MultiheadAttention(8, 2, kdim=6, vdim=5)  # sequence-first
        self.head = nn.Linear(8 + 2 * 2 * 2 * 2, 3)

    def forward(self, ids: Tensor, memory: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        h = torch.tanh(self.bag(ids))  # (B, 8)
        q = h.unsqueeze(1)  # (B, 1, 8)
        a, _ = self.cross(q, memory, memory, need_weights=False)  # (B, 1, 8)
        b, _ = self.kv(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1))  # (1, B, 8)
        v = torch.tanh(self.deconv(h[:, :, None, None]))  # (B, 4, 3, 3)
        v = torch.tanh(self.conv3d(v.unsqueeze(1)))  # (B, 2, 3, 2, 2)
        return self.head(torch.cat([(a + b.transpose(0, 1)).squeeze(1), v[:, :, :2].flatten(1)], 1))


def _loss(model: nn.Module, batch: tuple[Tensor, ...]) -> Tensor:
    *inputs, y = batch
    return F.cross_entropy(model(*inputs), y)


def _batch(family: type[nn.Module], g: torch.Generator) -> tuple[Tensor, ...]:
    y = torch.randint(0, 3, (5,), generator=g)
    if family is Families:
        return torch.randn(5, 4, 4, 4, generator=g), y
    ids = torch.randint(0, 20, (5, 4), generator=g)  # a bag of 4 ids per sample (0 is padding)
    memory, keys, values = (torch.randn(5, 3, d, generator=g) for d in (8, 6, 5))
    return ids, memory, keys, values, y


@pytest.mark.parametrize("family", [Families, MoreFamilies])
@pytest.mark.parametrize("encoding", list(BOUNDS))
def test_every_family_round_trips(tmp_path: Path, encoding: str, family: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = family()
    batch = _batch(family, torch.Generator().manual_seed(1))
    with CaptureSession(model, unsupported="error") as session:
        _loss(model, batch).backward()
    with StoreWriter(tmp_path, encoding=encoding) as writer:
        writer.write(session.factors(), sample_ids=[10, 11, 12, 13, 14], step=0)
    reference = reference_per_sample_gradients(model, _loss, batch)
    store = open_store(tmp_path)
    kinds = {store.layer_info(layer)["kinds"].popitem()[0] for layer in store.layers()}
    assert kinds == ({"outer", "dense"} if family is Families else {"outer", "dense", "embedding"})
    for i, sid in enumerate(range(10, 15)):
        restored = store.restore(sid)
        assert set(restored) == set(reference)
        for name, grad in restored.items():
            expected = reference[name][i]
            error = float((grad - expected).abs().max() / expected.abs().max().clamp_min(1e-30))
            assert error <= BOUNDS[encoding], (encoding, sid, name, error)
