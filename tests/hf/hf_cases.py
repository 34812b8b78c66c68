"""Tiny BERT classifiers, token-id data sets, a local tokenizer and a Trainer helper for the HF callback tests."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

datasets = pytest.importorskip("datasets")
pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    BertTokenizerFast,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
)

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB = SPECIAL + [f"w{i}" for i in range(55)]  # 60 tokens
CLASSES = 3


def make_tokenizer(directory: Path) -> BertTokenizerFast:
    """A BERT word-piece tokenizer over the 60-token vocabulary, built from a local file."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    return BertTokenizerFast(vocab=str(directory / "vocab.txt"), do_lower_case=False)


def make_rows(n: int, seed: int) -> dict[str, list[Any]]:
    """``n`` sentences of 3..9 words, their token ids, labels, and a column the model does not accept."""
    g = torch.Generator().manual_seed(seed)
    rows: dict[str, list[Any]] = {"input_ids": [], "label": [], "text": [], "note": []}
    for i in range(n):
        length = int(torch.randint(3, 10, (1,), generator=g))
        words = torch.randint(5, len(VOCAB), (length,), generator=g).tolist()
        rows["input_ids"].append([2, *words, 3])
        rows["text"].append(" ".join(VOCAB[w] for w in words))
        rows["label"].append(int(torch.randint(0, CLASSES, (1,), generator=g)))
        rows["note"].append(f"row {i}")
    return rows


def make_dataset(n: int, seed: int) -> Any:
    """A ``datasets.Dataset`` with ``input_ids``, ``label`` and two string columns the Trainer drops."""
    return datasets.Dataset.from_dict(make_rows(n, seed))


class TorchDataset(torch.utils.data.Dataset):
    """The same rows as a plain torch dataset of dicts."""

    def __init__(self, n: int, seed: int) -> None:
        self.rows = make_rows(n, seed)

    def __len__(self) -> int:
        return len(self.rows["label"])

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.rows["input_ids"][i], "label": self.rows["label"][i]}


def make_model(seed: int = 0, cls: type = BertForSequenceClassification, dropout: float = 0.0, hidden: int = 16) -> Any:
    """The same tiny BERT for a seed, whatever the global RNG state (which it leaves untouched);
    ``dropout`` is its hidden and attention dropout, ``hidden`` its width (the feed-forward layer twice that)."""
    config = BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=32,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        num_labels=CLASSES,
    )
    config._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls(config)


def train(
    tmp_path: Path,
    model: Any,
    train_set: Any,
    val_set: Any,
    callbacks: list[Any],
    *,
    tokenizer: Any = None,
    resume_from_checkpoint: str | None = None,
    **arguments: Any,
) -> Any:
    """Run a real ``Trainer`` (CPU, no checkpoints unless ``save_strategy`` says) and return it."""
    defaults: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 8,
        "learning_rate": 0.0,
        "num_train_epochs": 2,
        "eval_strategy": "epoch",
        "save_strategy": "no",
        "report_to": ["tensorboard"],
        "use_cpu": True,
        "logging_steps": 1,
        "disable_tqdm": True,
        "seed": 3,
    }
    defaults.update(arguments)
    tokenizer = tokenizer or make_tokenizer(tmp_path / "tok")
    trainer = Trainer(
        model=model,
        args=TrainingArguments(**defaults),
        train_dataset=train_set,
        eval_dataset=val_set,
        data_collator=DataCollatorWithPadding(tokenizer),
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return trainer


def reference_gradient(model: Any, input_ids: list[int], label: int) -> dict[str, Tensor]:
    """The gradient of one sample's own loss, by hand: the sample alone, unpadded, at the model's weights."""
    was_training = model.training
    model.eval()  # no dropout anyway; eval only to be explicit
    model.zero_grad()
    ids = torch.tensor([input_ids])
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.tensor([label]))
    out.loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.train(was_training)
    return grads


def relative_error(stored: dict[str, Tensor], expected: dict[str, Tensor]) -> float:
    """Largest ``max|a - b| / max|b|`` over the parameters stored (all must have a reference)."""
    overall = max(float(ref.abs().max()) for ref in expected.values())
    worst = 0.0
    for name, value in stored.items():
        ref = expected[name]  # floor: a gradient that is zero in exact arithmetic (e.g. the key bias) is rounding noise
        worst = max(worst, float((value.float() - ref).abs().max()) / max(float(ref.abs().max()), 1e-4 * overall))
    return worst


# -- a stand-in for Trainer.train() where accelerate (which Trainer needs) is not installed ------------


def has_accelerate() -> bool:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return False
    return True


class SumOverItemsBert(BertForSequenceClassification):
    """Divides a sum of per-sample losses by the Trainer's ``num_items_in_batch`` (the whole accumulated batch)."""

    def forward(self, input_ids: Any = None, attention_mask: Any = None, labels: Any = None, **kwargs: Any) -> Any:
        num_items = kwargs.pop("num_items_in_batch", None)
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        if labels is not None:
            losses = torch.nn.functional.cross_entropy(out.logits, labels, reduction="none")
            out.loss = losses.sum() / num_items if num_items is not None else losses.mean()
        return out


class MeanBert(BertForSequenceClassification):
    """Tells the Trainer it takes no loss kwargs: its mean loss is divided by the accumulation window's length."""

    accepts_loss_kwargs = False


def simulate_train(
    tmp_path: Path,
    model: Any,
    train_set: Any,
    val_set: Any,
    callbacks: list[Any],
    *,
    tokenizer: Any = None,
    batch_size: int = 4,
    eval_batch_size: int = 8,
    epochs: int = 2,
    accumulation: int = 1,
    lr: float = 0.0,
    report_to: tuple[str, ...] = ("tensorboard",),
    seed: int = 3,
    rank: int = 0,
    world_size: int = 1,
    evaluate: bool = True,
    resume_step: int = 0,
) -> Any:
    """Trainer.train()'s event sequence and loss scaling (transformers 5.23 ``_run_epoch``), for a machine without
    accelerate: shuffled loader, windows of ``accumulation`` prefetched micro-batches, ``num_items_in_batch`` for
    models that take ``**kwargs``, the loss divided by the window length otherwise, evaluation at every epoch end."""
    import inspect
    from types import SimpleNamespace

    from transformers.trainer_callback import CallbackHandler, TrainerControl, TrainerState
    from transformers.utils import logging as transformers_logging

    tokenizer = tokenizer or make_tokenizer(tmp_path / "tok")
    output_dir = tmp_path / "out"
    args = SimpleNamespace(
        output_dir=str(output_dir),
        process_index=rank,
        world_size=world_size,
        gradient_accumulation_steps=accumulation,
        eval_strategy="epoch" if evaluate else "no",
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=eval_batch_size,
        report_to=list(report_to),
    )
    accepts = getattr(model, "accepts_loss_kwargs", None)
    if accepts is None:
        accepts = any(
            p.kind == inspect.Parameter.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values()
        )
    keep = set(inspect.signature(model.forward).parameters) | {"label", "labels"}

    collator = DataCollatorWithPadding(tokenizer)

    def collate(items: list[dict[str, Any]]) -> dict[str, Tensor]:  # RemoveColumnsCollator + label -> labels
        return collator([{k: v for k, v in item.items() if k in keep} for item in items])

    g = torch.Generator().manual_seed(seed)
    shuffle = not isinstance(train_set, torch.utils.data.IterableDataset)
    sampler = None
    if world_size > 1:  # what accelerate's BatchSamplerShard amounts to: each rank its own share of every epoch
        sampler = torch.utils.data.DistributedSampler(
            train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=seed
        )
        shuffle = False
    train_loader = torch.utils.data.DataLoader(
        train_set, batch_size=batch_size, shuffle=shuffle, sampler=sampler, collate_fn=collate, generator=g
    )
    wrapped = model if world_size == 1 else torch.nn.parallel.DistributedDataParallel(model)
    val_loader = torch.utils.data.DataLoader(val_set, batch_size=eval_batch_size, collate_fn=collate)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # the handler warns that the Trainer's own DefaultFlowCallback is absent
    handler = CallbackHandler(callbacks, model, tokenizer, optimizer, None)
    transformers_logging.set_verbosity(verbosity)
    handler.train_dataloader = train_loader
    state, control = TrainerState(), TrainerControl()
    state.is_world_process_zero = rank == 0
    if "tensorboard" in report_to and rank == 0:  # the Trainer's TensorBoardCallback writes its run directory first
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(output_dir / "runs" / "trainer"))
        writer.add_scalar("train/loss", 0.0, 0)
        writer.flush()
    steps_in_epoch = 0 if isinstance(train_set, torch.utils.data.IterableDataset) else len(train_loader)
    windows = max(1, -(-steps_in_epoch // accumulation))
    state.global_step = resume_step  # resume_from_checkpoint: the saved state is loaded before on_train_begin
    state.epoch = resume_step / windows
    model.zero_grad()
    handler.on_train_begin(args, state, control)
    for epoch in range(resume_step // windows, epochs):
        handler.on_epoch_begin(args, state, control)
        if sampler is not None:
            sampler.set_epoch(epoch)
        iterator = _prefetching(iter(train_loader))
        step, first = -1, 0
        if epoch == resume_step // windows and resume_step % windows:  # skip_first_batches: drawn, never trained on
            first = resume_step % windows
            for _ in range(first * accumulation):
                next(iterator)
            step = first * accumulation - 1
        for _ in range(first, windows):
            samples = [b for b in (next(iterator, None) for _ in range(accumulation)) if b is not None]
            num_items = sum(b["labels"].ne(-100).sum() for b in samples) if accepts else None
            for i, inputs in enumerate(samples):
                step += 1
                if step % accumulation == 0:
                    handler.on_step_begin(args, state, control)
                model.train()
                loss = wrapped(**inputs, **({"num_items_in_batch": num_items} if accepts else {})).loss
                if not (accepts and num_items is not None):
                    loss = loss / len(samples)
                loss.backward()
                if i == len(samples) - 1:
                    handler.on_pre_optimizer_step(args, state, control)
                    optimizer.step()
                    handler.on_optimizer_step(args, state, control)
                    model.zero_grad()
                    state.global_step += 1
                    state.epoch = epoch + (step + 1) / steps_in_epoch
                    handler.on_step_end(args, state, control)
                else:
                    handler.on_substep_end(args, state, control)
        handler.on_epoch_end(args, state, control)
        if not evaluate:  # eval_strategy="no"
            continue
        model.eval()
        handler.eval_dataloader = val_loader
        with torch.no_grad():
            for inputs in val_loader:
                model(**inputs)
        handler.on_evaluate(args, state, control, metrics={})
    handler.on_train_end(args, state, control)
    return SimpleNamespace(
        args=args, state=state, model=model, train_loader=train_loader, log_dir=output_dir / "runs" / "trainer"
    )


def _prefetching(iterator: Any) -> Any:
    """Draw one batch ahead, as accelerate's ``DataLoaderShard`` does."""
    ahead = next(iterator, None)
    while ahead is not None:
        current, ahead = ahead, next(iterator, None)
        yield current
