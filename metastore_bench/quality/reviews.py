"""The MiniLM review classifier of ``examples/finetune_bert.py`` as a quality task.

One captured fine-tune (``MetaStoreTrainerCallback`` with its default policy, a checkpoint pass
of every training sample at each epoch) gives the store detectors; ``folds`` plain
fine-tunes on the other folds give cleanlab its out-of-fold probabilities. Two classes, so
uniform, class-conditional and hard flips coincide: only uniform noise is run.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from ..publish import REPO


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("finetune_bert", REPO / "examples" / "finetune_bert.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ReviewsTask:
    """Reviews with labels, a tokenizer and the packaged pretrained MiniLM (offline)."""

    classes = 2

    def __init__(self, train_size: int = 500, epochs: int = 3) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        self.example, self.epochs = _example(), epochs
        self.path = self.example.model_dir()
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        train, _ = self.example.reviews(train_size, seed=1, flip=0.0)
        val, _ = self.example.reviews(128, seed=2, flip=0.0)
        self.texts: list[str] = list(train["text"])
        self.labels = np.array(train["label"], dtype=np.int64)
        self.val = val

    def _dataset(self, rows: np.ndarray, labels: np.ndarray) -> Any:
        from datasets import Dataset

        data = Dataset.from_dict({"text": [self.texts[i] for i in rows], "label": labels[rows].tolist()})
        return data.map(lambda b: self.tokenizer(b["text"], truncation=True, max_length=40), batched=True)

    def _trainer(self, out: Path, train: Any, callbacks: list[Any], seed: int) -> Any:
        import torch
        from transformers import BertForSequenceClassification, DataCollatorWithPadding, Trainer, TrainingArguments

        torch.manual_seed(seed)
        model = BertForSequenceClassification.from_pretrained(self.path, num_labels=2)
        args = TrainingArguments(
            output_dir=str(out),
            num_train_epochs=self.epochs,
            per_device_train_batch_size=32,
            per_device_eval_batch_size=64,
            learning_rate=1e-4,
            eval_strategy="epoch",
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            seed=seed,
            disable_tqdm=True,
        )
        val = self.val.map(lambda b: self.tokenizer(b["text"], truncation=True, max_length=40), batched=True)
        return Trainer(
            model=model,
            args=args,
            train_dataset=train,
            eval_dataset=val,
            processing_class=self.tokenizer,
            data_collator=DataCollatorWithPadding(self.tokenizer),
            callbacks=callbacks,
        )

    def captured_run(self, labels: np.ndarray, out: Path, seed: int) -> tuple[Path, float]:
        """Fine-tune on ``labels`` with the callback; ``(store directory, seconds)``."""
        from metastore_plugins import MetaStoreTrainerCallback

        shutil.rmtree(out, ignore_errors=True)
        rows = np.arange(len(labels))
        callback = MetaStoreTrainerCallback(checkpoint_train_samples=len(labels), report_k=len(labels) // 10)
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._trainer(out, self._dataset(rows, labels), [callback], seed).train()
        return out / "metastore", time.perf_counter() - start

    def fold_probs(self, labels: np.ndarray, train_rows: np.ndarray, held_rows: np.ndarray, seed: int) -> np.ndarray:
        """``(len(held_rows), 2)`` softmax probabilities of a plain fine-tune on ``train_rows``."""
        import tempfile

        import torch

        with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = self._trainer(Path(out), self._dataset(train_rows, labels), [], seed)
            trainer.train()
            logits = trainer.predict(self._dataset(held_rows, labels)).predictions  # (H, 2)
        return torch.softmax(torch.from_numpy(np.asarray(logits)).double(), 1).numpy()
