"""The write side of the nearest-gradient index: training step time with and without each shard's part built.

``python -m metastore_bench.index_write_bench [--rounds 5] [--steps 40] [--workloads cnn,minilm] [--out JSON]``

Per workload, :class:`RunCapture` as the callbacks use it (capture_bench's ``capture+store``: the model hooked
once, fp16 records and per-sample losses to the :class:`StoreWriter`) runs ``--steps`` timed steps (after two
untimed ones) with ``index=False`` and with ``index=True`` (the :class:`PartBuilder` thread builds each shard's
part as the writer lists it), alternating whole runs (ABBA order across rounds) so that load from other jobs
hits both alike. A shard is written every ``--flush-seconds`` (2 s by default, against the writer's 10 s: more
parts per step than a real run, an upper bound of the cost). A step's time is the timed steps' wall time over
their count (a part's cost comes in bursts: a median step would hide it); the median over rounds is kept.
The builder's wall seconds on the parts it finished while the timed steps ran are the share of their time
it was busy (beside training, at the lowest priority). CPU seconds per step, less sensitive to other jobs'
load: of this process (training and writer threads) and of the builder's process (Linux ``/proc``).
``close`` (the last shard, the parts the builder still owes, compaction and the merged shards' parts) is
timed apart. The load average is recorded before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

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


def one_run(workload: Workload, steps: int, index: bool, flush_seconds: float) -> dict[str, Any]:
    """Seconds per training step over ``steps`` timed steps, and what the write side did."""
    model, batch = workload.build(), workload.batch(workload.batch_size, seed=0)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    size = batch["labels"].shape[0]
    with tempfile.TemporaryDirectory(prefix="msbench-index-") as tmp:
        run = RunCapture(Path(tmp) / "store", encoding="fp16", flush_seconds=flush_seconds, index=index)

        def step(k: int) -> None:
            opt.zero_grad(set_to_none=True)
            run.begin_step(model)
            logits = workload.forward(model, batch)
            F.cross_entropy(logits, batch["labels"]).backward()
            run.end_backward()
            run.finish_step(batch, torch.arange(size) + k * size, step=k, lr=LR, output=logits)
            opt.step()

        for k in range(2):
            step(k)
        parts = run.index_parts
        busy, built = (0.0, 0) if parts is None else (parts.seconds, len(parts.written))
        child = 0.0 if parts is None else cpu_seconds(parts.pid)
        start, cpu = time.perf_counter(), time.process_time()
        for k in range(2, steps + 2):
            step(k)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        child = 0.0 if parts is None else cpu_seconds(parts.pid) - child
        busy, built = (0.0, 0) if parts is None else (parts.seconds - busy, len(parts.written) - built)
        start = time.perf_counter()
        run.close()
        close = time.perf_counter() - start
        return {
            "step_s": seconds / steps,
            "cpu_s_per_step": cpu / steps,  # this process, all its threads (training, writer)
            "builder_cpu_s_per_step": child / steps,  # the part builder's process, while the steps ran
            "close_s": close,
            "shards": run.writer.stats.shards,
            "parts_in_steps": built,  # parts finished while the timed steps ran
            "part_build_s_in_steps": busy,  # the builder's wall seconds on them
            "parts": 0 if parts is None else len(parts.written),
            "part_build_s": 0.0 if parts is None else parts.seconds,
            "problems": [] if parts is None else parts.problems,
        }


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux ``/proc``; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(name: str, rounds: int, steps: int, flush_seconds: float) -> dict[str, Any]:
    workload = WORKLOADS[name]()
    runs: dict[str, list[dict[str, Any]]] = {"without": [], "with": []}
    for r in range(rounds):
        order = ["without", "with"] if r % 2 == 0 else ["with", "without"]
        for variant in order:
            runs[variant].append(one_run(workload, steps, variant == "with", flush_seconds))
    without = statistics.median(x["step_s"] for x in runs["without"])
    with_ = statistics.median(x["step_s"] for x in runs["with"])
    built = sum(x["part_build_s"] for x in runs["with"]) / max(1, sum(x["parts"] for x in runs["with"]))
    busy = [x["part_build_s_in_steps"] / (x["step_s"] * steps) for x in runs["with"]]
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
        "part_build_s_per_part": built,
        "part_build_percent_of_steps": 100.0 * statistics.median(busy),
        "parts_in_steps": [x["parts_in_steps"] for x in runs["with"]],
        "cpu_s_per_step_without": statistics.median(x["cpu_s_per_step"] for x in runs["without"]),
        "cpu_s_per_step_with": statistics.median(x["cpu_s_per_step"] for x in runs["with"]),
        "builder_cpu_s_per_step": statistics.median(x["builder_cpu_s_per_step"] for x in runs["with"]),
        "close_s_without": statistics.median(x["close_s"] for x in runs["without"]),
        "close_s_with": statistics.median(x["close_s"] for x in runs["with"]),
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--flush-seconds", type=float, default=2.0)
    parser.add_argument("--workloads", default="cnn,bert6")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"machine": machine(), "cores": os.cpu_count(), "load_before": os.getloadavg()}
    result["threads"] = torch.get_num_threads()
    result["workloads"] = [measure(n, args.rounds, args.steps, args.flush_seconds) for n in args.workloads.split(",")]
    result["load_after"] = os.getloadavg()
    for row in result["workloads"]:
        print(
            f"{row['workload']}: {1e3 * row['step_s_without']:.1f} ms/step without, {1e3 * row['step_s_with']:.1f} "
            f"with ({row['cost_percent_of_step']:+.2f}%; paired {[round(p, 1) for p in row['paired_percent']]}); "
            f"builder busy {row['part_build_percent_of_steps']:.1f}% of the steps' wall time "
            f"(parts built meanwhile {row['parts_in_steps']}), "
            f"{1e3 * row['part_build_s_per_part']:.0f} ms a part; close {row['close_s_without']:.2f} s vs "
            f"{row['close_s_with']:.2f} s; CPU per step: training process {1e3 * row['cpu_s_per_step_without']:.1f} "
            f"ms without, {1e3 * row['cpu_s_per_step_with']:.1f} with, builder process "
            f"{1e3 * row['builder_cpu_s_per_step']:.1f} ms"
        )
    print(f"load average before {result['load_before']}, after {result['load_after']}")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
