"""Recall@10 and time of top-k through the nearest-gradient index, by method, on a captured run with exact layers.

A plain-loop MLP 32-128-128-10 is trained on synthetic clustered data, then a checkpoint pass over ``--rows``
training samples and ``--tests`` test samples is captured with exact fp32 factors (what the default budget keeps
for these layers). For each method and candidate count, each test sample is asked alone (``test_ids=[sid]``: its
own candidates, as a user asking about one prediction) and its indexed top-10 (proponents and opponents) compared
with the exhaustive query of the same method: recall@10 (the fraction of the exhaustive top-10 found), the share of
test samples whose whole top-10 matches, and the median wall time of one query (the curvature and the
preconditioned index already built in the process, as for the second and later queries; the exhaustive query
fits its curvature each call, as the user's does; ``exhaustive_scan_s_median``: every row scored with the
curvature already fitted; ``indexed_query_warm_s_median``: every test sample's indexed query one after another, as
the reports ask them, where the timed ones alternate with scans that leave the index's memory cold). For EK-FAC,
the rule before the preconditioned index (the TracIn index searched with the preconditioned test sketch) is
measured on the same store.

    python -m metastore_bench.index_methods_bench --rows 100000 --out metastore_bench/results/index_methods_100k.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from metastore_plugins import CaptureSession, StoreWriter, open_store
from metastore_plugins.core import ops
from metastore_plugins.core.analysis.curvature import preconditioned_scores
from metastore_plugins.core.analysis.index_files import open_index
from metastore_plugins.core.analysis.index_preconditioned import compresses, fitted_curvature
from metastore_plugins.core.analysis.queries import selected_pairs
from metastore_plugins.core.analysis.results import Scores
from metastore_plugins.core.analysis.sketches import sketch_layers
from metastore_plugins.core.ops.curvature import DEFAULT_RELATIVE_DAMPING
from metastore_plugins.core.ops.precondition import precondition


def capture(
    path: Path, rows: int, tests: int, seed: int = 0, width: tuple[int, int] = (32, 128), batch: int = 512
) -> None:
    """Train the MLP ``d_in-h-h-10`` (``width = (d_in, h)``) two epochs on clustered data with 10% noisy labels, then
    capture one pass over the training and test samples (exact fp32 factors, ``batch`` rows a batch) as
    ``epoch-1/train`` and ``epoch-1/val``."""
    features, hidden = width
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(10, features, generator=gen) * 2
    labels = torch.randint(0, 10, (rows + tests,), generator=gen)
    x = centers[labels] + torch.randn(rows + tests, features, generator=gen)
    noisy = torch.rand(rows + tests, generator=gen) < 0.1
    y = torch.where(noisy, torch.randint(0, 10, (rows + tests,), generator=gen), labels)
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(2):
        for part in torch.randperm(rows, generator=gen).split(128):
            optimizer.zero_grad()
            F.cross_entropy(model(x[part]), y[part]).backward()
            optimizer.step()
    with StoreWriter(path, encoding="fp32") as writer:
        for split, ids in (("train", torch.arange(rows)), ("val", torch.arange(rows, rows + tests))):
            for part in ids.split(batch):
                with CaptureSession(model, loss_reduction="sum") as session:
                    F.cross_entropy(model(x[part]), y[part], reduction="sum").backward()
                writer.write(session.factors(), sample_ids=part, step=0, capture_point=f"epoch-1/{split}", lr=0.05)
                model.zero_grad()


def top_sets(scores: Any, k: int) -> dict[int, set[int]]:
    return {r["sample_id"]: {i for i, _ in r["proponents"]} | {i for i, _ in r["opponents"]} for r in scores.top(k)}


def recall(got: dict[int, set[int]], want: dict[int, set[int]]) -> tuple[float, float]:
    """``(recall@k, share of test samples whose whole top-k is found)``."""
    return (
        float(np.mean([len(got[s] & want[s]) / len(want[s]) for s in want])),
        float(np.mean([got[s] == want[s] for s in want])),
    )


def old_rule(store: Any, full: Any, counts: list[int], k: int = 10) -> dict[int, Any]:
    """Recall of the rule before the preconditioned index: the TracIn index's rows (raw ``g_i``, dim 16) searched
    with the sketch of ``(F + delta I)^-1 g_j`` per test sample, the candidates scored exactly (here: read from the
    exhaustive matrix, which the exact rescoring reproduces)."""
    train, test = "epoch-1/train", "epoch-1/val"
    order = sketch_layers(store, None)
    opened = open_index(store, train, layers=order, build=True)
    assert opened is not None
    fitted = fitted_curvature(store, train, "ekfac", None)
    options = {"damping": None, "relative_damping": DEFAULT_RELATIVE_DAMPING}
    tested, query = old_queries(store, test, fitted, options, order, opened.dim)
    want = top_sets(full, k)
    found = {}
    for count in counts:
        got = {}
        for j, sid in enumerate(tested.tolist()):
            rows = opened.search(np.stack([query[j], -query[j]]), count).ravel()  # (2c,)
            kept = np.isin(full.row_ids, opened.sample_ids[rows])
            got[sid] = top_sets(Scores(full.scores[kept][:, [j]], full.row_ids[kept], full.col_ids[[j]]), k)[sid]
        found[count] = dict(zip(("recall_at_10", "whole_top10"), recall(got, want)))
        print("old rule", count, found[count], flush=True)
    return found


def old_queries(
    store: Any, point: str, fitted: Any, options: dict[str, Any], order: list[str], dim: int
) -> tuple[np.ndarray, np.ndarray]:
    """The old rule's queries: ``(F + delta I)^-1 g_j`` sketched by ``ops.sketch`` as the TracIn index's rows are."""
    found, parts, draw = [], [], ops.Projections()
    for batch in store.select(point, layers=order).batches():
        records = precondition(batch.records, fitted, options["damping"], options["relative_damping"])
        block = torch.zeros(batch.size, len(order), dim * dim)  # (B, L, dim^2)
        for record in records:
            block[:, order.index(record.layer)] += ops.sketch(record, dim, dim, 0, projections=draw)
        parts.append(block.reshape(batch.size, -1).numpy())
        found.append(batch.meta["sample_id"].numpy())
    return np.concatenate(found), np.concatenate(parts)


def measure(
    store: Any, method: str, counts: list[int], timed: int, fresh: int, old: bool, k: int = 10
) -> dict[str, Any]:
    """Per test sample, one query (``test_ids=[sid]``) through the index against the exhaustive query; the timed
    ones alternate indexed and exhaustive queries (the shared machine's load hits both alike)."""
    train, test = "epoch-1/train", "epoch-1/val"
    start = time.perf_counter()
    full = store.influence(train, test, method=method)
    found: dict[str, Any] = {"exhaustive_s_all_tests": time.perf_counter() - start, "candidates": {}}
    want = top_sets(full, k)
    test_ids = [int(i) for i in full.col_ids]
    start = time.perf_counter()
    store.influence(train, test, method=method, k=k, test_ids=test_ids[:1], index=True)  # fit, build
    found["first_indexed_query_s"] = time.perf_counter() - start
    for count in counts:
        got, rows, warm = {}, [], []
        for sid in test_ids:  # one after another, as the reports ask them: the index's memory stays warm
            t0 = time.perf_counter()
            fast = store.influence(train, test, method=method, k=k, candidates=count, test_ids=[sid], index=True)
            warm.append(time.perf_counter() - t0)
            got[sid] = top_sets(fast, k)[sid]
            rows.append(len(fast.row_ids))
        indexed, exhaustive, scan = [], [], []
        for sid in test_ids[:timed]:  # A/B(/C) in alternation
            t0 = time.perf_counter()
            store.influence(train, test, method=method, k=k, candidates=count, test_ids=[sid], index=True)
            indexed.append(time.perf_counter() - t0)
            if len(exhaustive) < fresh:  # the user's query: fits the curvature (minutes at 10^6 rows)
                t0 = time.perf_counter()
                store.influence(train, test, method=method, test_ids=[sid])
                exhaustive.append(time.perf_counter() - t0)
            if method in ("kfac", "ekfac"):  # every row scored, the curvature already fitted
                t0 = time.perf_counter()
                pairs = selected_pairs(store, train, test, test_ids=[sid])
                fitted = {train: fitted_curvature(store, train, method, None)}
                preconditioned_scores(store, pairs, {}, method, None, DEFAULT_RELATIVE_DAMPING, fitted=fitted)
                scan.append(time.perf_counter() - t0)
        r, whole = recall(got, want)
        found["candidates"][count] = {
            "recall_at_10": r,
            "whole_top10": whole,
            "rows_scored_median": float(np.median(rows)),
            "indexed_query_s_median": float(np.median(indexed)),
            "indexed_query_warm_s_median": float(np.median(warm)),
            "exhaustive_query_s_median": float(np.median(exhaustive)) if exhaustive else None,
            "exhaustive_scan_s_median": float(np.median(scan)) if scan else None,
        }
        print(method, count, found["candidates"][count], flush=True)
    if method == "ekfac" and old:
        found["old_rule"] = old_rule(store, full, counts)
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--tests", type=int, default=20)
    parser.add_argument("--timed", type=int, default=3, help="test samples timed, indexed and exhaustive alternated")
    parser.add_argument("--fresh", type=int, default=3, help="of the timed, those timed by the user's query too")
    parser.add_argument("--no-old-rule", action="store_true", help="skip the rule before the preconditioned index")
    parser.add_argument("--candidates", default="200,800,1600")
    parser.add_argument("--methods", default="ekfac")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "store"
        start = time.perf_counter()
        capture(path, args.rows, args.tests)
        store = open_store(path)
        result: dict[str, Any] = {
            "rows": args.rows,
            "tests": args.tests,
            "model": "MLP 32-128-128-10, exact fp32 factors",
            "capture_s": time.perf_counter() - start,
            "load_average": os.getloadavg(),
            "cpus": os.cpu_count(),
            "product_quantized": compresses(store, "epoch-1/train", sketch_layers(store, None)),
            "methods": {},
        }
        counts = [int(c) for c in args.candidates.split(",")]
        for method in args.methods.split(","):
            result["methods"][method] = measure(store, method, counts, args.timed, args.fresh, not args.no_old_rule)
        result["load_average_after"] = os.getloadavg()
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
