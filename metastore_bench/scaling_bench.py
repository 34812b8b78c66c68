"""Scaling: time and peak memory of store influence as the number of train samples N grows.

Each point runs in a fresh subprocess (``python -m metastore_bench.scaling_bench STORE N REPEATS METHOD``)
and measures its own resident memory, which sees every allocation, torch's included (``tracemalloc``
would not). On Linux the peak is ``VmHWM`` of ``/proc/self/status``, reset with ``/proc/self/clear_refs``
just before the computation; we report that peak minus the resident size at the reset: the extra
memory the computation needed. (``ru_maxrss`` is not used: Linux carries it over ``fork``/``exec``
from the parent, so a child would report the harness's own peak.) Elsewhere ``ru_maxrss`` is the fallback.

The resident set counts the shard pages the reader maps from disk (page cache, which the kernel
drops under memory pressure) as well as the process's own anonymous memory. A thread samples
``RssAnon`` every few milliseconds for the peak of the latter; ``RssFile`` is read before and after.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .publish import REPO


def _status_mib(field: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def _reset_peak() -> float:
    """Reset the peak to the current resident size (Linux >= 4.0); return the current size in MiB."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    current = _status_mib("VmRSS")
    return current if current is not None else _peak_mib()


def _peak_mib() -> float:
    peak = _status_mib("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class AnonSampler:
    """Samples ``RssAnon`` on a thread until stopped: the peak of the process's own memory (MiB)."""

    def __init__(self, every_s: float = 0.005) -> None:
        self.every_s, self.peak = every_s, _status_mib("RssAnon") or 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, _status_mib("RssAnon") or 0.0)

    def __enter__(self) -> AnonSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status_mib("RssAnon") or 0.0)


def worker(store_path: str, n_train: int, repeats: int, method: str, threads: int) -> dict[str, Any]:
    """Time ``repeats`` influence computations over the first ``n_train`` train ids (all when ``n_train <= 0``)."""
    import torch

    torch.set_num_threads(threads)
    from metastore_plugins.core.analysis import open_store

    from .stores import rebuild_pass

    store = open_store(store_path)
    ids = list(range(n_train)) if n_train > 0 else None
    before, anon_before, file_before = _reset_peak(), _status_mib("RssAnon") or 0.0, _status_mib("RssFile") or 0.0
    times = []
    with AnonSampler() as anon:
        for _ in range(repeats):
            start = time.perf_counter()
            if method == "store":
                store.influence("train", "test", train_ids=ids)
            else:  # rebuild dense gradients batch by batch from the factors, then matmul
                rebuild_pass(Path(store_path), sorted(store.parameters()), train_ids=ids)
            times.append(time.perf_counter() - start)
    return {
        "n_train": n_train,
        "method": method,
        "times_s": times,
        "rss_before_mib": before,
        "rss_peak_mib": _peak_mib(),
        "anon_before_mib": anon_before,
        "anon_peak_mib": anon.peak,
        "file_before_mib": file_before,
        "file_after_mib": _status_mib("RssFile") or 0.0,
    }


def measure(store_path: Path, n_train: int, repeats: int, method: str, threads: int) -> dict[str, Any]:
    """:func:`worker` in a fresh subprocess (its own peak memory), with its median time added."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [
        sys.executable,
        "-m",
        "metastore_bench.scaling_bench",
        str(store_path),
        str(n_train),
        str(repeats),
        method,
        str(threads),
    ]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"influence worker failed (N={n_train}, {method}):\n{done.stderr[-2000:]}")
    point = json.loads(done.stdout.strip().splitlines()[-1])
    times = sorted(point["times_s"])
    point["median_s"] = times[len(times) // 2]
    return point


def run(workload: Any, sizes: list[int], n_test: int, repeats: int, threads: int) -> dict[str, Any]:
    from .stores import write_store

    model = workload.build()
    points = []
    with tempfile.TemporaryDirectory(prefix="msbench-") as tmp:
        path = Path(tmp) / "store"
        write_store(path, model, workload, max(sizes), n_test, "fp16")
        store_bytes = sum(p.stat().st_size for p in path.glob("*.safetensors"))
        params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        for n in sizes:
            for method in ("store", "rebuild"):
                point = measure(path, n, repeats, method, threads)
                point["extra_peak_mib"] = point["rss_peak_mib"] - point["rss_before_mib"]
                point["dense_fp32_gradients_mib"] = n * params * 4 / 2**20
                points.append(point)
    return {
        "workload": workload.name,
        "n_test": n_test,
        "parameters": params,
        "store_fp16_bytes_at_max_n": store_bytes,
        "memory_measure": "a fresh subprocess per point; VmHWM (peak resident set) reset through "
        "/proc/self/clear_refs just before the computation, minus the resident size at the reset",
        "points": points,
    }


if __name__ == "__main__":
    store_arg, n_arg, repeats_arg, method_arg, threads_arg = sys.argv[1:6]
    print(json.dumps(worker(store_arg, int(n_arg), int(repeats_arg), method_arg, int(threads_arg))))
