"""nn.MultiheadAttention and nn.TransformerEncoder against the torch.func reference.

The fused in-projection (``in_proj_weight``/``in_proj_bias``) is applied with ``F.linear``
inside ``F.multi_head_attention_forward``, where module hooks never see it; these tests
check that it and ``out_proj`` are captured exactly anyway.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch
from capturecases import TOLERANCE, assert_exact
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from metastore_plugins.core.capture import CaptureSession
from metastore_plugins.testing import max_relative_error, reference_per_sample_gradients

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # vmap over SDPA


class SelfAttentionClassifier(nn.Module):
    """``(B, L, E)`` -> MHA self-attention -> mean over non-padded positions -> logits."""

    def __init__(
        self, embed: int, heads: int, batch_first: bool, bias: bool = True, need_weights: bool = True, **mha: bool
    ) -> None:
        super().__init__()
        self.batch_first, self.need_weights = batch_first, need_weights
        self.attn = nn.MultiheadAttention(embed, heads, bias=bias, batch_first=batch_first, **mha)
        self.head = nn.Linear(embed, 3)

    def forward(self, x: Tensor, padding: Tensor) -> Tensor:  # (B, L, E), (B, L) True = padded
        h = x if self.batch_first else x.transpose(0, 1)  # (B, L, E) or (L, B, E)
        h, _ = self.attn(h, h, h, key_padding_mask=padding, need_weights=self.need_weights)
        h = h if self.batch_first else h.transpose(0, 1)  # (B, L, E)
        keep = (~padding).float().unsqueeze(-1)  # (B, L, 1)
        return self.head((h * keep).sum(1) / keep.sum(1))  # (B, 3)


def attention_loss(model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    x, padding, y = batch
    return nn.functional.cross_entropy(model(x, padding), y)


def padded_batch(batch: int, length: int, embed: int, pad: bool) -> tuple[Tensor, Tensor, Tensor]:
    padding = torch.zeros(batch, length, dtype=torch.bool)
    if pad and length > 1:
        padding[0, length // 2 :] = True  # sample 0 has padding at the end
    return torch.randn(batch, length, embed), padding, torch.randint(0, 3, (batch,))


@dataclass(frozen=True)
class AttentionCase:
    id: str
    batch_first: bool
    bias: bool = True
    pad: bool = False
    need_weights: bool = True  # False takes the scaled_dot_product_attention path


CASES = [
    AttentionCase("batch-first", True),
    AttentionCase("sequence-first", False),
    AttentionCase("batch-first-no-bias", True, bias=False),
    AttentionCase("sequence-first-no-bias", False, bias=False),
    AttentionCase("batch-first-padding-mask", True, pad=True),
    AttentionCase("sequence-first-padding-mask", False, pad=True),
    AttentionCase("sdpa-padding-mask", True, pad=True, need_weights=False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_multihead_self_attention_is_exact(case: AttentionCase) -> None:
    model = SelfAttentionClassifier(8, 2, case.batch_first, bias=case.bias, need_weights=case.need_weights)
    session = assert_exact(model, attention_loss, padded_batch(3, 5, 8, case.pad))
    assert {r.layer for r in session.factors()} == {"attn.in_proj", "attn.out_proj", "head"}
    captured = {name for r in session.factors() for name in r.params.values()}
    expected = {"attn.in_proj_weight", "attn.out_proj.weight", "head.weight", "head.bias"}
    assert captured == expected | ({"attn.in_proj_bias", "attn.out_proj.bias"} if case.bias else set())


@settings(max_examples=8, deadline=None)
@given(
    batch=st.integers(1, 3),
    length=st.integers(1, 5),
    heads=st.integers(1, 2),
    head_dim=st.integers(1, 3),
    batch_first=st.booleans(),
    pad=st.booleans(),
)
def test_multihead_attention_shapes(
    batch: int, length: int, heads: int, head_dim: int, batch_first: bool, pad: bool
) -> None:
    torch.manual_seed(batch * 1000 + length * 100 + heads * 10 + head_dim)
    model = SelfAttentionClassifier(heads * head_dim, heads, batch_first)
    assert_exact(model, attention_loss, padded_batch(batch, length, heads * head_dim, pad))


def test_bias_kv_is_reported_and_the_rest_exact() -> None:
    model = SelfAttentionClassifier(6, 2, batch_first=True, add_bias_kv=True)
    batch = padded_batch(3, 4, 6, pad=True)
    expected = reference_per_sample_gradients(model, attention_loss, batch)
    with pytest.warns(UserWarning, match=r"attn\.bias_k, attn\.bias_v"):
        with CaptureSession(model) as session:
            attention_loss(model, batch).backward()
    assert sorted(session.uncaptured_parameters()) == ["attn.bias_k", "attn.bias_v"]
    actual = session.per_sample_gradients()
    assert set(actual) == set(expected) - {"attn.bias_k", "attn.bias_v"}
    assert max_relative_error(actual, {name: expected[name] for name in actual}) <= TOLERANCE


def test_cross_attention_reports_in_projection_and_captures_out_projection() -> None:
    attn = nn.MultiheadAttention(4, 2, batch_first=True)
    batch = (torch.randn(2, 3, 4), torch.randn(2, 5, 4))  # queries, memory

    def cross_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        query, memory = batch
        return model(query, memory, memory)[0].pow(2).sum((1, 2)).mean()

    expected = reference_per_sample_gradients(attn, cross_loss, batch)
    with pytest.warns(UserWarning, match="cross-attention"):
        with CaptureSession(attn) as session:
            cross_loss(attn, batch).backward()
    assert sorted(session.uncaptured_parameters()) == ["in_proj_bias", "in_proj_weight"]
    actual = session.per_sample_gradients()
    assert set(actual) == {"out_proj.weight", "out_proj.bias"}
    assert max_relative_error(actual, {name: expected[name] for name in actual}) <= TOLERANCE


class EncoderClassifier(nn.Module):
    """Embedding -> ``nn.TransformerEncoder`` (with a final norm) -> masked mean -> Linear."""

    def __init__(self, batch_first: bool, norm_first: bool = False, vocab: int = 20, dim: int = 8) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, 2, 16, dropout=0.0, batch_first=batch_first, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(dim), enable_nested_tensor=False)
        self.head = nn.Linear(dim, 3)

    def forward(self, ids: Tensor, padding: Tensor) -> Tensor:  # (B, T), (B, T) True = padded
        h = self.embed(ids)  # (B, T, d)
        h = h if self.batch_first else h.transpose(0, 1)  # (T, B, d) when sequence-first
        h = self.encoder(h, src_key_padding_mask=padding)
        h = h if self.batch_first else h.transpose(0, 1)  # (B, T, d)
        keep = (~padding).float().unsqueeze(-1)  # (B, T, 1)
        return self.head((h * keep).sum(1) / keep.sum(1))


def encoder_loss(model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    ids, padding, y = batch
    return nn.functional.cross_entropy(model(ids, padding), y)


def token_batch(batch: int, tokens: int, vocab: int = 20) -> tuple[Tensor, Tensor, Tensor]:
    padding = torch.zeros(batch, tokens, dtype=torch.bool)
    padding[0, tokens - 2 :] = True
    return torch.randint(0, vocab, (batch, tokens)), padding, torch.randint(0, 3, (batch,))


@pytest.mark.parametrize(
    "batch_first,norm_first,batch,tokens",
    [(True, False, 3, 5), (False, False, 3, 5), (False, False, 4, 4), (False, True, 2, 5)],
    ids=["batch-first", "sequence-first", "sequence-first-B-equals-T", "sequence-first-norm-first"],
)
def test_transformer_encoder_is_exact(batch_first: bool, norm_first: bool, batch: int, tokens: int) -> None:
    """With B == T a wrong sample dimension would give the right shapes and wrong values."""
    model = EncoderClassifier(batch_first, norm_first)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # enable_nested_tensor / norm_first notices
        session = assert_exact(model, encoder_loss, token_batch(batch, tokens))
    assert {r.batch_size for r in session.factors()} == {batch}
