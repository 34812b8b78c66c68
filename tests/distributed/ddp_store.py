"""A store written the way the callbacks write one under 2-rank DDP, and a process group to query it with.

Two ``StoreWriter``s (``rank=0`` and ``rank=1``) share one directory; at every step each rank
writes its half of the batch (``DistributedSampler``'s split), and the checkpoint passes
``epoch-{e}/train`` and ``epoch-{e}/val`` give each rank half of the samples, another half at
each epoch (the sampler reshuffles with ``set_epoch``). Small shards: several per rank.
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from metastore_plugins import StoreWriter
from metastore_plugins.core.training.passes import capture_step

N_TRAIN, N_VAL, BATCH = 40, 6, 4


def per_sample_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels, reduction="none")


def write_ddp_store(path: Path, shard_bytes: int = 1500) -> Path:
    """Train a 6-8-3 MLP for 2 epochs as 2 DDP ranks; both ranks' records go to ``path``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(N_TRAIN + N_VAL, 6), torch.randint(0, 3, (N_TRAIN + N_VAL,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    writers = [StoreWriter(path, rank=r, encoding="fp32", shard_bytes=shard_bytes, flush_seconds=None) for r in (0, 1)]
    step = 0
    for epoch in range(2):
        lr = 0.1 / (epoch + 1)
        for ids in torch.randperm(N_TRAIN, generator=torch.Generator().manual_seed(epoch)).split(2 * BATCH):
            for rank, part in enumerate(ids.split(BATCH)):  # each rank's half of the global batch
                capture_step(
                    model,
                    lambda p=part: model(x[p]),
                    y[part],
                    part,
                    per_sample_ce,
                    writers[rank],
                    step=step,
                    epoch=epoch,
                    lr=lr,
                    loss_scale=0.5,
                )
            optimizer.step()
            optimizer.zero_grad()
            step += 1
        order = torch.randperm(N_TRAIN, generator=torch.Generator().manual_seed(10 + epoch))
        val = torch.arange(N_TRAIN, N_TRAIN + N_VAL)
        for split, ids in (("train", order), ("val", val)):
            for rank in (0, 1):
                mine = ids[rank::2] if epoch == 0 else ids[1 - rank :: 2]  # another half at each epoch
                for part in mine.split(BATCH):
                    capture_step(
                        model,
                        lambda p=part: model(x[p]),
                        y[part],
                        part,
                        per_sample_ce,
                        writers[rank],
                        step=step,
                        epoch=epoch,
                        lr=lr,
                        capture_point=f"epoch-{epoch}/{split}",
                    )
                model.zero_grad()
    for writer in writers:
        writer.close()
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


Worker = Callable[[int, int, Path], Any]


def _entry(rank: int, world: int, port: int, out: Path, worker: Worker, timeout_s: float) -> None:
    result: dict[str, Any]
    # A forked child inherits no OpenMP worker threads: once the test process has run a parallel
    # region (an earlier test's batched matmul), the child's next one waits for them forever.
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=30))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        result = {"ok": worker(rank, world, out)}
    except BaseException as exc:  # reported to the test, which asserts on it
        result = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    (out / f"rank{rank}.json").write_text(json.dumps(result, default=str))
    os._exit(0)  # no destroy_process_group: a peer may be dead, and the test only reads the files


def run_ranks(
    worker: Worker, world: int, out: Path, *, timeout_s: float = 30.0, wait_s: float = 60.0, stuck: int | None = None
) -> dict[int, dict[str, Any]]:
    """Run ``worker(rank, world, out)`` in ``world`` forked gloo processes; each rank's JSON result.

    The rendezvous store lives in this process, as ``torchrun`` keeps it in its agent: it
    outlives any rank. A process still alive after ``wait_s`` is killed (and has no result).
    """
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    context = mp.start_processes(
        _entry, args=(world, port, out, worker, timeout_s), nprocs=world, join=False, start_method="fork"
    )
    host = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False)  # after the fork
    deadline = time.monotonic() + wait_s
    for rank, process in enumerate(context.processes):
        if rank != stuck:
            process.join(max(0.0, deadline - time.monotonic()))
    for process in context.processes:
        if process.is_alive():
            process.kill()
            process.join()
    del host
    results = {}
    for rank in range(world):
        path = out / f"rank{rank}.json"
        if path.exists():
            results[rank] = json.loads(path.read_text())
    return results


def assert_close(got: Any, expected: Any, rtol: float = 1e-6) -> None:
    """fp32 round-off: ``|got - expected| <= rtol * max|expected|`` elementwise (tests/README.md, "Tolerances")."""
    expected = np.asarray(expected, dtype=np.float64)
    scale = float(np.abs(expected).max()) if expected.size else 0.0
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), expected, rtol=0, atol=rtol * scale)
