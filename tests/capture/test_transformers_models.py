"""Tiny transformers models built from configs (nothing downloaded): every trainable parameter captured,
each per-sample gradient within 1e-5 of torch.func per-sample gradients of the whole model.

The specific rules cover Linear, ``Conv1D``, Embedding, LayerNorm and Conv2d; the generic rule covers
the rest: Llama's ``LlamaRMSNorm.weight``, T5's ``T5LayerNorm.weight``, ViT's ``cls_token`` and
``position_embeddings`` (bare parameters of ``ViTEmbeddings``). Dropout probabilities are 0 and the
models stay in training mode. BERT and DistilBERT take their padding as a 4-D additive mask: with a
2-D mask, transformers checks ``mask.all()`` in Python, which the torch.func reference cannot vmap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from metastore_plugins.core.capture import CaptureSession
from metastore_plugins.core.records import restore_all
from metastore_plugins.testing import reference_per_sample_gradients

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")  # vmap over SDPA

BATCH, LENGTH, VOCAB, CLASSES = 3, 5, 40, 3
TINY = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 32}
TOLERANCE = 1e-5


def additive_mask(lengths: list[int]) -> Tensor:
    """``(B, 1, 1, T)`` 0 for kept tokens, the float32 minimum for padding (transformers' own 4-D mask)."""
    keep = torch.arange(LENGTH).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)  # (B, T)
    return ((~keep).float() * torch.finfo(torch.float32).min)[:, None, None, :]


def token_ids() -> Tensor:
    return torch.randint(1, VOCAB, (BATCH, LENGTH))


def bert() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB, max_position_embeddings=16, num_labels=CLASSES, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, **TINY,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def distilbert() -> nn.Module:
    config = transformers.DistilBertConfig(
        vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, hidden_dim=32, max_position_embeddings=16,
        num_labels=CLASSES, dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0,
    )  # fmt: skip
    return transformers.DistilBertForSequenceClassification(config)


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def llama(attention: str) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, max_position_embeddings=16, num_key_value_heads=1,  # grouped-query: 2 heads, 1 KV head
            attn_implementation=attention, **TINY,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)

    return make


def t5() -> nn.Module:
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, dropout_rate=0.0,
        decoder_start_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def vit() -> nn.Module:
    config = transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, num_labels=CLASSES, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, **TINY,
    )  # fmt: skip
    return transformers.ViTForImageClassification(config)


def classification_batch() -> tuple[dict[str, Tensor], Tensor]:
    return {"input_ids": token_ids(), "attention_mask": additive_mask([5, 3, 4])}, torch.randint(0, CLASSES, (BATCH,))


def causal_batch() -> tuple[dict[str, Tensor], Tensor]:
    ids = token_ids()
    return {"input_ids": ids}, ids  # every sample has T - 1 predicted tokens: the mean is over samples' means


def seq2seq_batch() -> tuple[dict[str, Tensor], Tensor]:
    return {"input_ids": token_ids()}, torch.randint(1, VOCAB, (BATCH, 4))


def image_batch() -> tuple[dict[str, Tensor], Tensor]:
    return {"pixel_values": torch.randn(BATCH, 3, 8, 8)}, torch.randint(0, CLASSES, (BATCH,))


def model_loss(model: nn.Module, batch: tuple[dict[str, Tensor], Tensor]) -> Tensor:
    inputs, labels = batch
    return model(**inputs, labels=labels).loss


@dataclass(frozen=True)
class ModelCase:
    id: str
    make: Callable[[], nn.Module]
    batch: Callable[[], tuple[dict[str, Tensor], Tensor]]
    generic: Callable[[str], bool]  # which parameters the generic rule takes


def norm_weights_named(suffix: str) -> Callable[[str], bool]:
    return lambda name: name.endswith(f"{suffix}.weight")


CASES = [
    ModelCase("bert", bert, classification_batch, lambda name: False),
    ModelCase("distilbert", distilbert, classification_batch, lambda name: False),
    ModelCase("gpt2", gpt2, causal_batch, lambda name: False),
    ModelCase("llama-gqa-eager", llama("eager"), causal_batch, lambda name: "norm" in name),
    ModelCase("llama-gqa-sdpa", llama("sdpa"), causal_batch, lambda name: "norm" in name),
    ModelCase("t5", t5, seq2seq_batch, lambda name: "layer_norm" in name),
    ModelCase("vit", vit, image_batch, lambda name: name.startswith("vit.embeddings.") and "patch" not in name),
]


def assert_close_per_parameter(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    """Each parameter within ``TOLERANCE`` of its largest reference entry.

    A gradient that is zero in exact arithmetic (attention key biases: softmax ignores a shift shared by
    all keys) is rounding noise in both, up to ~1e-10 of the model's largest gradient here: such
    parameters (reference below 1e-6 of that) must be as small, not relatively close.
    """
    assert set(actual) == set(expected)
    largest = max(float(want.abs().max()) for want in expected.values())
    for name, want in expected.items():
        scale = float(want.abs().max())
        if scale < 1e-6 * largest:
            assert float(actual[name].abs().max()) <= 1e-6 * largest, name
        else:
            torch.testing.assert_close(actual[name], want, rtol=0.0, atol=TOLERANCE * scale, msg=name)


def captured(case: ModelCase) -> tuple[nn.Module, Any, CaptureSession, dict[str, Tensor]]:
    model, batch = case.make().train(), case.batch()
    with CaptureSession(model, unsupported="error") as session:
        model_loss(model, batch).backward()
        records = session.factors()
    return model, batch, session, restore_all(records)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_every_parameter_is_captured_exactly(case: ModelCase) -> None:
    model, batch, session, actual = captured(case)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert session.uncaptured_parameters() == []
    assert session.generic_parameters() == [name for name in trainable if case.generic(name)]
    expected = reference_per_sample_gradients(model, model_loss, batch)
    assert_close_per_parameter(actual, expected)


def test_t5_relative_attention_bias() -> None:
    """T5 looks up (T_q, T_k) ids and adds the permuted result to every sample's scores: with T_q equal
    to the batch size, shapes cannot tell those ids from a batch; the autograd graph does."""
    case = next(case for case in CASES if case.id == "t5")
    model = case.make().train()
    batch = {"input_ids": torch.randint(1, VOCAB, (BATCH, BATCH))}, torch.randint(1, VOCAB, (BATCH, BATCH))
    with CaptureSession(model, unsupported="error") as session:
        model_loss(model, batch).backward()
        actual = session.per_sample_gradients()
    assert_close_per_parameter(actual, reference_per_sample_gradients(model, model_loss, batch))
