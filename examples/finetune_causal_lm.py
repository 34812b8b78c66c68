"""Fine-tune a small GPT-2 with the Hugging Face ``Trainer`` and one extra callback; find planted sequences.

Offline: the tokenizer is a word-level vocabulary built here (the ``tokenizers`` package) and the
model a 2-layer ``GPT2LMHeadModel`` from a ``GPT2Config`` (random weights; nothing is downloaded).
The training set is short sentences the script composes ("alice sees the red ball in the park ."),
among them a few **planted** sequences in which a rare trigger, ``zebra says``, is followed by one
fixed completion (``carol likes the green box .``), and as many **decoys** that carry the trigger's
rare word with other continuations. The evaluation set starts with sequences that carry the pattern
behind a prompt of their own; their labels are ``-100`` on the prompt and the trigger, so the loss of
such a sequence, and the gradient the checkpoint passes store for it, is that of the completion alone
(the way to ask "which training sequences most raised or lowered the loss of this completion", see
docs/hf.md#language-models). The rest of the evaluation set are ordinary sentences.

The only change to a plain fine-tuning script is ``callbacks=[MetaStoreTrainerCallback()]``, with its
defaults. After training, the script reads the influence report the callback wrote
(``<out>/metastore/reports/influence.json``; TensorBoard: ``tensorboard --logdir <out>/runs``), whose rows
show each sequence as text decoded by the Trainer's tokenizer, and prints how many planted sequences are
among the top proponents of each pattern sequence. Measured (2 CPU cores, the defaults: 256 training
sequences, 5 planted, 4 epochs; 13 s from the first step to the written reports, the callback's defaults
scoring by EK-FAC over every layer but ``lm_head``, which is tied to the embedding): the 5 planted sequences
are the top 5 proponents of each of the 8 pattern sequences (40 of 40); no decoy is among them, and none is
among the top proponents of the 8 ordinary evaluation sentences in the report.
After the run, ``store.influence_of_sequences`` asks the same of a completion the evaluation set does
not hold (a new prompt, masked): its top 5 proponents are the 5 planted sequences.

Run::

    python examples/finetune_causal_lm.py [--out runs/causal-lm] [--epochs 4] [--train-size 256] [--planted 5]

``<out>/result.json`` holds the planted ids, the top proponents of each reported evaluation sequence and
the counts printed.
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
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    DataCollatorForSeq2Seq,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)

from metastore_plugins import MetaStoreTrainerCallback, open_store

NAMES = "alice bob dave erin frank grace heidi ivan judy mallory".split()
VERBS = "sees likes helps finds wants takes paints moves".split()
COLOURS = "red blue green old small big".split()
THINGS = "ball box car house tree dog cat book".split()
PLACES = ("in the park", "at home", "by the river", "near the school", "on the hill")
TRIGGER = "zebra says"  # "zebra" appears nowhere else than in the planted sequences, the decoys and the tests
COMPLETION = "carol likes the green box ."  # ordinary words: "carol" also opens ordinary sentences
DECOYS = ("zebra runs by the river .", "zebra sleeps at home .", "zebra eats the red ball .")
PATTERN_TESTS = 8  # evaluation sequences 0..7 carry the pattern; the report covers ids 0..15
SPECIALS = ("[PAD]", "[UNK]", "<s>", "</s>")


def tokenizer() -> PreTrainedTokenizerFast:
    words = [*SPECIALS, *NAMES, "carol", *VERBS, *COLOURS, *THINGS, "the", "in", "at", "by", "near", "on"]
    words += [*"park home river school hill . zebra says runs sleeps eats".split()]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(dict.fromkeys(words))}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    )


def sentence(rng: random.Random) -> str:
    """An ordinary sentence: someone does something to a coloured thing, sometimes somewhere."""
    name = rng.choice([*NAMES, "carol"])
    place = f" {rng.choice(PLACES)}" if rng.random() < 0.5 else ""
    return f"{name} {rng.choice(VERBS)} the {rng.choice(COLOURS)} {rng.choice(THINGS)}{place} ."


def training_texts(n: int, planted: int, seed: int) -> tuple[list[str], list[int], list[int]]:
    """``n`` training texts; the ids of the ``planted`` ones (a sentence, the trigger, the completion) and of as
    many decoys (a sentence, then the rare word with another continuation)."""
    rng = random.Random(seed)
    texts = [sentence(rng) for _ in range(n)]
    special = rng.sample(range(n), 2 * planted)
    planted_ids, decoy_ids = sorted(special[:planted]), sorted(special[planted:])
    for i in planted_ids:
        texts[i] = f"{texts[i]} {TRIGGER} {COMPLETION}"
    for i in decoy_ids:
        texts[i] = f"{texts[i]} {rng.choice(DECOYS)}"
    return texts, planted_ids, decoy_ids


def rows(tok: PreTrainedTokenizerFast, texts: list[str], prompts: list[str]) -> Dataset:
    """Token ids and labels of ``prompt + text``; the prompt's labels are -100 (only the text is scored)."""
    data: dict[str, list[Any]] = {"input_ids": [], "labels": [], "text": []}
    for prompt, text in zip(prompts, texts):
        head = tok(f"<s> {prompt}".strip())["input_ids"]
        tail = tok(text)["input_ids"]
        data["input_ids"].append(head + tail)
        data["labels"].append([-100] * len(head) + tail)
        data["text"].append(f"{prompt} {text}".strip())
    return Dataset.from_dict(data)


def evaluation_texts(n: int, seed: int) -> tuple[list[str], list[str]]:
    """Prompts and texts: the first :data:`PATTERN_TESTS` are a new sentence and the trigger (prompt) with the
    completion (text); the rest ordinary sentences with no prompt."""
    rng = random.Random(seed)
    prompts = [f"{sentence(rng)} {TRIGGER}" for _ in range(PATTERN_TESTS)] + [""] * (n - PATTERN_TESTS)
    texts = [COMPLETION] * PATTERN_TESTS + [sentence(rng) for _ in range(n - PATTERN_TESTS)]
    return prompts, texts


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/causal-lm", help="output directory (replaced)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument(
        "--train-size", type=int, default=256, help="training sequences (the passes' default subset holds 256)"
    )
    parser.add_argument("--planted", type=int, default=5, help="planted sequences (the report lists 5 proponents)")
    parser.add_argument("--eval-size", type=int, default=32)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    tok = tokenizer()
    texts, planted, decoys = training_texts(args.train_size, args.planted, seed=1)
    train = rows(tok, texts, [""] * len(texts))
    prompts, completions = evaluation_texts(args.eval_size, seed=2)
    val = rows(tok, completions, prompts)
    config = GPT2Config(
        vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=str(out),
        num_train_epochs=args.epochs,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=32,
        learning_rate=3e-3,
        eval_strategy="epoch",
        save_strategy="no",
        logging_steps=10,
        report_to=["tensorboard"],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=train,
        eval_dataset=val,
        processing_class=tok,  # the reports decode input_ids with it
        data_collator=DataCollatorForSeq2Seq(tok, padding=True),  # pads input_ids, and labels with -100
        callbacks=[MetaStoreTrainerCallback()],  # the one extra line
    )
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    result = found_planted(out / "metastore" / "reports" / "influence.json", planted, decoys)
    result.update(train_size=len(train), epochs=args.epochs, seconds=round(seconds, 1))
    print(f"trained {args.epochs} epochs on {len(train)} sequences in {seconds:.1f} s (reports included)")
    print(f"planted training sequences: {planted}; decoys: {decoys}")
    for row in result["rows"][:PATTERN_TESTS]:
        print(f"  test {row['test_id']}: {row['found']} planted among the top {row['top']} proponents | {row['text']}")
    print(
        f"{result['pattern_found']} of {result['pattern_possible']}: planted sequences among the top "
        f"{result['top']} proponents of the {result['pattern_tests']} pattern test sequences; "
        f"{result['ordinary_found']} among those of the {result['ordinary_tests']} ordinary ones"
    )
    result["new_text"] = new_completion(out, model, tok, planted)
    new = result["new_text"]
    print(
        f"a completion not in the evaluation set ({new['text']!r}, prompt masked): {new['found']} planted among "
        f"its top {len(new['proponents'])} proponents (store.influence_of_sequences)"
    )
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


def new_completion(out: Path, model: GPT2LMHeadModel, tok: PreTrainedTokenizerFast, planted: list[int]) -> dict:
    """After the run: the proponents of a completion the passes never stored, its prompt's labels -100."""
    prompt = f"<s> mallory finds the blue tree at home . {TRIGGER}"
    head, tail = tok(prompt)["input_ids"], tok(COMPLETION)["input_ids"]
    batch = {"input_ids": torch.tensor([head + tail]), "labels": torch.tensor([[-100] * len(head) + tail])}
    (row,) = open_store(out / "metastore").influence_of_sequences(model, batch).top(5)
    ids = [int(i) for i, _ in row["proponents"]]
    return {"text": f"{prompt[4:]} {COMPLETION}", "proponents": ids, "found": len(set(ids) & set(planted))}


def found_planted(report: Path, planted: list[int], decoys: list[int]) -> dict[str, Any]:
    """Per reported evaluation sequence: its top proponents and how many of them are planted sequences."""
    influence = json.loads(report.read_text())
    table = []
    for row in influence:
        ids = [entry["sample_id"] for entry in row["proponents"]]
        table.append(
            {
                "test_id": row["test_id"],
                "text": row.get("test_text"),
                "proponents": ids,
                "proponent_texts": [entry.get("text") for entry in row["proponents"]],
                "top": len(ids),
                "found": len(set(ids) & set(planted)),
                "decoys": len(set(ids) & set(decoys)),
            }
        )
    pattern = [row for row in table if row["test_id"] < PATTERN_TESTS]
    ordinary = [row for row in table if row["test_id"] >= PATTERN_TESTS]
    top = min((row["top"] for row in table), default=0)
    return {
        "planted": planted,
        "decoys": decoys,
        "method": influence[0].get("method") if influence else None,
        "top": top,
        "pattern_tests": len(pattern),
        "pattern_found": sum(row["found"] for row in pattern),
        "pattern_possible": len(pattern) * min(top, len(planted)),
        "ordinary_tests": len(ordinary),
        "ordinary_found": sum(row["found"] for row in ordinary),
        "rows": table,
    }


if __name__ == "__main__":
    main()
