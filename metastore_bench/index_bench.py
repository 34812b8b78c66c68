"""Top-10 through the nearest-gradient index against the exhaustive scan, on synthetic sketch vectors.

The vectors have the width the index keeps for a real plan: ``k x k = 64`` for the MiniLM and
BERT-base plans' 8x8 projections (summed over layers, see docs/policies.md), 256 for 16x16.
Rows are clustered like gradients (a few hundred directions, log-normal norms, noise), queries
drawn the same way. Per row count: the exhaustive scan (numpy, and FAISS ``IndexFlatIP``), the
plan :func:`~metastore_plugins.core.analysis.vector_search.choose_plan` picks, and IVF at several
``nprobe``: median single-query top-10 latency, recall@10 against the exhaustive scan of the same
scores, build time and bytes.

    nice -n 10 python -m metastore_bench.index_bench --rows 100000 1000000 --dim 64
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from metastore_plugins.core.analysis import vector_index as vi
from metastore_plugins.core.analysis import vector_search as vs


def synthetic(rows: int, width: int, seed: int, clusters: int = 256) -> np.ndarray:
    """``(rows, width)`` float32: cluster directions + noise, log-normal norms (gradients are heavy-tailed)."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((clusters, width)).astype(np.float32)
    out = np.empty((rows, width), np.float32)
    for start in range(0, rows, 1 << 16):
        n = min(1 << 16, rows - start)
        picked = centers[rng.integers(0, clusters, n)]
        block = picked + 0.7 * rng.standard_normal((n, width)).astype(np.float32)
        out[start : start + n] = block * rng.lognormal(0.0, 0.5, (n, 1)).astype(np.float32)
    return out


def lowrank_blocks(
    rows: int, width: int, seed: int, rank: int = 128, clusters: int = 256, noise: float = 0.1, block: int = 1 << 14
) -> Iterator[np.ndarray]:
    """The rows of :func:`lowrank_rows`, ``block`` at a time ``(b, width)`` float32, never all in memory."""
    basis_rng, rng = np.random.default_rng(0), np.random.default_rng(seed + 1)
    spectrum = (np.arange(1, rank + 1) ** -0.5).astype(np.float32)  # (rank,)
    basis = (basis_rng.standard_normal((rank, width)) / np.sqrt(width)).astype(np.float32)  # (rank, width)
    centres = basis_rng.standard_normal((clusters, rank)).astype(np.float32) * spectrum  # (clusters, rank)
    sigma = float(np.sqrt(noise / (1 - noise) * 1.49 * float((spectrum**2).sum()) / width))
    for start in range(0, rows, block):
        n = min(block, rows - start)
        z = centres[rng.integers(0, clusters, n)] + 0.7 * rng.standard_normal((n, rank), np.float32) * spectrum
        found = z @ basis + sigma * rng.standard_normal((n, width), np.float32)  # (n, width)
        yield found * rng.lognormal(0.0, 0.5, (n, 1)).astype(np.float32)


def lowrank_rows(path: Path, rows: int, width: int, seed: int) -> np.ndarray:
    """``(rows, width)`` float32 written in blocks to a ``.npy`` file at ``path`` and memory-mapped: like
    :func:`synthetic` (clusters, log-normal norms) but of low effective rank, as per-sample gradients are.

    Row ``i`` is ``s_i (U z_i + e_i)``: ``U`` a fixed ``(width, 128)`` Gaussian basis, ``z_i`` one of 256 cluster
    centres plus 0.7 times a within-cluster draw, both with a spectrum decaying as ``j^-1/2``; ``e_i`` isotropic
    noise carrying 10% of the energy; ``s_i`` log-normal (sigma 0.5). Every seed shares the basis and centres;
    ``seed`` picks the rows (queries: another seed, the same clusters). Blocks: :func:`lowrank_blocks`."""
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, width))
    start = 0
    for block in lowrank_blocks(rows, width, seed):
        out[start : start + len(block)] = block
        start += len(block)
    out.flush()
    return out


def top10(scores: np.ndarray) -> set[int]:
    return set(np.argpartition(-scores, 9)[:10].tolist())


def median_ms(fn, queries: np.ndarray) -> float:
    times = []
    for q in queries:
        start = time.perf_counter()
        fn(q[None])
        times.append(time.perf_counter() - start)
    return 1000 * float(np.median(times))


def run(rows: int, width: int, n_queries: int, nprobes: list[int]) -> dict:
    faiss = vs.load_faiss()
    vectors = synthetic(rows, width, 0)
    queries = synthetic(n_queries, width, 1)
    truth = [top10(vectors @ q) for q in queries]
    result: dict = {"rows": rows, "width": width, "queries": n_queries, "vector_bytes": vectors.nbytes}
    index = vs.VectorIndex("bench", int(round(width**0.5)), np.arange(rows), np.ones(rows), vectors, vs.Plan())
    result["numpy_scan_ms"] = median_ms(lambda q: index.search(q, 10), queries)
    result["plan"] = vars(vs.choose_plan(rows, width, faiss is not None))
    if faiss is None:
        return result
    flat = faiss.IndexFlatIP(width)
    flat.add(vectors)
    result["faiss_flat_ms"] = median_ms(lambda q: flat.search(q, 10), queries)
    plan = vs.choose_plan(rows, width, True)
    nlist = plan.nlist or int(min(65536, max(64, 2 ** round(np.log2(4 * np.sqrt(rows))))))
    start = time.perf_counter()
    ann = vs.build_ivf(vectors, vs.Plan("ivf", nlist, nlist // 4), faiss)  # as the library builds it
    result["ivf"] = {"nlist": nlist, "build_s": time.perf_counter() - start}
    result["ivf"]["bytes"] = int(faiss.serialize_index(ann).nbytes)
    result["ivf"]["by_nprobe"] = []
    for nprobe in sorted({*nprobes, max(1, nlist // 4)}):
        ivf = vs.VectorIndex("bench", 8, np.arange(rows), np.ones(rows), vectors, vs.Plan("ivf", nlist, nprobe), ann)
        found = [set(ivf.search(q[None], 10)[0].tolist()) for q in queries]
        recall = np.mean([len(t & f) / 10 for t, f in zip(truth, found)])
        wide = [set(ivf.search(q[None], 50)[0].tolist()) for q in queries]  # the candidates a query rescores
        whole = np.mean([t <= f for t, f in zip(truth, wide)])  # exhaustive top-10 inside the 50 candidates
        ms = median_ms(lambda q, index=ivf: index.search(q, 10), queries)
        result["ivf"]["by_nprobe"].append(
            {"nprobe": nprobe, "recall_at_10": float(recall), "top10_in_50": float(whole), "median_ms": ms}
        )
    return result


def exhaustive_top(vectors: np.ndarray, queries: np.ndarray, count: int, block: int = 1 << 15) -> np.ndarray:
    """``(M, count)`` rows of the largest ``<v_i, q>`` per query, by a scan of ``block`` rows at a time (float64)."""
    best = np.zeros((len(queries), 0), np.int64)
    scores = np.zeros((len(queries), 0))
    q = queries.astype(np.float64).T  # (D, M)
    for start in range(0, len(vectors), block):
        part = np.asarray(vectors[start : start + block]).astype(np.float64) @ q  # (b, M)
        rows = np.hstack([best, np.arange(start, start + len(part))[None].repeat(len(queries), 0)])
        both = np.hstack([scores, part.T])  # (M, count + b)
        keep = np.argpartition(-both, count - 1, axis=1)[:, :count]
        best, scores = np.take_along_axis(rows, keep, 1), np.take_along_axis(both, keep, 1)
    return best


def reduced_run(train: Path, test: Path, reduced: list[int], candidates: list[int], scans: int) -> dict:
    """The full-width rows of ``train`` (a ``.npy`` from :func:`lowrank_rows`, memory-mapped) searched through
    ``Plan("reduced")`` at each reduced width and candidate count, against the exhaustive scan."""
    faiss = vs.load_faiss()
    vectors, queries = np.load(train, mmap_mode="r"), np.asarray(np.load(test), np.float32)
    rows, width = vectors.shape
    result: dict = {"rows": rows, "width": width, "queries": len(queries), "vector_bytes": int(vectors.nbytes)}
    result["plan"] = vars(vs.choose_plan(rows, width, faiss is not None))
    start = time.perf_counter()
    truth = [set(t.tolist()) for t in exhaustive_top(vectors, queries, 10)]
    result["reference_s"] = time.perf_counter() - start
    flat = vs.VectorIndex("bench", 8, np.arange(rows), np.ones(rows), vectors, vs.Plan())
    result["exhaustive_scan_ms"] = median_ms(lambda q: flat.search(q, 10), queries[:scans])
    result["by_reduced"] = []
    for width_r in reduced:
        start = time.perf_counter()
        ann = vs.build_reduced(vectors, np.ones(rows), vs.Plan("reduced", reduced=width_r), faiss)
        found: dict = {"reduced": width_r, "build_s": time.perf_counter() - start}
        found["bytes"] = int(faiss.serialize_index(ann).nbytes)
        found["runs"] = []
        for count in candidates:
            plan = vs.Plan("reduced", reduced=width_r, candidates=count)
            index = vs.VectorIndex("bench", 8, np.arange(rows), np.ones(rows), vectors, plan, ann)
            got = [set(index.search(q[None], 10)[0].tolist()) for q in queries]
            recall = float(np.mean([len(t & g) / 10 for t, g in zip(truth, got)]))
            whole = float(np.mean([t == g for t, g in zip(truth, got)]))
            ms = median_ms(lambda q, index=index: index.search(q, 10), queries)
            line = {"candidates": count, "recall_at_10": recall, "top10_equal": whole, "median_ms": ms}
            print(json.dumps({"reduced": width_r, **line}), flush=True)
            found["runs"].append(line)
        result["by_reduced"].append(found)
        del ann
    return result


def store_run(rows: int, layers: int, n_queries: int, path: Path, low_rank: bool = False, compared: int = 5) -> dict:
    """A synthetic store kept projected 8x8 (``layers`` layers, fp16, batches of 32) at ``rows`` training rows:
    the exhaustive ``store.influence(...).top(10)`` of ``compared`` test samples against ``influence(..., k=10)``,
    and for every test sample the top-10 by a scan of the index's own vectors (the same estimates); rows from
    :func:`lowrank_blocks` with ``low_rank`` (generated block by block), else :func:`synthetic`."""
    import tempfile

    import torch

    from metastore_plugins import StoreWriter, open_store
    from metastore_plugins.core.analysis.sketches import sketch_layers
    from metastore_plugins.core.records import LayerRecord

    def records(vectors: np.ndarray) -> list[LayerRecord]:  # (B, layers, 64) -> one projected record per layer
        b = len(vectors)
        return [
            LayerRecord(
                f"layer{i}",
                "projected",
                b,
                {"weight": f"layer{i}.weight"},
                {"weight": (384, 384)},
                {
                    "projected": torch.from_numpy(vectors[:, i].reshape(b, 8, 8).copy()),
                    "sq_norm": torch.from_numpy((vectors[:, i] ** 2).sum(1)),
                },
            )
            for i in range(layers)
        ]

    root = Path(tempfile.mkdtemp(dir=path))
    width = layers * 64
    if low_rank:
        blocks: Iterator[np.ndarray] = lowrank_blocks(rows, width, 0)
        test = next(lowrank_blocks(n_queries, width, 1, block=n_queries)).reshape(n_queries, layers, 64)
    else:
        blocks = iter([synthetic(rows, width, 0)])
        test = synthetic(n_queries, width, 1).reshape(n_queries, layers, 64)
    start, first, step = time.perf_counter(), 0, 0
    with StoreWriter(root, encoding="fp16") as writer:
        for block in blocks:
            block = block.reshape(len(block), layers, 64)
            for at in range(0, len(block), 32):
                part = block[at : at + 32]
                ids = np.arange(first, first + len(part))
                writer.write(records(part), sample_ids=ids, step=step, capture_point="final/train", lr=0.1)
                first, step = first + len(part), step + 1
        writer.write(records(test), sample_ids=np.arange(rows, rows + n_queries), step=0, capture_point="final/test")
    result: dict = {"rows": rows, "layers": layers, "write_s": time.perf_counter() - start}
    store = open_store(root)
    result["store_bytes"] = sum(f.stat().st_size for f in root.glob("*.safetensors"))
    test_ids = [rows + j for j in range(n_queries)]
    times, exhaustive = [], []
    for j in test_ids[: min(compared, n_queries)]:  # a full scan per test sample: a few suffice
        start = time.perf_counter()
        exhaustive.append(store.influence("final/train", "final/test", test_ids=[j]).top(10)[0])
        times.append(time.perf_counter() - start)
    result["exhaustive_ms"] = 1000 * float(np.median(times)) if times else None
    start = time.perf_counter()
    built = store.build_vector_index("final/train")
    result["index_build_s"] = time.perf_counter() - start
    result["index_plan"] = vars(built.plan)
    result["index_bytes"] = sum(f.stat().st_size for f in (root / "vector_index").iterdir())
    times, tops, same, scanned = [], [], [], []
    for j in test_ids:  # timed back to back: the reference scans below would evict the page cache between them
        start = time.perf_counter()
        tops.append(store.influence("final/train", "final/test", test_ids=[j], k=10).top(10)[0])
        times.append(time.perf_counter() - start)
    order = sketch_layers(store, None)  # the index's layers, in its order
    for n, (j, top) in enumerate(zip(test_ids, tops)):
        got = [{i for i, _ in top[d]} for d in ("proponents", "opponents")]
        if n < len(exhaustive):
            same.append(got == [{i for i, _ in exhaustive[n][d]} for d in ("proponents", "opponents")])
        query = vi._test_sketches(store, "final/test", [j], built, order, 0)[1][0]  # (D,) as the index lays it out
        scores = (built.vectors @ query.astype(np.float32)) * built.lr  # (N,) every row's estimate
        best = [set(built.sample_ids[np.argpartition(-sign * scores, 9)[:10]].tolist()) for sign in (1, -1)]
        scanned.append(got == best)
    result["index_query_ms"] = 1000 * float(np.median(times))
    result["top10_equal"] = float(np.mean(same)) if same else None
    result["top10_equal_to_index_scan"] = float(np.mean(scanned))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="*", default=[100_000])
    parser.add_argument("--dim", type=int, default=64, help="vector width (64: 8x8 projections)")
    parser.add_argument("--queries", type=int, default=50)
    parser.add_argument("--nprobe", type=int, nargs="+", default=[32, 64, 128, 512])
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    parser.add_argument("--train", type=Path, help="full-width rows (.npy, see lowrank_rows): the reduced plan's run")
    parser.add_argument("--test", type=Path, help="the queries of --train (.npy)")
    parser.add_argument("--generate", type=int, nargs=2, metavar=("ROWS", "WIDTH"), help="write --train/--test first")
    parser.add_argument("--reduced", type=int, nargs="+", default=[64], help="principal directions (--train)")
    parser.add_argument("--candidates", type=int, nargs="+", default=[512], help="rows rescored per query (--train)")
    parser.add_argument("--scans", type=int, default=5, help="exhaustive single-query scans timed (--train)")
    parser.add_argument("--store", type=int, help="also a synthetic projected store of this many training rows")
    parser.add_argument("--layers", type=int, default=6, help="layers of that store (8x8 each)")
    parser.add_argument("--low-rank", action="store_true", help="that store's rows from lowrank_blocks")
    parser.add_argument("--compared", type=int, default=5, help="its test samples also scored exhaustively")
    parser.add_argument("--tmp", type=Path, default=Path("/tmp"), help="where that store is written")
    args = parser.parse_args()
    results = []
    if args.generate:
        start = time.perf_counter()
        lowrank_rows(args.test, args.queries, args.generate[1], 1)
        lowrank_rows(args.train, args.generate[0], args.generate[1], 0)
        print(json.dumps({"generated_s": time.perf_counter() - start}), flush=True)
    if args.train:
        found = reduced_run(args.train, args.test, args.reduced, args.candidates, args.scans)
        print(json.dumps(found), flush=True)
        results.append(found)
    if args.store:
        found = store_run(args.store, args.layers, args.queries, args.tmp, args.low_rank, args.compared)
        print(json.dumps(found), flush=True)
        results.append(found)
    for rows in args.rows:
        found = run(rows, args.dim, args.queries, args.nprobe)
        print(json.dumps(found), flush=True)
        results.append(found)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
