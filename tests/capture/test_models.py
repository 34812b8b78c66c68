"""Whole models: every trainable parameter captured, exactly, and padded rows pruned.

Hugging Face models are built from tiny random configurations (never ``from_pretrained``).
BERT's forward has data-dependent control flow that ``torch.func.vmap`` cannot run, so
its reference is a loop of single-sample backward passes; that loop is itself checked
against the ``torch.func`` reference on GPT-2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from capturecases import (
    TOLERANCE,
    Reference,
    assert_exact,
    cross_entropy,
    reference_per_sample_gradients_loop,
)
from torch import Tensor, nn

from metastore_plugins.core.capture import CaptureSession, LayerRecord
from metastore_plugins.testing import max_relative_error, reference_per_sample_gradients

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # vmap over SDPA

VOCAB, PAD = 50, 0


def assert_whole_model_exact(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], Tensor],
    batch: Any,
    reference: Reference = reference_per_sample_gradients,
) -> CaptureSession:
    """Every trainable parameter is captured (nothing reported) and exact."""
    session = assert_exact(model, loss_fn, batch, reference=reference)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert set(session.per_sample_gradients()) == trainable
    return session


def padded_tokens(lengths: list[int], tokens: int) -> tuple[Tensor, Tensor]:
    """Token ids ``(B, T)`` (padding id 0 after each sample's length) and the attention mask."""
    mask = (torch.arange(tokens) < torch.tensor(lengths).unsqueeze(1)).long()  # (B, T)
    ids = torch.randint(1, VOCAB, (len(lengths), tokens)) * mask
    return ids, mask


def sequence_classification_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """Mean cross-entropy of a Hugging Face ``...ForSequenceClassification`` model's logits."""
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    return nn.functional.cross_entropy(model(**inputs).logits, batch["labels"])


def tiny_bert(attention: str = "eager") -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=PAD,
    )
    config._attn_implementation = attention
    return BertForSequenceClassification(config).train()


def tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2ForSequenceClassification

    config = GPT2Config(
        n_embd=16,
        n_layer=2,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=32,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=1,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    config._attn_implementation = "eager"
    return GPT2ForSequenceClassification(config).train()


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_bert_classifier_with_padding_is_exact(attention: str) -> None:
    model = tiny_bert(attention)
    ids, mask = padded_tokens([7, 4, 2], tokens=7)
    token_types = (torch.arange(7) >= 3).long().expand(3, 7) * mask  # a second segment
    batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": token_types, "labels": torch.tensor([0, 1, 1])}
    session = assert_whole_model_exact(model, sequence_classification_loss, batch, reference_per_sample_gradients_loop)
    records = {r.layer: r for r in session.factors()}
    # position ids are (1, T), broadcast over the batch: still one record row per (sample, kept position)
    assert records["bert.embeddings.position_embeddings"].batch_size == 3
    # the classifier reads the [CLS] token only, so the last layer keeps just position 0 of each sample
    last = records["bert.encoder.layer.1.output.dense"]
    assert last.kind == "outer"
    assert last.tensors["position"].tolist() == [0, 0, 0]
    assert last.tensors["sample"].tolist() == [0, 1, 2]


def test_gpt2_classifier_with_padding_is_exact() -> None:
    model = tiny_gpt2()
    ids, mask = padded_tokens([6, 3, 5], tokens=6)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([1, 0, 1])}
    session = assert_whole_model_exact(model, sequence_classification_loss, batch)
    records = {r.layer: r for r in session.factors()}
    assert records["transformer.h.0.attn.c_attn"].layout == "in_out"  # transformers' Conv1D
    score = records["score"]  # the head is applied to every token, read at the last non-padded one
    assert score.tensors["position"].tolist() == [5, 2, 4]


def test_loop_reference_agrees_with_torch_func() -> None:
    """The loop reference used for BERT is itself right: it matches torch.func where both run."""
    model = tiny_gpt2()
    ids, mask = padded_tokens([4, 2], tokens=4)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([1, 0])}
    loop = reference_per_sample_gradients_loop(model, sequence_classification_loss, batch)
    vmapped = reference_per_sample_gradients(model, sequence_classification_loss, batch)
    assert max_relative_error(loop, vmapped) <= TOLERANCE


class EncoderClassifier(nn.Module):
    """Token and learned position embeddings -> ``nn.TransformerEncoder`` -> first token -> Linear.

    Position ids are a 1-D ``arange(T)`` whose embedding is broadcast over the batch (as in nanoGPT).
    """

    def __init__(self, dim: int = 16, tokens: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim, padding_idx=PAD)
        self.position = nn.Embedding(tokens, dim)
        layer = nn.TransformerEncoderLayer(dim, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 3)

    def forward(self, ids: Tensor) -> Tensor:  # (B, T)
        h = self.embed(ids) + self.position(torch.arange(ids.shape[1]))  # (B, T, d)
        h = self.encoder(h, src_key_padding_mask=ids.eq(PAD))  # (B, T, d)
        return self.head(h[:, 0])  # (B, 3)


@pytest.mark.parametrize("batch_size", [3, 5], ids=["B-differs-from-T", "B-equals-T"])
def test_transformer_encoder_classifier_is_exact(batch_size: int) -> None:
    """With B == T a position embedding read as per-sample would have the right shape and wrong values."""
    model = EncoderClassifier(tokens=5)
    ids, _ = padded_tokens([5, 3, 4, 2, 5][:batch_size], tokens=5)
    assert_whole_model_exact(model, cross_entropy, (ids, torch.randint(0, 3, (batch_size,))))


class PositionOnly(nn.Module):
    """A batch of one whose position embedding is not added to anything (no broadcast)."""

    def __init__(self, dim: int = 4, tokens: int = 5) -> None:
        super().__init__()
        self.position = nn.Embedding(tokens, dim)
        self.scale = nn.Linear(1, dim)

    def forward(self, x: Tensor) -> Tensor:  # (1, T, 1)
        ids = torch.arange(x.shape[1]).unsqueeze(0)  # (1, T)
        return torch.tanh(self.position(ids)) * self.scale(x)  # (1, T, d)


def test_batch_of_one_position_ids_without_broadcast_are_exact() -> None:
    model = PositionOnly()
    x, y = torch.randn(1, 5, 1), torch.randn(1, 5, 4)
    assert_whole_model_exact(model, lambda m, b: (m(b[0]) - b[1]).pow(2).sum(), (x, y))


def test_broadcast_position_ids_without_the_model_forward_are_reported() -> None:
    """Calling a submodule directly leaves the broadcast unresolved: reported, not wrong."""
    wrapper = nn.ModuleDict({"classifier": EncoderClassifier(tokens=4)})
    ids, _ = padded_tokens([4, 3, 4, 2], tokens=4)  # B == T: a wrong answer would have the right shape
    with pytest.warns(UserWarning, match="classifier.position.*did not return before backward"):
        with CaptureSession(wrapper) as session:
            cross_entropy(wrapper["classifier"], (ids, torch.randint(0, 3, (4,)))).backward()
    assert session.uncaptured_parameters() == ["classifier.position.weight"]
    assert "classifier.position.weight" not in session.per_sample_gradients()


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1),  # (B, 8, 5, 5)
        nn.BatchNorm2d(8).eval(),
        nn.ReLU(),
        nn.MaxPool2d(2, ceil_mode=True),  # (B, 8, 3, 3)
        nn.Conv2d(8, 8, 3, padding=1, groups=4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(72, 4),
    )


def test_small_cnn_is_exact() -> None:
    model = small_cnn()
    with torch.no_grad():  # non-trivial eval statistics and affine parameters
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
        model[1].weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 3, 10, 10)
    session = assert_whole_model_exact(model, cross_entropy, (x, torch.randint(0, 4, (4,))))
    assert {r.layer: r.kind for r in session.factors()}["1"] == "dense"


class MaskedMeanTagger(nn.Module):
    """Embedding -> Linear per token -> mean over non-padded tokens -> Linear."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.token = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 3)

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:  # (B, T), (B, T)
        h = torch.tanh(self.token(self.embed(ids)))  # (B, T, d)
        keep = mask.unsqueeze(-1).float()  # (B, T, 1)
        return self.head((h * keep).sum(1) / keep.sum(1))  # (B, 3)


def test_padded_rows_are_pruned_and_restoration_stays_exact() -> None:
    lengths, tokens, dim = [6, 2, 4, 1], 6, 32
    ids, mask = padded_tokens(lengths, tokens)
    model = MaskedMeanTagger(dim)

    def loss_fn(model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        return nn.functional.cross_entropy(model(batch[0], batch[1]), batch[2])

    session = assert_whole_model_exact(model, loss_fn, (ids, mask, torch.randint(0, 3, (4,))))
    record: LayerRecord = {r.layer: r for r in session.factors()}["token"]
    assert record.kind == "outer"
    batch, kept = len(lengths), sum(lengths)
    assert record.tensors["prefix"].shape[0] == kept < batch * tokens
    assert record.nbytes < batch * tokens * (dim + dim) * 4
    kept_pairs = list(zip(record.tensors["sample"].tolist(), record.tensors["position"].tolist()))
    assert kept_pairs == [(i, t) for i, length in enumerate(lengths) for t in range(length)]
