"""Fine-tune a small BERT with the Hugging Face ``Trainer`` and one extra callback; find flipped labels.

Offline: the tokenizer is a word-level vocabulary built here and the model is a small
``BertForSequenceClassification`` from a config (random weights; nothing is downloaded).
The data are synthetic sentences of two topics with 10% of the training labels flipped on
purpose. After training, the callback's outlier report (``<out>/metastore/reports``) ranks
training samples (lowest area under the margin first); the script prints how many flipped
labels are in its top 10%, next to the 10% a random pick would find. TensorBoard: ``tensorboard --logdir <out>/runs``.

Run::

    python examples/hf_text_classifier.py [--out runs/hf-text] [--epochs 3] [--train-size 600]
    python examples/hf_text_classifier.py --layers 4 --hidden 256 --defaults   # the callback as it comes

``<out>/result.json`` holds the training seconds (reports included), where the callback's time went,
the peak resident memory and, with the reports, how many flipped labels they found.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import time
from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)

from metastore_plugins import MetaStoreTrainerCallback, phase_seconds

TOPICS = (
    "goal match team score coach league player season striker keeper referee stadium".split(),
    "code bug compiler memory thread kernel server patch python release tensor cache".split(),
)
FILLER = "the a of and to in with on for this that it was is very".split()


def tokenizer() -> PreTrainedTokenizerFast:
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", *FILLER, *TOPICS[0], *TOPICS[1]]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
    )


def sentences(n: int, seed: int, flip: float) -> tuple[Dataset, list[int]]:
    """``n`` sentences with labels (``flip`` of them flipped) and the flipped indices."""
    rng = random.Random(seed)
    texts, labels, flipped = [], [], []
    for i in range(n):
        label = rng.randrange(2)
        words = [
            rng.choice(TOPICS[label]) if rng.random() < 0.5 else rng.choice(FILLER) for _ in range(rng.randint(6, 24))
        ]
        if rng.random() < flip:
            label, flipped = 1 - label, [*flipped, i]
        texts.append(" ".join(words))
        labels.append(label)
    return Dataset.from_dict({"text": texts, "label": labels}), flipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/hf-text")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-size", type=int, default=600)
    parser.add_argument("--flip", type=float, default=0.1)
    parser.add_argument("--layers", type=int, default=2, help="BERT layers")
    parser.add_argument("--hidden", type=int, default=64, help="BERT width (heads of 64; feed-forward 4x wide)")
    parser.add_argument("--no-callback", action="store_true", help="train without the callback (for timing)")
    parser.add_argument("--eval-steps", type=int, default=0, help="evaluate every N steps (default 0: every epoch)")
    parser.add_argument(
        "--defaults",
        action="store_true",
        help="the callback with its defaults (passes of 256 training samples), report_k the top 10%%",
    )
    args = parser.parse_args()

    torch.manual_seed(0)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    tok = tokenizer()
    train, flipped = sentences(args.train_size, seed=1, flip=args.flip)
    val, _ = sentences(64, seed=2, flip=0.0)
    encode = lambda batch: tok(batch["text"], truncation=True, max_length=32)  # noqa: E731
    train, val = train.map(encode, batched=True), val.map(encode, batched=True)
    config = BertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64) if args.hidden > 64 else 2,
        intermediate_size=2 * args.hidden if args.hidden == 64 else 4 * args.hidden,
        max_position_embeddings=64,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertForSequenceClassification(config)
    training = TrainingArguments(
        output_dir=str(out),
        num_train_epochs=args.epochs,
        per_device_train_batch_size=32,
        per_device_eval_batch_size=64,
        learning_rate=1e-3,
        eval_strategy="steps" if args.eval_steps else "epoch",
        eval_steps=args.eval_steps or None,
        save_strategy="no",
        logging_steps=5,
        report_to=["tensorboard"],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    top = max(1, len(train) // 10)
    callback = (
        MetaStoreTrainerCallback(report_k=top)
        if args.defaults
        else MetaStoreTrainerCallback(checkpoint_train_samples=len(train), report_k=top)
    )
    callbacks = [] if args.no_callback else [callback]
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=train,
        eval_dataset=val,
        processing_class=tok,
        data_collator=DataCollatorWithPadding(tok),
        callbacks=callbacks,
    )
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    accuracy = trainer.evaluate()
    print(
        f"trained {args.epochs} epochs on {len(train)} sentences in {seconds:.1f} s "
        f"({'without' if args.no_callback else 'with'} the callback); eval loss {accuracy['eval_loss']:.3f}"
    )
    result = {
        "seconds": round(seconds, 2),
        "callback": not args.no_callback,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),  # Linux: KiB
    }
    if args.no_callback:
        (out / "result.json").write_text(json.dumps(result))
        return
    result.update(phase_seconds(callback.seconds, callback.report_result))
    outliers = json.loads((out / "metastore" / "reports" / "outliers.json").read_text())
    found = sum(row["sample_id"] in set(flipped) for row in outliers)
    result |= {"flipped": len(flipped), "top": len(outliers), "found": found, "recall": found / max(1, len(flipped))}
    print(
        f"the outlier report's top 10% ({len(outliers)} samples) holds {found} of the {len(flipped)} flipped labels "
        f"({result['recall']:.0%}); a random 10% would hold 10%"
    )
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
