"""Compaction of a metadata-only store of 10^7 samples (issue 29): every sample must open after it.

``python -m metastore_bench.compaction_scale [--samples 10000000] [--target-mb 256] [--dir PATH]`` (from the
repository root) writes a rank 0 store of ``--samples`` samples (sample id, label and loss each; no records)
directly, 100 batches of 100 samples per shard, as the writer lays shards and journal lines out (building it
with a training loop would take hours), then runs ``compact`` as ``metastore compact --target-mb`` does, opens
the store and checks that it lists every sample id once. It prints the time and peak memory of each step, the
journal's size and its longest line against the reader's cap, and merges the figures into
``metastore_bench/results/compaction_scale.json``. With the code before issue 29 the same run printed "86 -> 1"
and opened with 0 samples (a 275 MB line at 8.6 M samples, over the 256 MiB cap).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save

from metastore_plugins import open_store
from metastore_plugins.core.store.maintenance.compaction import compact
from metastore_plugins.core.store.shards import manifest as mf
from metastore_plugins.core.store.shards.entries import new_entry
from metastore_plugins.core.store.shards.journal import MAX_LINE_BYTES, encode_line

BATCHES, SIZE = 100, 100  # per shard: 10^4 samples
RESULTS = Path(__file__).resolve().parent / "results" / "compaction_scale.json"


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build(path: Path, samples: int) -> None:
    """The store, written directly: manifest, shards (safetensors of the batches' metadata tensors), journal."""
    path.mkdir(parents=True)
    (path / mf.manifest_name(0)).write_text(json.dumps(mf.new_manifest(0, {})))
    first = 0
    with open(path / "index-rank0.jsonl", "wb") as journal:
        for s in range(samples // (BATCHES * SIZE)):
            tensors: dict[str, torch.Tensor] = {}
            infos: list[tuple[dict[str, Any], dict[str, torch.Tensor]]] = []
            for j in range(BATCHES):
                ids = torch.arange(first, first + SIZE, dtype=torch.int64)  # (B,)
                meta = {"sample_id": ids, "label": ids % 7, "loss": (ids % 11).float() / 10}
                tensors.update({f"b{j}/meta/{key}": value for key, value in meta.items()})
                step = first // SIZE
                info = {"capture_point": "train", "step": step, "epoch": 0, "micro_batch": 0, "size": SIZE, "lr": None}
                infos.append((info | {"records": []}, meta))
                first += SIZE
            blob = save(tensors, metadata={"format": mf.FORMAT, "encoding": "fp32"})
            name = mf.shard_name(0, s)
            (path / name).write_bytes(blob)
            entry = new_entry(name, len(blob), hashlib.sha256(blob).hexdigest(), "fp32", 0, infos)
            journal.write(encode_line(entry.to_json()))


def _journal(path: Path) -> dict[str, int]:
    lengths = [len(line) for line in (path / "index-rank0.jsonl").read_bytes().splitlines(keepends=True)]
    return {"lines": len(lengths), "bytes": sum(lengths), "longest_line": max(lengths), "line_cap": MAX_LINE_BYTES}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10**7)
    parser.add_argument("--target-mb", type=int, default=256)
    parser.add_argument("--dir", type=Path, default=None, help="where to build the store (default: a temp dir)")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(dir=args.dir))
    path = root / "store"
    out: dict[str, Any] = {"samples": args.samples, "target_mb": args.target_mb}
    try:
        start = time.perf_counter()
        build(path, args.samples)
        out["build_s"] = time.perf_counter() - start
        out["before"] = _journal(path)
        start = time.perf_counter()
        report = compact(path, target_bytes=args.target_mb * 2**20)
        out["compact_s"] = time.perf_counter() - start
        out["shards"] = f"{report.shards_before} -> {report.shards_after}"
        out["skipped"] = report.skipped
        out["after"] = _journal(path)
        start = time.perf_counter()
        ids = open_store(path).sample_ids()
        out["open_and_sample_ids_s"] = time.perf_counter() - start
        out["samples_after"] = int(len(ids))
        out["every_sample_once"] = bool(np.array_equal(np.sort(ids), np.arange(args.samples)))
        out["peak_rss_mib"] = _peak_mib()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out, indent=2))
    RESULTS.parent.mkdir(exist_ok=True)
    runs = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    runs[str(args.samples)] = out
    RESULTS.write_text(json.dumps(runs, indent=2) + "\n")
    if not out["every_sample_once"]:
        sys.exit(1)
    return out


if __name__ == "__main__":
    main()
