"""Partitioned influence (issue 22): one process against two, on a store of 10^5 training rows.

``python -m metastore_bench.distributed_bench [--rows 100000] [--test 64] [--name NAME] [--doc PATH]``
(from the repository root) writes a store the way 2 DDP ranks do (``StoreWriter(rank=0/1)``,
64 MiB shards): a 64-128-10 MLP's factors of ``--rows`` training samples (capture point
``ckpt/train``, batches of 1,000) and ``--test`` test samples (``ckpt/test``), fp32. Then, each
in fresh processes started with ``torch.multiprocessing`` (spawn, gloo on the CPU):

- ``1 proc x 1 thread`` and ``1 proc x 2 threads``: ``store.influence`` (the single-process query);
- ``2 procs x 1 thread``: ``partitioned_influence`` on a 2-rank process group, all-gathered.

Each rank reports its wall time for the query (after a barrier; median of ``REPEATS``), the shard bytes its share
lists (``planned``: the shards it scores, plus the test shards on rank 0) and the bytes its
``read()`` calls returned (``rchar`` of ``/proc/self/io``, page cache included). The figures
are merged into ``metastore_bench/results/distributed.json`` under ``--name``; ``--doc`` rewrites
the table between the ``distributed`` markers of that markdown file.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from metastore_plugins import CaptureSession, StoreWriter, open_store
from metastore_plugins.core.analysis import queries
from metastore_plugins.core.distributed import partitioned_influence, partitioned_influence_top, split

from .publish import RESULTS, publish
from .timing import machine, versions

START, END = "<!-- distributed:start -->", "<!-- distributed:end -->"
BATCH = 1000
#: each rank's figures are the median of this many runs (the machine is shared)
REPEATS = 3


def write_store(path: Path, rows: int, test: int) -> Path:
    """``rows`` train and ``test`` test samples of a 64-128-10 MLP, written by 2 ranks as under DDP."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 10))
    writers = [StoreWriter(path, rank=r, encoding="fp32", flush_seconds=None) for r in (0, 1)]
    for point, count in (("ckpt/train", rows), ("ckpt/test", test)):
        for start in range(0, count, BATCH):
            ids = torch.arange(start, min(start + BATCH, count)) + (0 if point == "ckpt/train" else rows)
            x, y = torch.randn(len(ids), 64), torch.randint(0, 10, (len(ids),))
            with CaptureSession(model, loss_reduction="mean") as session:
                F.cross_entropy(model(x), y).backward()
            writers[(start // BATCH) % 2].write(session.factors(), sample_ids=ids, step=0, capture_point=point, lr=0.1)
            model.zero_grad()
    for writer in writers:
        writer.close()
    return path


def _rchar() -> int:
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def _planned_bytes(store: Any, rank: int, world: int) -> int:
    """Bytes of the shards this rank reads: its share of the train side, and the test side on rank 0."""
    files = {ref.file.name for ref in split(store.select("ckpt/train"), world)[rank].selection.refs}
    if rank == 0:
        files |= {ref.file.name for ref in store.batch_refs("ckpt/test")}
    sizes = {entry.file: entry.bytes for entry in store.index.shards}
    return sum(sizes[name] for name in files)


def _rank(rank: int, world: int, threads: int, port: int, store_dir: str, out: str) -> None:
    torch.set_num_threads(threads)
    if world > 1:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(minutes=10)
        )
        dist.barrier()
    store = open_store(store_dir)
    times, reads = [], []
    for _ in range(REPEATS):  # a fresh store each time: every shard is read again (from the page cache)
        store = open_store(store_dir)
        if world > 1:
            dist.barrier()
        read0, start = _rchar(), time.perf_counter()
        if world > 1:
            scores = partitioned_influence(store, "ckpt/train", "ckpt/test")
        else:
            scores = store.influence("ckpt/train", "ckpt/test")
        times.append(time.perf_counter() - start)
        reads.append(_rchar() - read0)
    seconds, read = statistics.median(times), reads[-1]
    if scores is None:
        raise RuntimeError("partitioned_influence(dst=None) returned no scores")
    np.save(Path(out) / f"scores-{world}-{threads}-{rank}.npy", scores.scores)
    mine = split(store.select("ckpt/train"), world)[rank].selection
    result = {"rank": rank, "seconds": seconds, "rchar": read, "planned_bytes": _planned_bytes(store, rank, world)}
    result["rows"] = len(mine)
    local, top = [], []
    for _ in range(REPEATS):
        start = time.perf_counter()  # this rank's scoring alone (shards in the page cache): no collective
        queries.dot_matrix(mine, store.select("ckpt/test"), weighted=True)
        local.append(time.perf_counter() - start)
        if world > 1:
            dist.barrier()
            start = time.perf_counter()
            partitioned_influence_top(store, "ckpt/train", "ckpt/test", k=10)
            top.append(time.perf_counter() - start)
    result["local_s"] = statistics.median(local)
    if top:
        result["top10_s"] = statistics.median(top)
    (Path(out) / f"rank-{world}-{threads}-{rank}.json").write_text(json.dumps(result))
    if world > 1:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(store_dir: Path, world: int, threads: int, out: Path) -> dict[str, Any]:
    """Run the query in ``world`` fresh processes of ``threads`` threads each; per-rank figures."""
    args = (world, threads, _free_port(), str(store_dir), str(out))
    start = time.perf_counter()
    mp.start_processes(_rank, args=args, nprocs=world, join=True, start_method="spawn")
    ranks = [json.loads((out / f"rank-{world}-{threads}-{r}.json").read_text()) for r in range(world)]
    return {"processes": world, "threads": threads, "launch_and_query_s": time.perf_counter() - start, "ranks": ranks}


def table(runs: dict[str, Any]) -> str:
    lines = [
        "| run | rows | test | setup | query s (slowest rank) | top-10 s | scoring alone s per rank "
        "| train rows/s per rank (scoring) | read per rank (MB) | rchar per rank (MB) | same as 1 proc |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        for m in run["measurements"]:
            slowest = max(r["seconds"] for r in m["ranks"])
            local = ", ".join(f"{r['local_s']:.2f}" for r in m["ranks"])
            per_rank = ", ".join(f"{r['rows'] / r['local_s']:,.0f}" for r in m["ranks"])
            top = max((r["top10_s"] for r in m["ranks"] if "top10_s" in r), default=None)
            planned = ", ".join(f"{r['planned_bytes'] / 1e6:.0f}" for r in m["ranks"])
            rchar = ", ".join(f"{r['rchar'] / 1e6:.0f}" for r in m["ranks"])
            lines.append(
                f"| {name} | {run['rows']:,} | {run['test']} | {m['processes']} proc x {m['threads']} thread "
                f"| {slowest:.2f} | {'-' if top is None else f'{top:.2f}'} | {local} | {per_rank} | {planned} "
                f"| {rchar} | {m['max_abs_diff']:.1e} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--test", type=int, default=64)
    parser.add_argument("--name", default="default")
    parser.add_argument("--out", type=Path, default=RESULTS / "distributed.json")
    parser.add_argument("--doc", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        store_dir = write_store(Path(tmp) / "store", args.rows, args.test)
        summary = open_store(store_dir).summary()
        work = Path(tmp) / "work"
        work.mkdir()
        measurements = [measure(store_dir, w, t, work) for w, t in ((1, 1), (1, 2), (2, 1))]
        reference = np.load(work / "scores-1-1-0.npy")
        for m in measurements:
            got = [np.load(work / f"scores-{m['processes']}-{m['threads']}-{r}.npy") for r in range(m["processes"])]
            m["max_abs_diff"] = max(float(np.abs(g - reference).max()) for g in got)
    run = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "cpus": os.cpu_count(),
        "versions": versions(),
        "rows": args.rows,
        "test": args.test,
        "store": {"shards": summary["shards"], "bytes_on_disk": summary["bytes_on_disk"]},
        "measurements": measurements,
    }
    data = json.loads(args.out.read_text()) if args.out.exists() else {"runs": {}}
    data["runs"][args.name] = run
    publish(args.out, data, table(data["runs"]), args.doc, (START, END))


if __name__ == "__main__":
    main()
