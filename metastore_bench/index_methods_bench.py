"""Recall@10 and time of top-k through the nearest-gradient index, by method, on a captured run with exact layers.

A plain-loop MLP 32-128-128-10 is trained on synthetic clustered data, then a checkpoint pass over ``--rows``
training samples and ``--tests`` test samples is captured with exact fp32 factors (what the default budget keeps
for these layers). For each method (TracIn, EK-FAC) and candidate count, the indexed top-10 (proponents and
opponents) is compared with the exhaustive query of the same method: recall@10 (the fraction of the exhaustive
top-10 found), the share of test samples whose whole top-10 matches, and the median wall time of one query of
one test sample (the curvature already fitted in the process, as for the second and later queries).

    python -m metastore_bench.index_methods_bench --rows 20000 --out results/index_methods.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from metastore_plugins import CaptureSession, StoreWriter, open_store
from metastore_plugins.core.analysis.index_files import open_index


def capture(path: Path, rows: int, tests: int, seed: int = 0) -> None:
    """Train the MLP two epochs, then capture one pass over the training and test samples (exact fp32 factors)."""
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(10, 32, generator=gen) * 2
    labels = torch.randint(0, 10, (rows + tests,), generator=gen)
    x = centers[labels] + torch.randn(rows + tests, 32, generator=gen)
    noisy = torch.rand(rows + tests, generator=gen) < 0.1
    y = torch.where(noisy, torch.randint(0, 10, (rows + tests,), generator=gen), labels)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(2):
        for part in torch.randperm(rows, generator=gen).split(128):
            optimizer.zero_grad()
            F.cross_entropy(model(x[part]), y[part]).backward()
            optimizer.step()
    with StoreWriter(path, encoding="fp32") as writer:
        for split, ids in (("train", torch.arange(rows)), ("val", torch.arange(rows, rows + tests))):
            for part in ids.split(512):
                with CaptureSession(model, loss_reduction="sum") as session:
                    F.cross_entropy(model(x[part]), y[part], reduction="sum").backward()
                writer.write(session.factors(), sample_ids=part, step=0, capture_point=f"epoch-1/{split}", lr=0.05)
                model.zero_grad()


def top_sets(scores: Any, k: int) -> dict[int, set[int]]:
    return {r["sample_id"]: {i for i, _ in r["proponents"]} | {i for i, _ in r["opponents"]} for r in scores.top(k)}


def measure(store: Any, method: str, counts: list[int], k: int = 10) -> dict[str, Any]:
    train, test = "epoch-1/train", "epoch-1/val"
    start = time.perf_counter()
    full = store.influence(train, test, method=method)
    exhaustive_s = time.perf_counter() - start
    want = top_sets(full, k)
    test_ids = [int(i) for i in full.col_ids]
    found: dict[str, Any] = {"exhaustive_s_all_tests": exhaustive_s, "candidates": {}}
    for count in counts:
        fast = store.influence(train, test, method=method, k=k, candidates=count, index=True)  # fit, build
        got = top_sets(fast, k)
        recall = float(np.mean([len(got[s] & want[s]) / len(want[s]) for s in want]))
        whole = float(np.mean([got[s] == want[s] for s in want]))
        times = []
        for sid in test_ids[:5]:
            t0 = time.perf_counter()
            store.influence(train, test, method=method, k=k, candidates=count, test_ids=[sid])
            times.append(time.perf_counter() - t0)
        one = []
        for sid in test_ids[:3]:
            t0 = time.perf_counter()
            store.influence(train, test, method=method, test_ids=[sid])
            one.append(time.perf_counter() - t0)
        found["candidates"][count] = {
            "recall_at_10": recall,
            "whole_top10": whole,
            "rows_scored": len(fast.row_ids),
            "indexed_query_s_median": float(np.median(times)),
            "exhaustive_query_s_median": float(np.median(one)),
        }
        print(method, count, found["candidates"][count], flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--tests", type=int, default=20)
    parser.add_argument("--candidates", default="50,200,800")
    parser.add_argument("--methods", default="tracin,ekfac")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "store"
        start = time.perf_counter()
        capture(path, args.rows, args.tests)
        store = open_store(path)
        built = time.perf_counter()
        open_index(store, "epoch-1/train", build=True)
        result: dict[str, Any] = {
            "rows": args.rows,
            "tests": args.tests,
            "model": "MLP 32-128-128-10, exact fp32 factors",
            "capture_s": built - start,
            "index_build_s": time.perf_counter() - built,
            "methods": {},
        }
        counts = [int(c) for c in args.candidates.split(",")]
        for method in args.methods.split(","):
            result["methods"][method] = measure(store, method, counts)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
