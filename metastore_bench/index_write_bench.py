"""The write side of the nearest-gradient index: training step time with ``index`` on and off, and its build at close.

``python -m metastore_bench.index_write_bench [--rounds 5] [--steps 40] [--workloads cnn,bert6] [--out JSON]``
``python -m metastore_bench.index_write_bench --store RUN/store [--repeats 3]`` (the build on a copy of a store)

Per workload and round, two runs of :class:`RunCapture` as the callbacks use it (capture_bench's
``capture+store``: the model hooked once, fp16 records and per-sample losses to the :class:`StoreWriter`), one
with ``index=False`` and one with ``index=True``, in this process, their ``--steps`` timed steps (after two
untimed ones) alternated step by step (ABBA), so that load from other jobs hits both alike (whole runs
alternated were not enough on the shared machine: its load swings within a minute). A shard is written every
``--flush-seconds`` (2 s by default, against the writer's 10 s: more shards than a real run). A run's step
time is the mean of its timed steps (a cost in bursts would show there), beside their median; the median over
rounds is kept. ``index=True`` builds nothing while the steps run (the parts are built in ``close()``, after
compaction), so the step times differ by noise only. ``close`` (the last shard, compaction, and with
``index`` the parts' build, :func:`~metastore_plugins.core.analysis.index_parts.build_rank_parts`) is timed
apart, and the build's own seconds are reported as a share of the run (timed steps plus close).

``--store``: the close-time build on a copy of an existing store (its ``vector_index/`` removed), rank 0,
the median of ``--repeats`` builds: the cost at the end of that run (e.g. ``examples/finetune_bert.py``'s store).
The load average is recorded before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from metastore_plugins.core.analysis.index_parts import build_rank_parts
from metastore_plugins.core.store import StoreReader
from metastore_plugins.core.store.vectors import vector_files as vf
from metastore_plugins.core.training.run import RunCapture

from .models import Workload, bert_workload, cnn_workload, minilm_reviews_workload
from .timing import machine

LR = 1e-4
#: ``bert6``: MiniLM's shape (6 layers, hidden 384), randomly initialised: no weights to load
WORKLOADS: dict[str, Callable[[], Workload]] = {
    "cnn": cnn_workload,
    "bert6": lambda: bert_workload(6, 64),
    "minilm": minilm_reviews_workload,
}


class _Run:
    """One training run of ``workload`` through :class:`RunCapture` (``index`` on or off), stepped from outside."""

    def __init__(self, workload: Workload, root: Path, index: bool, flush_seconds: float) -> None:
        self.workload, self.model = workload, workload.build()
        self.batch = workload.batch(workload.batch_size, seed=0)
        self.opt = torch.optim.SGD([p for p in self.model.parameters() if p.requires_grad], lr=LR)
        self.path = root / ("with" if index else "without")
        self.run = RunCapture(self.path, encoding="fp16", flush_seconds=flush_seconds, index=index)
        self.times: list[float] = []

    def step(self, k: int, timed: bool = True) -> None:
        size, start = self.batch["labels"].shape[0], time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        self.run.begin_step(self.model)
        logits = self.workload.forward(self.model, self.batch)
        F.cross_entropy(logits, self.batch["labels"]).backward()
        self.run.end_backward()
        self.run.finish_step(self.batch, torch.arange(size) + k * size, step=k, lr=LR, output=logits)
        self.opt.step()
        if timed:
            self.times.append(time.perf_counter() - start)

    def close(self) -> dict[str, Any]:
        index_files_in_steps = len(list((self.path / vf.FOLDER).glob("*")))  # none: built at close
        start = time.perf_counter()
        self.run.close()
        close, built = time.perf_counter() - start, self.run.index_parts
        return {
            "step_s": statistics.mean(self.times),  # a part's or a shard's cost would come in bursts
            "step_s_median": statistics.median(self.times),
            "close_s": close,
            "shards": self.run.writer.stats.shards,
            "index_files_in_steps": index_files_in_steps,
            "parts": 0 if built is None else len(built.written),
            "build_s": 0.0 if built is None else built.seconds,
            "problems": [] if built is None else built.problems,
        }


def paired_runs(workload: Workload, steps: int, flush_seconds: float) -> dict[str, dict[str, Any]]:
    """A run with ``index`` off and one with it on in this process, their steps alternated (ABBA) so that load
    from other jobs hits both alike; then each closed (timed apart)."""
    with tempfile.TemporaryDirectory(prefix="msbench-index-") as tmp:
        runs = {
            "without": _Run(workload, Path(tmp), False, flush_seconds),
            "with": _Run(workload, Path(tmp), True, flush_seconds),
        }
        for k in range(steps + 2):
            for name in ("without", "with") if k % 2 == 0 else ("with", "without"):
                runs[name].step(k, timed=k >= 2)  # two untimed steps first
        return {name: run.close() for name, run in runs.items()}


def store_build(store: Path, repeats: int) -> dict[str, Any]:
    """The close-time build of rank 0's parts on copies of ``store`` (its index removed): median seconds."""
    reader = StoreReader(store)
    rows = {cp: len(reader.sample_ids(cp)) for cp in reader.capture_points()}
    seconds, parts, nbytes = [], 0, 0
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="msbench-index-store-") as tmp:
            copy = Path(tmp) / "store"
            shutil.copytree(store, copy, ignore=shutil.ignore_patterns(vf.FOLDER))
            built = build_rank_parts(copy, 0)
            if built.problems:
                raise RuntimeError(built.problems[0])
            seconds.append(built.seconds)
            parts = len(built.written)
            nbytes = sum(f.stat().st_size for f in (copy / vf.FOLDER).iterdir())
    return {"store": str(store), "rows": rows, "parts": parts, "index_bytes": nbytes, "build_s": seconds}


def measure(name: str, rounds: int, steps: int, flush_seconds: float) -> dict[str, Any]:
    workload = WORKLOADS[name]()
    runs: dict[str, list[dict[str, Any]]] = {"without": [], "with": []}
    for _ in range(rounds):
        for variant, result in paired_runs(workload, steps, flush_seconds).items():
            runs[variant].append(result)
    without = statistics.median(x["step_s"] for x in runs["without"])
    with_ = statistics.median(x["step_s"] for x in runs["with"])
    build = statistics.median(x["build_s"] for x in runs["with"])
    run_s = statistics.median(x["step_s"] * steps + x["close_s"] for x in runs["with"])
    return {
        "workload": workload.name,
        "batch_size": workload.batch_size,
        "steps": steps,
        "rounds": rounds,
        "flush_seconds": flush_seconds,
        "step_s_without": without,
        "step_s_with": with_,
        "cost_percent_of_step": 100.0 * (with_ - without) / without,
        "paired_percent": [
            100.0 * (b["step_s"] - a["step_s"]) / a["step_s"] for a, b in zip(runs["without"], runs["with"])
        ],
        "index_files_in_steps": max(x["index_files_in_steps"] for x in runs["with"]),
        "median_step_s_without": statistics.median(x["step_s_median"] for x in runs["without"]),
        "median_step_s_with": statistics.median(x["step_s_median"] for x in runs["with"]),
        "close_s_without": statistics.median(x["close_s"] for x in runs["without"]),
        "close_s_with": statistics.median(x["close_s"] for x in runs["with"]),
        "build_s": build,
        "parts": statistics.median(x["parts"] for x in runs["with"]),
        "build_percent_of_run": 100.0 * build / run_s,
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--flush-seconds", type=float, default=2.0)
    parser.add_argument("--workloads", default="cnn,bert6")
    parser.add_argument("--store", type=Path, default=None, help="time the close-time build on a copy of this store")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"machine": machine(), "cores": os.cpu_count(), "load_before": os.getloadavg()}
    result["threads"] = torch.get_num_threads()
    if args.store is not None:
        result["store_build"] = found = store_build(args.store, args.repeats)
        print(
            f"{found['store']}: {found['parts']} parts ({found['index_bytes'] / 2**20:.1f} MiB) over rows "
            f"{found['rows']}, built in {[round(s, 2) for s in found['build_s']]} s"
        )
    else:
        result["workloads"] = [
            measure(n, args.rounds, args.steps, args.flush_seconds) for n in args.workloads.split(",")
        ]
    result["load_after"] = os.getloadavg()
    for row in result.get("workloads", []):
        print(
            f"{row['workload']}: {1e3 * row['step_s_without']:.1f} ms/step without, {1e3 * row['step_s_with']:.1f} "
            f"with ({row['cost_percent_of_step']:+.2f}%; paired {[round(p, 1) for p in row['paired_percent']]}); "
            f"index files written during the steps: {row['index_files_in_steps']}; median step "
            f"{1e3 * row['median_step_s_without']:.1f} ms without, {1e3 * row['median_step_s_with']:.1f} with; "
            f"close {row['close_s_without']:.2f} s without, {row['close_s_with']:.2f} s with, of which the build "
            f"{row['build_s']:.2f} s ({row['parts']:.0f} parts, {row['build_percent_of_run']:.1f}% of the run)"
        )
    print(f"load average before {result['load_before']}, after {result['load_after']}")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
