"""Analytics: per-sample norms and exact influence (N train x M test), three ways, side by side.

- ``store``: ``open_store(...).norms("train")`` / ``.influence("train", "test")`` -- reads the
  shards and computes on the factors (the ops choose factored or dense per layer);
- ``torch.func``: per-sample gradients by ``vmap(grad)`` (train in chunks), flattened, ``matmul``;
- ``rebuild``: read the same store, rebuild dense per-sample gradients from the factors, ``matmul``.

Agreement is ``max |a - e| / max |e|`` against torch.func (fp32 store: exact up to float
rounding; the default fp16 store is lossy by design, and its error is reported too).

Next to the exact store influence: the arithmetic rate of its plan against one large matmul
timed in the same rounds, and (text workloads) its peak memory in a fresh process
(:mod:`metastore_bench.influence_profile`; the stores and the rebuild in :mod:`metastore_bench.stores`);
and sketched influence, whose sketches are built once
(``store.build_sketches``, timed once) and then read from the store's cache by every query.

``python -m metastore_bench.analytics_bench`` runs the workload of issue 35 (:func:`read_case`): pretrained
all-MiniLM-L6-v2 with only its Linear weights trainable, an fp32 store of 256 train and 32 test reviews
at T = 64 with real padding; exact influence against torch.func + matmul, the share of the query spent
reading and checking shards (first query of a process, and a later one), and the checksum rates.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from metastore_plugins.core.analysis import open_store
from metastore_plugins.core.store.reading import readcache
from metastore_plugins.core.store.reading.batches import BatchRef
from metastore_plugins.core.store.reading.selection import ReadAhead

from .capture_bench import func_per_sample_grads
from .influence_profile import Matmul, influence_memory, plan_flops
from .models import Workload, freeze_word_embeddings, minilm_reviews_workload
from .stores import flat, rebuild_pass, write_store
from .timing import median, rel_error, timed


def torch_func_pass(model: torch.nn.Module, workload: Workload, n_train: int, n_test: int) -> dict[str, Any]:
    """Norms and influence from torch.func per-sample gradients; times of each part."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    times = {"grads_test": 0.0, "grads_train": 0.0, "matmul": 0.0, "norms": 0.0}
    start = time.perf_counter()
    test = []
    for k, lo in enumerate(range(0, n_test, workload.batch_size)):
        batch = workload.batch(min(workload.batch_size, n_test - lo), 200 + k)
        test.append(flat(func_per_sample_grads(model, workload, batch), names))
    g_test = torch.cat(test)  # (M, P)
    times["grads_test"] = time.perf_counter() - start
    scores, norms = [], []
    for k, lo in enumerate(range(0, n_train, workload.batch_size)):
        batch = workload.batch(min(workload.batch_size, n_train - lo), 100 + k)
        t0 = time.perf_counter()
        g = flat(func_per_sample_grads(model, workload, batch), names)  # (n, P)
        t1 = time.perf_counter()
        scores.append(g @ g_test.T)  # (n, M)
        t2 = time.perf_counter()
        norms.append(g.norm(dim=1))  # (n,)
        times["grads_train"] += t1 - t0
        times["matmul"] += t2 - t1
        times["norms"] += time.perf_counter() - t2
    return {"scores": torch.cat(scores).double().numpy(), "norms": torch.cat(norms).double().numpy(), "times": times}


def run(workload: Workload, n_train: int, n_test: int, repeats: int, matmul_size: int = 4096) -> dict[str, Any]:
    """Every figure of one workload: ``repeats`` rounds of store norms, exact and sketched influence, one
    ``matmul_size``-cubed matmul, torch.func and rebuild, one of each per round; then plan flops and memory."""
    model = workload.build()
    if workload.kind == "text":
        freeze_word_embeddings(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    matmul = Matmul(matmul_size)
    with tempfile.TemporaryDirectory(prefix="msbench-") as tmp:
        paths = {enc: Path(tmp) / enc for enc in ("fp32", "fp16")}
        for enc, path in paths.items():
            write_store(path, model, workload, n_train, n_test, enc)
        store = open_store(paths["fp32"])
        if sorted(store.parameters()) != sorted(names):
            raise RuntimeError(f"the store captured {sorted(store.parameters())}, expected {names}")
        # warm-up (also first reads from the page cache): one untimed call of each
        store.norms("train"), store.influence("train", "test")
        start = time.perf_counter()  # sketches built once, then kept in the store
        built = [store.build_sketches(point, dim=SKETCH_DIM) for point in ("train", "test")]
        sketch_build_s = time.perf_counter() - start
        if None in built:
            raise RuntimeError(f"could not keep sketches in {paths['fp32']}")
        cache_bytes = sum(path.stat().st_size for path in built if path is not None)
        times: dict[str, list[float]] = {"norms": [], "influence": [], "sketched": [], "matmul": []}
        func_runs, rebuild_runs = [], []
        for _ in range(repeats):  # one of each per round: load from other jobs hits all alike
            norms, t = timed(lambda: store.norms("train"))
            times["norms"].append(t)
            scores, t = timed(lambda: store.influence("train", "test").scores)
            times["influence"].append(t)
            sketched, t = timed(lambda: store.sketched_influence("train", "test", dim=SKETCH_DIM).scores)
            times["sketched"].append(t)
            times["matmul"].append(matmul())
            func_runs.append(torch_func_pass(model, workload, n_train, n_test))
            rebuild_runs.append(rebuild_pass(paths["fp32"], names))
        flops = plan_flops(store)
        half = open_store(paths["fp16"])
        half_norms, half_scores = half.norms("train"), half.influence("train", "test").scores
        store_bytes = sum(p.stat().st_size for p in paths["fp16"].glob("*.safetensors"))
        threads = torch.get_num_threads()
        memory = (
            {enc: influence_memory(path, threads) for enc, path in paths.items()} if workload.kind == "text" else {}
        )
    ref = func_runs[-1]
    func_norm_t = [r["times"]["grads_train"] + r["times"]["norms"] for r in func_runs]
    func_infl_t = [r["times"]["grads_train"] + r["times"]["grads_test"] + r["times"]["matmul"] for r in func_runs]
    rebuild_infl_t = [r["influence_s"] for r in rebuild_runs]
    result = {
        "workload": workload.name,
        "n_train": n_train,
        "n_test": n_test,
        "parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "repeats": repeats,
        "fp16_store_bytes": store_bytes,
        "norms_s": {
            "store": median(times["norms"]),
            "torch.func": median(func_norm_t),
            "rebuild": median([r["norms_s"] for r in rebuild_runs]),
        },
        "influence_s": {
            "store": median(times["influence"]),
            "torch.func": median(func_infl_t),
            "rebuild": median(rebuild_infl_t),
            "torch.func_matmul_only": median([r["times"]["matmul"] for r in func_runs]),
        },
        "influence_rate": {
            "plan_flops": flops,
            "plan_gflops_per_s": flops / median(times["influence"]) / 1e9,
            "matmul_size": matmul_size,
            "matmul_gflops_per_s": matmul.gflops(median(times["matmul"])),
        },
        "influence_memory_mib": memory,
        "sketch": {
            "dim": SKETCH_DIM,
            "build_s": sketch_build_s,
            "query_s": median(times["sketched"]),
            "spearman_vs_exact": mean_spearman(sketched, ref["scores"]),
            "cache_bytes": cache_bytes,
        },
        "agreement": {
            "norms_store_fp32": rel_error(norms, ref["norms"]),
            "norms_rebuild_fp32": rel_error(rebuild_runs[-1]["norms"], ref["norms"]),
            "influence_store_fp32": rel_error(scores, ref["scores"]),
            "influence_rebuild_fp32": rel_error(rebuild_runs[-1]["scores"], ref["scores"]),
            "norms_store_fp16": rel_error(half_norms, ref["norms"]),
            "influence_store_fp16": rel_error(half_scores, ref["scores"]),
        },
    }
    result["influence_rate"]["ratio_to_matmul"] = (
        result["influence_rate"]["plan_gflops_per_s"] / result["influence_rate"]["matmul_gflops_per_s"]
    )
    result["speedup"] = {
        "influence_vs_torch.func": result["influence_s"]["torch.func"] / result["influence_s"]["store"],
        "influence_vs_rebuild": result["influence_s"]["rebuild"] / result["influence_s"]["store"],
        "norms_vs_torch.func": result["norms_s"]["torch.func"] / result["norms_s"]["store"],
        "exact_vs_sketched_query": result["influence_s"]["store"] / result["sketch"]["query_s"],
    }
    return result


SKETCH_DIM = 64  # sketches of 64 x 64 = 4096 numbers per sample


def _ranks(values: np.ndarray) -> np.ndarray:
    return np.argsort(np.argsort(values, kind="stable"), kind="stable").astype(float)


def mean_spearman(approx: np.ndarray, exact: Any) -> float:
    """Mean over test samples (columns) of the Spearman correlation of the two score columns."""
    exact = np.asarray(exact, dtype=float)
    return float(np.mean([np.corrcoef(_ranks(approx[:, j]), _ranks(exact[:, j]))[0, 1] for j in range(exact.shape[1])]))


def agreement_ok(result: dict[str, Any]) -> bool:
    """fp32 results must match torch.func to float rounding."""
    a = result["agreement"]
    return (
        max(a["norms_store_fp32"], a["influence_store_fp32"], a["influence_rebuild_fp32"]) < 1e-3
        and np.isfinite(list(a.values())).all()
    )


# -- issue 35: exact influence at the speed of the disk and the matmul -------------------------------------


@contextmanager
def read_clock() -> Iterator[dict[str, float]]:
    """Seconds the query waits for reading while the block runs: in ``BatchRef.read_records`` (the shard from
    the read cache or the disk, its checksum and header, decoding and checks; or the wait for another
    thread's read of it) and in ``ReadAhead.using`` (waiting for a shard read ahead), together
    ``read_records``; and seconds reading files and checking them (``readcache.read_opened``) on any
    thread, the background read ahead's included: ``shard_reads``, overlapped with the arithmetic."""
    spent = {"read_records": 0.0, "shard_reads": 0.0}
    originals = (BatchRef.read_records, readcache.read_opened, ReadAhead.using)

    def clocked(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start

        return run

    BatchRef.read_records = clocked("read_records", originals[0])  # type: ignore[method-assign]
    readcache.read_opened = clocked("shard_reads", originals[1])
    ReadAhead.using = clocked("read_records", originals[2])  # type: ignore[method-assign]
    try:
        yield spent
    finally:
        BatchRef.read_records = originals[0]  # type: ignore[method-assign]
        readcache.read_opened = originals[1]
        ReadAhead.using = originals[2]  # type: ignore[method-assign]


def read_case(
    workload: Workload, n_train: int = 256, n_test: int = 32, repeats: int = 3, matmul_size: int = 4096
) -> dict[str, Any]:
    """Exact influence of an fp32 store against torch.func + matmul, and the share of the query spent reading.

    Each round: a fresh ``open_store`` with the read cache emptied (``cold``: every shard read from the
    page cache and checked, as a process's first query), the same query again (``warm``: the shards the
    cache kept, as an influence query followed by another), self-influence (warm), one
    ``matmul_size``-cubed matmul, and the torch.func pass (train and test gradients plus the matmul).
    """
    model = workload.build()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    matmul = Matmul(matmul_size)
    keys = ("cold", "warm", "self_influence_warm", "cold_read", "cold_shard_reads", "warm_read", "matmul")
    times: dict[str, list[float]] = {key: [] for key in keys}
    func_runs = []
    with tempfile.TemporaryDirectory(prefix="msbench-") as tmp:
        path = Path(tmp) / "fp32"
        write_store(path, model, workload, n_train, n_test, "fp32")
        store_bytes = sum(p.stat().st_size for p in path.glob("*.safetensors"))
        open_store(path).influence("train", "test")  # warm-up: the shards in the page cache
        for _ in range(repeats):
            readcache.SHARDS.clear()
            store = open_store(path)
            for when in ("cold", "warm"):
                with read_clock() as spent:
                    scores, seconds = timed(lambda store=store: store.influence("train", "test").scores)
                times[when].append(seconds)
                times[f"{when}_read"].append(spent["read_records"])
                if when == "cold":
                    times["cold_shard_reads"].append(spent["shard_reads"])
            times["self_influence_warm"].append(timed(lambda store=store: store.self_influence("train"))[1])
            times["matmul"].append(matmul())
            func_runs.append(torch_func_pass(model, workload, n_train, n_test))
        flops = plan_flops(open_store(path))
        if sorted(open_store(path).parameters()) != sorted(names):
            raise RuntimeError(f"the store did not capture exactly the trainable parameters {names}")
    func_t = [r["times"]["grads_train"] + r["times"]["grads_test"] + r["times"]["matmul"] for r in func_runs]
    m = {key: median(value) for key, value in times.items()}
    matmul_rate = matmul.gflops(m["matmul"])
    return {
        "workload": workload.name,
        "n_train": n_train,
        "n_test": n_test,
        "threads": torch.get_num_threads(),
        "parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "store_bytes": store_bytes,
        "repeats": repeats,
        "influence_s": {"store_cold": m["cold"], "store_warm": m["warm"], "torch.func+matmul": median(func_t)},
        "self_influence_warm_s": m["self_influence_warm"],
        "speedup_vs_torch.func": {"cold": median(func_t) / m["cold"], "warm": median(func_t) / m["warm"]},
        "read_share": {
            "cold": m["cold_read"] / m["cold"],
            "cold_read_s": m["cold_read"],
            "cold_file_reads_and_checksums_s": m["cold_shard_reads"],
            "warm": m["warm_read"] / m["warm"],
            "warm_read_s": m["warm_read"],
        },
        "rate": {
            "plan_gflop": flops / 1e9,
            "matmul_gflops_per_s": matmul_rate,
            "query_cold_vs_matmul": flops / m["cold"] / 1e9 / matmul_rate,
            "dot_products_cold_vs_matmul": flops / (m["cold"] - m["cold_read"]) / 1e9 / matmul_rate,
            "dot_products_warm_vs_matmul": flops / (m["warm"] - m["warm_read"]) / 1e9 / matmul_rate,
        },
        "agreement_vs_torch.func": rel_error(scores, func_runs[-1]["scores"]),
        "times_s": times,
        "load_average": list(os.getloadavg()),  # other jobs on the machine: 1, 5 and 15 minutes
    }


def checksum_rates(megabytes: int = 64, repeats: int = 7) -> dict[str, float]:
    """GiB/s (median of ``repeats``) of each checksum over one ``megabytes`` MiB random buffer, and of copying it;
    CRC32C where ``crc32c`` or ``google-crc32c`` is installed."""
    import hashlib
    import zlib

    import xxhash

    data = np.random.default_rng(0).integers(0, 256, megabytes * 2**20, dtype=np.uint8).tobytes()
    candidates: dict[str, Callable[[bytes], Any]] = {
        "sha256": lambda b: hashlib.sha256(b).digest(),
        "xxh3_128": xxhash.xxh3_128_digest,
        "xxh3_64": xxhash.xxh3_64_digest,
        "zlib.crc32": zlib.crc32,
        "copy": bytearray,
    }
    for module, name in (("crc32c", "crc32c"), ("google_crc32c", "value")):
        try:
            candidates[f"crc32c ({module})"] = getattr(importlib.import_module(module), name)
        except ImportError:
            pass
    rates = {}
    for label, fn in candidates.items():
        fn(data)
        rates[label] = megabytes / 1024 / median([timed(lambda fn=fn: fn(data))[1] for _ in range(repeats)])
    return rates


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """``python -m metastore_bench.analytics_bench [--repeats 3] [--threads 2] [--out result.json]``: the issue 35
    case (MiniLM reviews, T = 64, 256 train x 32 test, fp32) and the checksum rates, printed as JSON."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-train", type=int, default=256)
    parser.add_argument("--n-test", type=int, default=32)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {
        "checksums_gib_per_s": checksum_rates(),
        "minilm": read_case(minilm_reviews_workload(), args.n_train, args.n_test, args.repeats),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return result


if __name__ == "__main__":
    main()
