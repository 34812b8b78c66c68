"""The main job: train a small text classifier with the Hugging Face ``Trainer`` and the callback as one extra line.

Offline: the café reviews are composed here (two classes, positive and negative, 5% of the
training labels flipped on purpose), the tokenizer is a word-level vocabulary built from them
and the model a small ``BertForSequenceClassification`` from a config (random weights); nothing
is downloaded. Everything else is a plain ``Trainer`` script; the only line the plugin adds is
``callbacks=[MetaStoreTrainerCallback(...)]``.

The callback writes a gradient store (``<out>/metastore``), checkpoint passes at every epoch
end over the validation set and a fixed training subset, and when training ends the reports
(``<out>/metastore/reports``, and in TensorBoard beside the Trainer's curves under
``<out>/runs``): the training samples most likely mislabelled (lowest area under the margin),
and per validation sample the training samples that drove its prediction, each row with its
text (decoded from ``input_ids`` with the Trainer's tokenizer). The script prints where the
store is, how to open TensorBoard, the top of the outlier report and one influence row;
``<out>/flipped.json`` lists the ids whose labels were flipped.

Run::

    python examples/train_text_classifier.py [--out runs/text-classifier] [--epochs 3] [--train-size 512]
    tensorboard --logdir runs/text-classifier/runs          # the Text tab holds the reports
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset, disable_progress_bars
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)

from metastore_plugins import MetaStoreTrainerCallback, open_store

DISHES = ("the coffee", "the soup", "the bread", "the pasta", "the dessert", "the breakfast", "the wine", "the salad")
PLACE = ("the service", "the staff", "the terrace", "the music", "the room", "the waiter", "the evening", "the menu")
#: what a review says of anything, then of a dish only: negative (label 0), positive (label 1)
SAID = (
    ("was awful", "was a letdown", "put us off", "was not worth it", "was a disappointment"),
    ("was excellent", "was a treat", "won us over", "was worth every penny", "was a delight"),
)
DISH_SAID = (
    ("tasted stale", "was cold", "was bland", "left us hungry"),
    ("tasted fresh", "was hot", "was rich", "filled us up"),
)
OPENERS = ("", "", "", "honestly", "overall", "to be fair", "i have to say", "in short")
ENDINGS = ("", "", "", "we came on a sunday", "we went with friends", "we sat by the window", "it was busy")
SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]")


def clause(rng: random.Random, label: int) -> str:
    """A dish or something of the place, and what is said of it: negative (``label`` 0) or positive (1)."""
    dish = rng.random() < 0.5
    said = SAID[label] + DISH_SAID[label] if dish else SAID[label]
    return f"{rng.choice(DISHES if dish else PLACE)} {rng.choice(said)}"


def review(rng: random.Random, label: int) -> str:
    """One review of sentiment ``label``: an opener, one clause or two, an ending."""
    body = " and ".join(clause(rng, label) for _ in range(rng.randint(1, 2)))
    return " ".join(part for part in (rng.choice(OPENERS), body, rng.choice(ENDINGS)) if part)


def reviews(n: int, seed: int, flip: float) -> tuple[Dataset, list[int]]:
    """``n`` reviews with labels (``flip`` of them flipped at random) and the flipped indices."""
    rng = random.Random(seed)
    labels = [rng.randrange(2) for _ in range(n)]
    texts = [review(rng, label) for label in labels]
    flipped = sorted(rng.sample(range(n), round(flip * n)))
    for i in flipped:
        labels[i] = 1 - labels[i]
    return Dataset.from_dict({"text": texts, "label": labels}), flipped


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over every word the reviews can use (built here, offline): ``[CLS] words [SEP]``."""
    phrases = [*DISHES, *PLACE, *SAID[0], *SAID[1], *DISH_SAID[0], *DISH_SAID[1], *OPENERS, *ENDINGS, "and"]
    words = [*SPECIALS, *sorted({word for phrase in phrases for word in phrase.split()})]
    vocab = {word: i for i, word in enumerate(words)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = [(token, vocab[token]) for token in ("[CLS]", "[SEP]")]
    core.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
    )


def lines(rows: list[dict[str, Any]], flipped: set[int]) -> list[str]:
    """Report rows as lines: sample id, stored label, whether it was flipped, text."""
    return [
        f"  {row['sample_id']:>4}  label {row['label']}{' (flipped)' if row['sample_id'] in flipped else ''}"
        f"  {row.get('text')!r}"
        for row in rows
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/text-classifier", help="run directory (replaced)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-size", type=int, default=512)
    parser.add_argument("--encoding", default="fp16", choices=["fp32", "fp16", "bf16", "int8"])
    args = parser.parse_args()

    torch.manual_seed(0)
    disable_progress_bars()  # the datasets' map
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    tok = tokenizer()
    train, flipped = reviews(args.train_size, seed=1, flip=0.05)
    val, _ = reviews(64, seed=2, flip=0.0)
    encode = lambda batch: tok(batch["text"])  # noqa: E731
    train, val = train.map(encode, batched=True), val.map(encode, batched=True)
    config = BertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    training = TrainingArguments(
        output_dir=str(out),
        num_train_epochs=args.epochs,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=64,
        learning_rate=5e-3,
        eval_strategy="epoch",
        save_strategy="no",
        logging_steps=16,
        report_to=["tensorboard"],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        lr_scheduler_type="constant",
    )
    trainer = Trainer(
        model=BertForSequenceClassification(config),
        args=training,
        train_dataset=train,
        eval_dataset=val,
        processing_class=tok,  # the reports decode each sample's input_ids with it
        data_collator=DataCollatorWithPadding(tok),
        callbacks=[MetaStoreTrainerCallback(encoding=args.encoding)],  # the one line the plugin adds
    )
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    predicted = trainer.predict(val)
    accuracy = float((predicted.predictions.argmax(1) == predicted.label_ids).mean())
    print(
        f"trained {args.epochs} epochs with capture, passes and reports in {seconds:.1f} s; val accuracy {accuracy:.3f}"
    )
    summarize(out, set(flipped))
    (out / "flipped.json").write_text(json.dumps(flipped))


def summarize(out: Path, flipped: set[int]) -> None:
    """Print where the store is, what it holds, the top label errors and one influence row, and how to open them."""
    store = open_store(out)
    summary, reports = store.summary(), store.path / "reports"
    outliers = json.loads((reports / "outliers.json").read_text())
    influence = json.loads((reports / "influence.json").read_text())
    found = sum(row["sample_id"] in flipped for row in outliers)
    print(
        f"store: {store.path}: {summary['samples']} stored samples in {summary['bytes_on_disk'] / 2**20:.2f} MiB "
        f"({summary['dense_bytes'] / 2**20:.1f} MiB as dense fp32 per-sample gradients), problems: {store.verify()}"
    )
    print(f"flipped labels among the outlier report's top {len(outliers)}: {found} of {len(flipped)}")
    print("top label errors (lowest area under the margin):", *lines(outliers[:5], flipped), sep="\n")
    first = influence[0]
    print(
        f"validation sample {first['test_id']} (label {first['test_label']}) {first.get('test_text')!r}, scored by "
        f"{first['method']}; its top proponents:"
    )
    print(*lines(first["proponents"][:3], flipped), sep="\n")
    print(f"reports: {reports} (outliers.md, influence.md, figures); in a shell: metastore outliers {out}")
    print(f"TensorBoard: tensorboard --logdir {out / 'runs'}  (the Text tab holds the tables)")


if __name__ == "__main__":
    main()
