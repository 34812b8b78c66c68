"""nn.MultiheadAttention in every configuration, nn.TransformerEncoder/Decoder, against the torch.func reference.

The fused in-projection (``in_proj_weight``/``in_proj_bias``) is applied with ``F.linear``
inside ``F.multi_head_attention_forward``, where module hooks never see it; these tests
check that it and ``out_proj`` are captured exactly anyway.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch
from capturecases import TOLERANCE, assert_exact, assert_exact_under_autocast
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


@dataclass(frozen=True)
class MhaCase:
    """One ``nn.MultiheadAttention`` configuration, as data (``inputs``: which of query/key/value are one tensor)."""

    heads: int = 2
    head_dim: int = 3
    batch: int = 3
    queries: int = 4  # L
    keys: int = 5  # S (L for self-attention)
    inputs: str = "distinct"  # "self" (q is k is v), "shared-kv" (k is v), "distinct"
    kdim: int | None = None
    vdim: int | None = None
    bias: bool = True
    add_bias_kv: bool = False
    add_zero_attn: bool = False
    batch_first: bool = True
    need_weights: bool = True
    key_padding: bool = False
    attn_mask: bool = False

    @property
    def embed(self) -> int:
        return self.heads * self.head_dim


class Attention(nn.Module):
    """``nn.MultiheadAttention`` as ``case`` says -> mean over queries -> logits; masks are constants."""

    def __init__(self, case: MhaCase) -> None:
        super().__init__()
        self.case = case
        self.attn = nn.MultiheadAttention(
            case.embed, case.heads, bias=case.bias, add_bias_kv=case.add_bias_kv, add_zero_attn=case.add_zero_attn,
            kdim=case.kdim, vdim=case.vdim, batch_first=case.batch_first,
        )  # fmt: skip
        self.head = nn.Linear(case.embed, 3)
        self.mask = torch.randn(case.queries, case.keys) if case.attn_mask else None  # (L, S) additive

    def forward(self, query: Tensor, key: Tensor, value: Tensor, padding: Tensor) -> Tensor:
        """``(B, L, E)``, ``(B, S, kdim)``, ``(B, S, vdim)``, ``(B, S)`` True = padded."""
        case = self.case
        q, k, v = (x if case.batch_first else x.transpose(0, 1) for x in (query, key, value))
        if case.inputs == "self":
            k = v = q
        elif case.inputs == "shared-kv":
            v = k
        mask = padding if self.mask is None else padding.float().masked_fill(padding, float("-inf"))
        out, _ = self.attn(
            q, k, v, key_padding_mask=mask if case.key_padding else None, need_weights=case.need_weights,
            attn_mask=self.mask,
        )  # fmt: skip
        out = out if case.batch_first else out.transpose(0, 1)  # (B, L, E)
        return self.head(out.mean(1))  # (B, 3)


def mha_loss(model: nn.Module, batch: tuple[Tensor, ...]) -> Tensor:
    *inputs, y = batch
    return nn.functional.cross_entropy(model(*inputs), y)


def mha_batch(case: MhaCase) -> tuple[Tensor, ...]:
    keys = case.queries if case.inputs == "self" else case.keys
    padding = torch.zeros(case.batch, keys, dtype=torch.bool)
    padding[0, max(1, keys // 2) :] = True  # sample 0's last keys are padded (one stays)
    return (
        torch.randn(case.batch, case.queries, case.embed),
        torch.randn(case.batch, keys, case.kdim or case.embed),
        torch.randn(case.batch, keys, case.vdim or case.embed),
        padding,
        torch.randint(0, 3, (case.batch,)),
    )


@st.composite
def mha_cases(draw: st.DrawFn) -> MhaCase:
    """Opacus' grid (N 1-4, T up to 20, heads 1-2, bias, add_bias_kv, add_zero_attn, kdim/vdim) and more."""
    inputs = draw(st.sampled_from(["self", "shared-kv", "distinct"]))
    queries = draw(st.integers(1, 20))
    separate = inputs != "self" and draw(st.booleans())  # kdim/vdim: q_proj_weight, k_proj_weight, v_proj_weight
    kdim = draw(st.integers(1, 5)) if separate else None
    vdim = kdim if inputs == "shared-kv" else draw(st.integers(1, 5)) if separate else None
    return MhaCase(
        heads=draw(st.integers(1, 3)), head_dim=draw(st.integers(1, 4)), batch=draw(st.integers(1, 4)),
        queries=queries, keys=queries if inputs == "self" else draw(st.integers(1, 20)), inputs=inputs,
        kdim=kdim, vdim=vdim, bias=draw(st.booleans()), add_bias_kv=draw(st.booleans()),
        add_zero_attn=draw(st.booleans()), batch_first=draw(st.booleans()), need_weights=draw(st.booleans()),
        key_padding=draw(st.booleans()), attn_mask=draw(st.booleans()),
    )  # fmt: skip


@settings(max_examples=100, deadline=None)
@given(case=mha_cases(), seed=st.integers(0, 2**16))
def test_every_multihead_attention_configuration_is_exact(case: MhaCase, seed: int) -> None:
    """Every trainable parameter (bias_k/bias_v and the kdim/vdim projections included) is captured exactly."""
    torch.manual_seed(seed)
    assert_exact(Attention(case), mha_loss, mha_batch(case))


@pytest.mark.parametrize(
    ("case", "layers"),
    [
        (MhaCase(inputs="shared-kv"), {"attn.in_proj", "attn.out_proj"}),
        (MhaCase(inputs="distinct", batch_first=False), {"attn.in_proj", "attn.out_proj"}),
        (MhaCase(kdim=4, vdim=5), {"attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.in_proj", "attn.out_proj"}),
        (MhaCase(inputs="self", add_bias_kv=True), {"attn.in_proj", "attn.bias_k", "attn.bias_v", "attn.out_proj"}),
    ],
    ids=["shared-kv", "distinct-sequence-first", "kdim-vdim", "bias-kv"],
)
def test_records_of_each_configuration(case: MhaCase, layers: set[str]) -> None:
    torch.manual_seed(0)
    session = assert_exact(Attention(case), mha_loss, mha_batch(case), loss_reduction="sum")
    assert {r.layer for r in session.factors()} == layers | {"head"}


@pytest.mark.parametrize("pack", [True, False])
def test_cross_attention_in_projection_is_one_record_of_three_row_blocks(pack: bool) -> None:
    """``in_proj_weight`` (3E, E) as G = 3 groups: query rows in group 0, key/value rows in groups 1 and 2."""
    case = MhaCase(heads=2, head_dim=8, batch=3, queries=2, keys=3)
    torch.manual_seed(1)
    model, batch = Attention(case), mha_batch(case)
    expected = reference_per_sample_gradients(model, mha_loss, batch)
    with CaptureSession(model, unsupported="error") as session:
        session.summarized_layers = frozenset() if pack else frozenset({"attn.in_proj"})  # unpacked: all rows kept
        mha_loss(model, batch).backward()
    (record,) = [r for r in session.factors() if r.layer == "attn.in_proj"]
    assert record.kind == "outer"
    assert record.tensors["prefix"].shape[1:] == (3, 16) and record.tensors["suffix"].shape[1:] == (3, 16)
    rows = record.tensors["sample"].numel()  # row t: query t (group 0), key/value t (groups 1, 2)
    assert rows == case.batch * max(case.queries, case.keys) if not pack else 0 < rows <= case.batch * case.keys
    restored = record.restore()
    assert restored["attn.in_proj_weight"].shape == (3, 48, 16) and restored["attn.in_proj_bias"].shape == (3, 48)
    assert max_relative_error(session.per_sample_gradients(), expected) <= TOLERANCE


def test_a_frozen_weight_beside_its_trainable_bias_is_reported_not_wrong() -> None:
    case = MhaCase(kdim=4, vdim=5)
    model, batch = Attention(case), mha_batch(case)
    model.attn.q_proj_weight.requires_grad_(False)  # in_proj_bias's query block can no longer be found
    with pytest.warns(UserWarning, match=r"in_proj_bias"):
        with CaptureSession(model) as session:
            mha_loss(model, batch).backward()
    assert session.uncaptured_parameters() == ["attn.in_proj_bias"]
    expected = reference_per_sample_gradients(model, mha_loss, batch)
    actual = session.per_sample_gradients()
    assert set(actual) == set(expected) - {"attn.in_proj_bias"}
    assert max_relative_error(actual, {name: expected[name] for name in actual}) <= TOLERANCE


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "case",
    [MhaCase(inputs="shared-kv"), MhaCase(batch_first=False, add_bias_kv=True), MhaCase(kdim=4, vdim=5)],
    ids=["shared-kv", "distinct-bias-kv", "kdim-vdim"],
)
def test_cross_attention_under_autocast(case: MhaCase, dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    assert_exact_under_autocast(Attention(case), mha_loss, mha_batch(case), dtype)


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


class DecoderModel(nn.Module):
    """Embedding -> ``nn.TransformerDecoder`` over a memory (cross-attention) -> masked mean -> Linear.

    With ``full``, an ``nn.Transformer`` (encoder over the memory, then the decoder) instead.
    """

    def __init__(self, batch_first: bool, norm_first: bool = False, full: bool = False, dim: int = 8) -> None:
        super().__init__()
        self.batch_first, self.full = batch_first, full
        self.embed = nn.Embedding(20, dim)
        if full:
            self.net: nn.Module = nn.Transformer(dim, 2, 1, 2, 16, dropout=0.0, batch_first=batch_first)
        else:
            layer = nn.TransformerDecoderLayer(dim, 2, 16, dropout=0.0, batch_first=batch_first, norm_first=norm_first)
            self.net = nn.TransformerDecoder(layer, 2, norm=nn.LayerNorm(dim))
        self.head = nn.Linear(dim, 3)

    def forward(self, ids: Tensor, memory: Tensor, padding: Tensor, memory_padding: Tensor) -> Tensor:
        """``(B, T)``, ``(B, S, d)``, ``(B, T)`` and ``(B, S)`` True = padded."""
        h, m = self.embed(ids), memory  # (B, T, d), (B, S, d)
        if not self.batch_first:
            h, m = h.transpose(0, 1), m.transpose(0, 1)  # sequence-first
        causal = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])  # (T, T)
        masks = {"tgt_mask": causal, "tgt_key_padding_mask": padding, "memory_key_padding_mask": memory_padding}
        if self.full:
            h = self.net(m, h, src_key_padding_mask=memory_padding, **masks)
        else:
            h = self.net(h, m, **masks)
        h = h if self.batch_first else h.transpose(0, 1)  # (B, T, d)
        keep = (~padding).float().unsqueeze(-1)  # (B, T, 1)
        return self.head((h * keep).sum(1) / keep.sum(1))


def decoder_loss(model: nn.Module, batch: tuple[Tensor, ...]) -> Tensor:
    *inputs, y = batch
    return nn.functional.cross_entropy(model(*inputs), y)


@pytest.mark.parametrize(
    "batch_first,norm_first,full,batch,tokens",
    [
        (True, False, False, 3, 5),
        (False, False, False, 3, 5),
        (False, False, False, 4, 4),
        (True, True, False, 2, 5),
        (True, False, True, 3, 4),
        (False, False, True, 3, 4),
    ],
    ids=["batch-first", "sequence-first", "sequence-first-B-equals-T", "norm-first", "transformer", "transformer-seq"],
)
def test_transformer_decoder_is_fully_covered_and_exact(
    batch_first: bool, norm_first: bool, full: bool, batch: int, tokens: int
) -> None:
    """Self-attention, cross-attention over the memory (key is value) and causal/padding masks."""
    torch.manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # enable_nested_tensor notice
        model = DecoderModel(batch_first, norm_first, full)
    padding, memory_padding = torch.zeros(batch, tokens, dtype=torch.bool), torch.zeros(batch, 6, dtype=torch.bool)
    padding[0, tokens - 1 :], memory_padding[1, 4:] = True, True
    inputs = (torch.randint(0, 20, (batch, tokens)), torch.randn(batch, 6, 8), padding, memory_padding)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # enable_nested_tensor / norm_first notices
        session = assert_exact(model, decoder_loss, (*inputs, torch.randint(0, 3, (batch,))), unsupported="error")
    assert {r.batch_size for r in session.factors()} == {batch}
    assert any(r.layer.endswith("multihead_attn.in_proj") for r in session.factors())
